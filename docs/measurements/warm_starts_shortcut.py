"""The controls page's whole design on more than one warm start (issue 41, item 3): ``params/study_controls.yaml``
(40 steps, LoRA, 5 seeds, the same held-out set) on fresh builds of ``testbed:shapes_shortcut`` from other build
seeds, beside the page's own runs on the pinned seed-0 build.

    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/warm_starts_shortcut.py train BUILD OUT [PARAMS]
    .venv/bin/python docs/measurements/warm_starts_shortcut.py page OUT [OUT ...]
    .venv/bin/python docs/measurements/warm_starts_shortcut.py full-page OUT [OUT ...]
    .venv/bin/python docs/measurements/warm_starts_shortcut.py calibrated-page OUT [OUT ...]
    .venv/bin/python docs/measurements/warm_starts_shortcut.py search-from-store OUT


``full-page`` writes the ``OUT``s trained with ``params/study_controls_full.yaml`` (full fine-tuning) as
``docs/study/shortcut_controls_full/``, ``calibrated-page`` those trained with ``params/study_calibrated.yaml`` (issue
56: each warm start at its own collapse gamma, every arm and each search call kept) as
``docs/study/shortcut_calibrated/`` (``calibrated_page.py`` beside this script). ``search-from-store`` adds the search
calls to a ``results.json`` written before ``train`` recorded them, from the runs' own MLflow store.

``train`` builds the warm start of build seed ``BUILD`` (``papo_nb.testbed.policy.build_testbed``: a build that misses
its card's goal raises) and runs notebook 04's calibrated study on it (``papo_nb.workbook.study.arms.run_study``: the
warm start scored before RL, the collapse check on the search seed, PAPO-G at the recipe's gamma and at half the
collapse gamma, GRPO held back by beta and by the learning rate, each matched on this warm start's search seed), then
the placebo arms as ``docs/measurements/placebo_shortcut.py`` trains them on the seed-0 page: the placebo at the
strongest PAPO-G gamma, and at the gamma that matches its starting perception KL to PAPO-G's on this warm start, with
PAPO-G under the placebo's fill at that gamma. ``OUT/results.json`` holds the warm start (its card with the weights'
SHA-256, start scores, collapse gamma, control searches), every run and each call of the collapse search. ``page``
pools those builds with the page's seed-0 runs into ``docs/study/shortcut_warm_starts/``
(``warm_starts_page.py`` beside this script).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROLS_PAGE = ROOT / "docs" / "study" / "shortcut_controls_lora"
PAGE = ROOT / "docs" / "study" / "shortcut_warm_starts"
FULL_PAGE = ROOT / "docs" / "study" / "shortcut_controls_full"
PARAMS = "params/study_controls.yaml"
TESTBED = "shapes_shortcut"
PAPO_ARM = "papo_g_half"


def train(build: int, out: Path, params_file: str = PARAMS) -> None:
    from warm_start_runs import train_warm_start

    from papo_nb.testbed.policy import build_testbed, pinned_testbed
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study import placebo

    # build 0: the shipped (pinned) weights every page of this testbed ran; another build seed: a fresh build
    folder = pinned_testbed(TESTBED) if build == 0 else build_testbed(TESTBED, seed=build)
    params = load_params(ROOT / params_file, [] if build == 0 else [f"model_name_or_path={folder}"])
    placebos = (placebo.PLACEBO, placebo.PLACEBO_KL_MATCHED, placebo.MEAN_FILL_KL_MATCHED)
    train_warm_start(
        params, params_file, build, folder, out, PAPO_ARM, placebos, f"warm-start-{build}-shortcut-controls"
    )


def search_from_store(out: Path) -> None:
    """Add the search runs (``search``: every call, the collapse gamma's too) to an ``OUT/results.json`` written
    before ``train`` recorded them, read back from the MLflow store the runs logged to (``OUT/mlflow.db``): each
    call's gamma, seed, per-step logs and collapse verdict."""
    from mlflow import MlflowClient
    from mlflow.artifacts import load_dict

    from papo_nb.workbook.config.evidence_names import ARM_COLLAPSE
    from papo_nb.workbook.study.arms import PAPO_G_COLLAPSE, SEARCH, STEP_METRICS

    record = json.loads((out / "results.json").read_text())
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    experiment = client.search_experiments()[0].experiment_id
    found = [run for arm in (SEARCH, PAPO_G_COLLAPSE)  # the call at the collapse gamma is named the collapse arm
             for run in client.search_runs(experiment, f"tags.papo_nb.study_arm = '{arm}'")]  # fmt: skip
    search = []
    for run in sorted(found, key=lambda r: r.info.start_time):
        steps: dict[int, dict] = {}
        for key in STEP_METRICS:
            for metric in client.get_metric_history(run.info.run_id, key):
                steps.setdefault(metric.step, {"step": metric.step})[key] = metric.value
        search.append({
            "arm": SEARCH, "seed": int(run.data.params["seed"]), "gamma": float(run.data.params["gamma"]),
            "run_id": run.info.run_id, "step_logs": [steps[s] for s in sorted(steps)],
            "collapse": load_dict(f"{run.info.artifact_uri}/{ARM_COLLAPSE}"),
        })  # fmt: skip
    record["search"] = search
    (out / "results.json").write_text(json.dumps(record))
    print(f"{out}: {len(search)} search runs from the store", flush=True)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        train(int(rest[0]), Path(rest[1]), *rest[2:])
    elif command == "calibrated-page":  # issue 56: every warm start at its own collapse gamma
        from calibrated_page import write_page as write_calibrated_page

        print(write_calibrated_page([Path(p) for p in rest]))
    elif command == "search-from-store":
        search_from_store(Path(rest[0]))
    elif command in ("page", "full-page"):
        from warm_starts_page import write_page

        if command == "page":
            write_page(PAGE, [Path(p) for p in rest], CONTROLS_PAGE)
        else:
            write_page(FULL_PAGE, [Path(p) for p in rest])
    else:
        allowed = "train, search-from-store, page, full-page, calibrated-page"
        raise SystemExit(f"command={command!r} is unknown; allowed: {allowed}")
