"""VPPO beside GRPO and PAPO-G on ``testbed:shapes_shortcut``, where GRPO drifts off the image.

    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/vppo_shortcut.py train 0,1,2 OUT   # one process per seed set
    .venv/bin/python docs/measurements/vppo_shortcut.py report OUT [OUT ...]

``train`` scores the warm start and trains, seed by seed, the GRPO and VPPO arms of ``params/study_shortcut.yaml``
(``papo_nb.workbook.study.arms.run_one``, LoRA, 60 steps; VPPO at gamma 0 with everything else as GRPO), writing
``OUT/results.json`` after each seed. ``report`` pairs them by seed with the PAPO-G arms of the published
``docs/study/shortcut_lora`` page (same warm start, seeds and settings; it refuses to pair when this run's GRPO differs
from the page's on a seed), and prints the drift from the warm start and each arm against GRPO with the study's own
statistics (``papo_nb.workbook.study.drift``: paired t, 95% CI, TOST, MDE, the prior-following share of errors).
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


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        train([int(s) for s in rest[0].split(",")], Path(rest[1]))
    else:
        report([Path(p) for p in rest])
