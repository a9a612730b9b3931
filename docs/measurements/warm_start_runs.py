"""One warm start's runs for a pooled page (``warm_starts_page``): notebook 04's calibrated study on one build of a
testbed, then placebo arms on its seeds, written to ``OUT/results.json``.

The placebo arms (``placebo.ARM_MASKS``) are trained after the study, each run paired with the study's GRPO on its
seed: the first at the PAPO-G arm's gamma, the others at the gamma that matches the first one's starting perception
KL to that PAPO-G arm's (``placebo.kl_matched_gamma``). ``docs/measurements/warm_starts_shortcut.py`` and
``docs/measurements/placebo_background.py`` train their warm starts through ``train_warm_start``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import mlflow

from papo_nb.testbed.policy import read_card
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.study import arms, placebo
from papo_nb.workbook.study.collapse import CollapseRule


def train_placebos(
    params: WorkbookParams, study: arms.Study, work_dir: Path, papo_arm: str, placebo_arms: tuple[str, ...]
) -> tuple[list[arms.StudyRun], float]:
    """(runs, KL-matched gamma): ``placebo_arms[0]`` at ``papo_arm``'s gamma (its largest), the rest at the gamma
    where ``placebo_arms[0]``'s term starts as large as ``papo_arm``'s, every arm on every study seed."""
    data, rule = arms.eval_dataset(params), CollapseRule()
    grpo = {r.seed: r.scores for r in study.runs if r.arm == arms.GRPO}
    gamma = max(r.gamma for r in study.runs if r.arm == papo_arm)

    def train(arm: str, arm_gamma: float) -> list[arms.StudyRun]:
        return [
            arms.run_one(placebo.arm_params(params, arm), arm, seed, arm_gamma, data, work_dir, rule, grpo[seed])
            for seed in params.study_seeds
        ]

    first, *matched_arms = placebo_arms
    at_gamma = train(first, gamma)
    papo_logs = [r.step_logs for r in study.runs if r.arm == papo_arm]
    matched = round(placebo.kl_matched_gamma(gamma, papo_logs, [r.step_logs for r in at_gamma]), 3)
    return at_gamma + [run for arm in matched_arms for run in train(arm, matched)], matched


def train_warm_start(
    params: WorkbookParams, params_file: str, build: int, folder: Path, out: Path, papo_arm: str,
    placebo_arms: tuple[str, ...], run_name: str,
) -> dict:  # fmt: skip
    """The study and the placebo arms on the warm start in ``folder`` (build seed ``build``, trained with
    ``params``, read from ``params_file``), tracked in ``OUT/mlflow.db``; writes and returns ``OUT/results.json``'s
    record: the warm start (its card with the weights' SHA-256, start scores, collapse gamma, control searches), the
    KL-matched gamma, every run and each call of the collapse search."""
    out.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(f"sqlite:///{out}/mlflow.db")
    started = time.time()
    with mlflow.start_run(run_name=run_name):
        study = arms.run_study(params, out / "runs")
        placebos, matched = train_placebos(params, study, out / "runs", papo_arm, placebo_arms)
    runs = list(study.runs) + placebos
    record = {
        "params": params_file, "build": build, "card": read_card(folder), "start_scores": study.start_scores,
        "collapse_gamma": study.collapse_gamma, "collapse_found": study.collapse_found,
        "controls": [asdict(c) for c in study.controls], "kl_matched_gamma": matched,
        "seconds": round(time.time() - started), "runs": [asdict(r) for r in runs],
        "search": [asdict(r) for r in study.sweep],  # each collapse-search call (calibrated design), in order
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(record))
    print(f"build {build}: {len(runs)} runs in {record['seconds']} s", flush=True)
    return record
