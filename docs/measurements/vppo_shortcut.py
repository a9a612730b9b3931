"""VPPO beside GRPO and PAPO-G on ``testbed:shapes_shortcut``, where GRPO drifts off the image.

    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/vppo_shortcut.py train 0,1,2 OUT   # one process per seed set
    .venv/bin/python docs/measurements/vppo_shortcut.py report OUT [OUT ...]
    .venv/bin/python docs/measurements/vppo_shortcut.py page OUT [OUT ...]   # docs/study/shortcut_vppo_lora

``train`` scores the warm start and trains, seed by seed, the GRPO and VPPO arms of ``params/study_shortcut.yaml``
(``papo_nb.workbook.study.arms.run_one``, LoRA, 60 steps; VPPO at gamma 0 with everything else as GRPO), writing
``OUT/results.json`` after each seed. ``report`` pairs them by seed with the PAPO-G arms of the published
``docs/study/shortcut_lora`` page (same warm start, seeds and settings; it refuses to pair when this run's GRPO differs
from the page's on a seed), and prints the drift from the warm start and each arm against GRPO with the study's own
statistics (``papo_nb.workbook.study.drift``: paired t, 95% CI, TOST, MDE, the prior-following share of errors).
``page`` writes the study page ``docs/study/shortcut_vppo_lora``: the published page's runs with the VPPO runs added
(their per-step logs read from ``OUT/mlflow.db``, their collapse verdicts recomputed as ``arms.run_one`` does), then
the page itself through ``rebuild_page.py`` beside this script, which regenerates it from those files alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "study" / "shortcut_lora"
PAGE_ARMS = ("papo_g", "papo_g_eighth", "papo_g_quarter", "papo_g_half")


def train(seeds: list[int], out: Path) -> None:
    import mlflow

    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study import arms
    from papo_nb.workbook.study.collapse import CollapseRule

    out.mkdir(parents=True, exist_ok=True)
    params = load_params(ROOT / "params" / "study_shortcut.yaml", ["study_vppo=true", f"study_seeds={seeds}"])
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow.db")
    data, rule, results = arms.eval_dataset(params), CollapseRule(), {"grpo": {}, "vppo": {}}
    start_time = time.time()
    with mlflow.start_run(run_name="vppo-vs-grpo-shortcut"):
        start = arms._start_scores(params, data)
        for seed in seeds:
            grpo = arms.run_one(params, arms.GRPO, seed, 0.0, data, out / "runs", rule)
            vppo = arms.run_one(params, arms.VPPO, seed, 0.0, data, out / "runs", rule, control=grpo.scores)
            results["grpo"][seed], results["vppo"][seed] = grpo.scores, vppo.scores
            (out / "results.json").write_text(json.dumps({"start": start, "results": results}))
            print(f"seed {seed} done at {time.time() - start_time:.0f} s", flush=True)


def paired_results(outs: list[Path]) -> tuple[dict, dict[str, dict[int, dict]]]:
    """(warm-start scores, {arm: {seed: scores}}): this run's GRPO and VPPO with the page's PAPO-G arms."""
    start, results = None, {"grpo": {}, "vppo": {}}
    for out in outs:
        record = json.loads((out / "results.json").read_text())
        start = start or record["start"]
        for arm in results:
            results[arm].update({int(seed): scores for seed, scores in record["results"][arm].items()})
    seeds = sorted(results["vppo"])
    page = {(r["arm"], r["seed"]): r["scores"] for r in json.loads((PAGE / "runs.json").read_text())}
    for seed in seeds:
        ours, theirs = (
            results["grpo"][seed]["avg_at_k/original/vision"],
            page["grpo", seed]["avg_at_k/original/vision"],
        )
        if ours != theirs:
            raise SystemExit(f"seed {seed}: GRPO scored {ours} here and {theirs} on the page: not paired")
    for arm in PAGE_ARMS:
        results[arm] = {seed: page[arm, seed] for seed in seeds if (arm, seed) in page}
    return start, results


def report(outs: list[Path]) -> None:
    from papo_nb.workbook.study import drift

    start, results = paired_results(outs)
    print(f"seeds {sorted(results['vppo'])}; warm start avg@8 on prior-breaking items {start[drift.PRIMARY]:.4f}")
    print("\narm | metric | end | drift | 95% CI half | p")
    for row in drift.drift_rows(start, results):
        print(f"{row['arm']} | {row['metric']} | {row['end']:.4f} | {row['drift']:+.4f} | {row['drift_ci95']:.4f} | "
              f"{row['p_value']:.3g}")  # fmt: skip
    print("\narm vs grpo | pairs | diff | 95% CI half | p | TOST p | MDE | prior share (grpo) | verdict")
    gammas = dict.fromkeys(results, 0.0)
    for row in drift.arm_verdicts(results, gammas, "grpo"):
        print(f"{row['arm']} | {row['pairs']} | {row['diff']:+.4f} | {row['diff_ci95']:.4f} | {row['p_value']:.3g} | "
              f"{row['tost_p']:.3g} | {row['mde']:.4f} | {row['prior_share']:.3f} ({row['control_prior_share']:.3f}) "
              f"| {row['verdict']}")  # fmt: skip


VPPO_PAGE = ROOT / "docs" / "study" / "shortcut_vppo_lora"
COPIED = ("start_scores.json", "testbed_card.json")


def _vppo_runs(out: Path) -> dict[int, tuple[list[dict], float, float]]:
    """seed -> (per-step logs, the flagged collapse metric, run seconds) of each finished VPPO run in OUT/mlflow.db."""
    import sqlite3

    from papo_nb.workbook.study.arms import STEP_METRICS

    db = sqlite3.connect(out / "mlflow.db")
    runs = db.execute("select run_uuid, name from runs where name like 'vppo-gamma0-seed%' and status = 'FINISHED'")
    found = {}
    for run_id, name in runs.fetchall():
        rows: dict[int, dict] = {}
        for key, value, step in db.execute("select key, value, step from metrics where run_uuid = ?", (run_id,)):
            if key in STEP_METRICS:
                rows.setdefault(step, {"step": float(step)})[key] = value
        last = dict(db.execute("select key, value from latest_metrics where run_uuid = ?", (run_id,)).fetchall())
        found[int(name.rsplit("seed", 1)[1])] = (
            [rows[s] for s in sorted(rows)],
            last["collapse/flagged"],
            last["study/run_seconds"],
        )
    return found


def page(outs: list[Path]) -> None:
    import rebuild_page as rebuild

    from papo_nb.workbook.study.collapse import CollapseRule, detect_collapse, heldout_verdict

    _, results = paired_results(outs)  # refuses unless this run's GRPO is the page's on every seed
    runs = {seed: run for out in outs for seed, run in _vppo_runs(out).items()}
    VPPO_PAGE.mkdir(parents=True, exist_ok=True)
    records, logs = json.loads((PAGE / "runs.json").read_text()), json.loads((PAGE / "step_logs.json").read_text())
    rule, runtime = CollapseRule(), (PAGE / "results.md").read_text().split(" trained runs in ")[1]
    seconds = float(runtime.split(" s")[0])  # the page's wall; the VPPO runs' own seconds are added below
    for seed, scores in sorted(results["vppo"].items()):
        steps, flagged, run_seconds = runs[seed]
        collapse = heldout_verdict(detect_collapse(steps, rule), scores, results["grpo"][seed], rule)
        if float(collapse["collapsed"]) != flagged:
            raise SystemExit(f"seed {seed}: the collapse verdict recomputed here is not the run's")
        keep = ("collapsed", "step", "mode", "symptoms", "detected_by")
        records.append({"arm": "vppo", "gamma": 0.0, "seed": seed, "scores": scores,
                        "collapse": {k: collapse.get(k) for k in keep}})  # fmt: skip
        logs.append({"arm": "vppo", "gamma": 0.0, "seed": seed, "steps": steps})
        seconds += run_seconds
    for name in COPIED:
        (VPPO_PAGE / name).write_text((PAGE / name).read_text())
    summary = json.loads((PAGE / "summary.json").read_text())
    meta = {
        "params": "params/study_shortcut.yaml", "overrides": ["study_vppo=true"],
        "collapse_gamma": summary["collapse_gamma"], "collapse_found": summary["collapse_found"],
        "seconds": round(seconds),
        "origin": "the runs of docs/study/shortcut_lora (notebook 04, issue 41) and its VPPO arm, trained on the same "
        "seeds and warm start by docs/measurements/vppo_shortcut.py (issue 46), whose GRPO runs scored exactly "
        "the page's GRPO on every seed. Runtime: the page's wall plus the VPPO runs' own seconds.",
    }  # fmt: skip
    print(f"wrote {rebuild.write_page(VPPO_PAGE.relative_to(ROOT), records, logs, meta)}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        train([int(s) for s in rest[0].split(",")], Path(rest[1]))
    elif command == "page":
        page([Path(p) for p in rest])
    else:
        report([Path(p) for p in rest])
