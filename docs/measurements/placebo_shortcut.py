"""The placebo arm (and PAPO-G with the placebo's fill) beside the matched controls of
``docs/study/shortcut_controls_lora`` (issue 41), on the page's seeds, warm start, steps and held-out set.

    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/placebo_shortcut.py train 0,1,2,3,4 OUT
    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/placebo_shortcut.py train-matched 0,1,2,3,4 OUT2 OUT
    OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/placebo_shortcut.py train-matched 0,1,2,3,4 OUT3 OUT \
        mean_fill_papo_g_kl_matched
    .venv/bin/python docs/measurements/placebo_shortcut.py page OUT OUT2 OUT3

``train`` trains, seed by seed, GRPO (to check the pairing), the placebo (``papo_nb.workbook.study.placebo``) and
PAPO-G with the placebo's mean fill over its usual patches, each at the page's strongest PAPO-G gamma, through
``papo_nb.workbook.study.arms.run_one`` with ``params/study_controls.yaml``; ``OUT/results.json`` holds every finished
run (scores, per-step logs, collapse verdict, seconds). ``train-matched`` trains the placebo again, into OUT2, at the
gamma where its term starts as large as PAPO-G's (``placebo.kl_matched_gamma``, from OUT's placebo runs and the page's
PAPO-G runs); with ``mean_fill_papo_g_kl_matched``, PAPO-G with the mean fill at that gamma, into OUT3. ``page``
refuses unless this run's GRPO scored exactly the page's GRPO on every seed, adds the placebo arms' runs to the page's
own files (``runs.json``, ``step_logs.json``), writes its ``rebuild.json`` and rewrites the page with
``rebuild_page.py`` (beside this script) from those files alone.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "study" / "shortcut_controls_lora"
PARAMS = "params/study_controls.yaml"


def strongest_gamma() -> float:
    """The page's strongest PAPO-G arm's gamma (the placebo's), from its runs."""
    runs = json.loads((PAGE / "runs.json").read_text())
    return max(r["gamma"] for r in runs if r["arm"].startswith("papo_g") and r["arm"] != "papo_g_collapse")


def train(seeds: list[int], out: Path, arm_gammas: dict[str, float] | None = None) -> None:
    """GRPO, the placebo and PAPO-G with the placebo's fill on ``seeds`` (or only ``arm_gammas``' arms at their
    gammas, each run's collapse verdict against the page's GRPO on its seed, which this run's GRPO matched)."""
    import mlflow

    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study import arms, placebo
    from papo_nb.workbook.study.collapse import CollapseRule

    out.mkdir(parents=True, exist_ok=True)
    params = load_params(ROOT / PARAMS, [f"study_seeds={seeds}"])
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow.db")
    data, rule, runs = arms.eval_dataset(params), CollapseRule(), []
    gamma = strongest_gamma()
    arm_gammas = arm_gammas or {arms.GRPO: 0.0, placebo.PLACEBO: gamma, placebo.MEAN_FILL_PAPO_G: gamma}
    page_grpo = {r["seed"]: r["scores"] for r in json.loads((PAGE / "runs.json").read_text()) if r["arm"] == "grpo"}
    start_time = time.time()
    with mlflow.start_run(run_name="placebo-shortcut-controls"):
        for arm, arm_gamma in arm_gammas.items():
            for seed in seeds:
                if arm == arms.GRPO:
                    run = arms.run_one(params, arm, seed, 0.0, data, out / "runs", rule)
                else:
                    arm_params = placebo.arm_params(params, arm)
                    run = arms.run_one(arm_params, arm, seed, arm_gamma, data, out / "runs", rule, page_grpo[seed])
                runs.append(run)
                (out / "results.json").write_text(json.dumps([asdict(r) for r in runs]))
                print(f"{arm} seed {seed} done at {time.time() - start_time:.0f} s", flush=True)


def train_matched(seeds: list[int], out: Path, placebo_out: Path, arm: str = "placebo_kl_matched") -> None:
    """``arm`` (the placebo, or PAPO-G with its mean fill) at ``kl_matched_gamma``: from ``placebo_out``'s placebo
    runs and the page's strongest PAPO-G arm."""
    from papo_nb.workbook.study import placebo

    gamma = strongest_gamma()
    logs = json.loads((PAGE / "step_logs.json").read_text())
    papo = [r["steps"] for r in logs if r["gamma"] == gamma and r["arm"].startswith("papo_g")]
    ours = [r["step_logs"] for r in json.loads((placebo_out / "results.json").read_text()) if r["arm"] == "placebo"]
    matched = round(placebo.kl_matched_gamma(gamma, papo, ours), 3)
    print(f"kl-matched gamma {matched} from {len(papo)} PAPO-G and {len(ours)} placebo runs", flush=True)
    train(seeds, out, {arm: matched})


# The matched controls' searches on the search seed, as the page's search table printed them before this rebuild (4
# significant digits; the runs were not kept). The table's value column had lost the learning rates (written before a
# fix); its rows are in the ladder's order, which params/study_controls.yaml holds: beta [1, 10], lr [0.001, 0.0025].
CONTROL_SEARCHES = [
    {"arm": "grpo_beta", "target": 0.5672, "tried": [[1.0, 0.6203], [10.0, 0.6]]},
    {"arm": "grpo_lr", "target": 0.5672, "tried": [[0.001, 0.6016], [0.0025, 0.6234]]},
]
KEEP = ("collapsed", "step", "mode", "symptoms", "detected_by")


def paired_runs(outs: list[Path]) -> list[dict]:
    """The placebo arms' runs of ``outs``; refuses unless their GRPO scored exactly the page's on every seed."""
    from papo_nb.workbook.study.placebo import check_pairing

    runs = [run for out in outs for run in json.loads((out / "results.json").read_text())]
    page = {r["seed"]: r["scores"] for r in json.loads((PAGE / "runs.json").read_text()) if r["arm"] == "grpo"}
    ours = {run["seed"]: run["scores"] for run in runs if run["arm"] == "grpo"}
    placebo = [run for run in runs if run["arm"] != "grpo"]
    check_pairing(ours, page, sorted({run["seed"] for run in placebo}))
    return placebo


def page(outs: list[Path]) -> None:
    import rebuild_page as rebuild

    placebo = paired_runs(outs)
    records = [r for r in json.loads((PAGE / "runs.json").read_text()) if r["arm"] not in {p["arm"] for p in placebo}]
    logs = [
        r for r in json.loads((PAGE / "step_logs.json").read_text()) if r["arm"] not in {p["arm"] for p in placebo}
    ]
    for run in placebo:
        key = {"arm": run["arm"], "gamma": run["gamma"], "seed": run["seed"]}
        records.append({**key, "scores": run["scores"], "collapse": {k: run["collapse"].get(k) for k in KEEP}})
        logs.append({**key, "steps": run["step_logs"]})
    page_seconds = 2097  # the page's own runs (notebook 04's wall, its runtime line); the placebo runs' are added
    meta = {
        "params": PARAMS, "overrides": [], "collapse_gamma": 3.35, "collapse_found": False,
        "seconds": round(page_seconds + sum(run["seconds"] for run in placebo)),
        "controls": CONTROL_SEARCHES,
        "origin": "the runs of notebook 04 on params/study_controls.yaml (issue 41) and its placebo arms, trained on "
        "the same seeds, warm start and held-out set by docs/measurements/placebo_shortcut.py, whose GRPO runs "
        "scored exactly the page's GRPO on every seed. Runtime: the page's wall plus the placebo runs' own seconds. "
        "The control searches' numbers are the page's earlier table's, to 4 significant digits.",
    }  # fmt: skip
    print(f"wrote {rebuild.write_page(PAGE.relative_to(ROOT), records, logs, meta)}")


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "train":
        train([int(s) for s in rest[0].split(",")], Path(rest[1]))
    elif command == "train-matched":
        train_matched([int(s) for s in rest[0].split(",")], Path(rest[1]), Path(rest[2]), *rest[3:])
    elif command == "page":
        page([Path(p) for p in rest])
    else:
        raise SystemExit(f"command={command!r} is unknown; allowed: train, train-matched, page")
