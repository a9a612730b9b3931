"""A calibrated study page rewritten from its own committed files by the page generator notebook 04 uses
(``publish.write_results_page``), so a page assembled from runs of more than one session (a later VPPO arm beside
``docs/study/shortcut_lora``'s runs) is regenerated from the data beside it, never hand-written.

A page folder to rebuild holds ``runs.json``, ``step_logs.json``, ``start_scores.json``, ``testbed_card.json`` and
``rebuild.json``: the params file and overrides the runs were trained with, the collapse gamma the search chose, the
wall seconds of its runs, a line saying where its runs came from, and (a controls page) each matched control's search
(``controls``: arm, target and the (value, end reward) pairs tried).

    .venv/bin/python docs/measurements/rebuild_page.py docs/study/shortcut_vppo_lora
    .venv/bin/python scripts/publish_study.py   # then the summary tables, from every page's summary.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.study import dose, publish, report
from papo_nb.workbook.study.arms import PAPO_G_COLLAPSE, SEARCH, SWEEP, Study, StudyRun
from papo_nb.workbook.study.controls import ControlMatch
from papo_nb.workbook.study.plots import plot_accuracy, plot_learning_curves

REBUILD = "rebuild.json"


def read_meta(folder: Path) -> dict:
    """The page's ``rebuild.json``: params file, overrides, collapse gamma, seconds and origin of its runs."""
    return json.loads((folder / REBUILD).read_text())


def page_study(folder: str | Path, meta: dict | None = None) -> Study:
    """The ``Study`` a page's files describe: its arms' runs, the search's runs (``sweep``), the warm start's scores
    and the collapse gamma (``meta``, the page's ``rebuild.json``, read here when not given). Run ids and per-run
    seconds are not kept on a page: empty and 0."""
    folder = Path(folder)
    meta = read_meta(folder) if meta is None else meta
    records = json.loads((folder / publish.STEP_LOGS).read_text())
    logs = {(r["arm"], r["seed"], r["gamma"]): r["steps"] for r in records}
    study = Study(
        collapse_gamma=meta["collapse_gamma"],
        collapse_found=meta["collapse_found"],
        start_scores=json.loads((folder / publish.START).read_text()),
        controls=[
            ControlMatch(c["arm"], c["target"], [tuple(t) for t in c["tried"]]) for c in meta.get("controls", [])
        ],
    )
    for record in json.loads((folder / publish.RUNS).read_text()):
        key = (record["arm"], record["seed"], record["gamma"])
        run = StudyRun(*key, "", logs[key], record["scores"], record["collapse"], 0.0)
        (study.sweep if run.arm in (SEARCH, SWEEP) else study.runs).append(run)
    # the collapse arm is the search's run at the collapse gamma, counted twice as in ``arms._calibrated_study``;
    # a page keeps it once, under either name
    found = {run.seed for run in study.sweep if run.gamma == study.collapse_gamma}
    study.sweep += [replace(r, arm=SEARCH) for r in study.runs if r.arm == PAPO_G_COLLAPSE and r.seed not in found]
    study.sweep.sort(key=lambda run: run.gamma)
    collapse = [run for run in study.runs if run.arm == PAPO_G_COLLAPSE]
    collapse = collapse or [replace(r, arm=PAPO_G_COLLAPSE) for r in study.sweep if r.gamma == study.collapse_gamma]
    study.runs = [run for run in study.runs if run.arm != PAPO_G_COLLAPSE] + collapse  # last, as a study adds it
    return study


def write_page(folder: Path, records: list[dict], logs: list[dict], meta: dict) -> Path:
    """A page assembled from runs of more than one session: its ``runs.json``, ``step_logs.json`` and
    ``rebuild.json`` written, then the page rewritten from them (``rewrite_page``)."""
    (folder / publish.RUNS).write_text(json.dumps(records, indent=1) + "\n")
    (folder / publish.STEP_LOGS).write_text(json.dumps(logs, separators=(",", ":")) + "\n")
    (folder / REBUILD).write_text(json.dumps(meta, indent=1) + "\n")
    return rewrite_page(folder)


def rewrite_page(folder: str | Path) -> Path:
    """``results.md``, its figures, contrasts and ``summary.json`` written again from the page's own files."""
    folder = Path(folder)
    meta = read_meta(folder)
    params = load_params(meta["params"], [*meta["overrides"], f"study_report_dir={folder}"])
    study = page_study(folder, meta)
    chance, _ = report.study_chance(params)
    figures = {
        "dose_response": dose.plot_dose_response(dose.dose_rows(study), start=study.start_scores),
        "accuracy": plot_accuracy(study, chance=chance),
        "curves": plot_learning_curves(study),
    }
    card = json.loads((folder / publish.CARD).read_text())
    command = f"python docs/measurements/rebuild_page.py {folder}"
    origin = f"Rebuilt from this folder's files by `{command}`: {meta['origin']}"
    return publish.write_results_page(folder, params, study, card, figures, meta["seconds"], origin=origin)


if __name__ == "__main__":
    for page in sys.argv[1:]:
        print(f"wrote {rewrite_page(page)}")
