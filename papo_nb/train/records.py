"""What rank 0 writes about a run: the folder's files and the MLflow record, at the start and at the end.

At the start: ``params.yaml`` (fresh runs and forced resumes), ``run_info.json`` (the MLflow run and one entry per
attempt), corrupt checkpoints set aside, and in MLflow the start record, the parameters and the standard tags (a
re-attached run gets the attempt instead). At the end: ``train_summary.json``, the probe's final evidence and its
status tags (``papo_nb.probe_status``, and ``papo_nb.probe_warning`` when underpowered).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from papo_nb.train.plan import RunPlan
from papo_nb.train.run_folder import PARAMS_FILE, RUN_INFO_FILE, SUMMARY_FILE, write_atomic, write_json
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.run import tag_probe_status


@contextmanager
def params_logged_once(reattached: bool):
    """transformers' MLflowCallback logs the TrainingArguments as params at setup; MLflow refuses to change a logged
    value, and a re-attached run has them already: switch that logging off for it, and restore the variable."""
    previous = os.environ.get("MLFLOW_MAX_LOG_PARAMS")
    if reattached:
        os.environ["MLFLOW_MAX_LOG_PARAMS"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_MAX_LOG_PARAMS", None)
        else:
            os.environ["MLFLOW_MAX_LOG_PARAMS"] = previous


def write_start_files(plan: RunPlan, params: WorkbookParams, run_id: str, attempt: dict, tracking_uri: str) -> dict:
    """params.yaml, run_info.json (returned), and corrupt checkpoints renamed aside."""
    if plan.saved_params is None or plan.forced:
        write_atomic(plan.output_dir / PARAMS_FILE, yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    run_info = {
        **plan.run_info,
        "mlflow_run_id": run_id or None,
        "attempts": plan.run_info.get("attempts", []) + [attempt],
    }
    if tracking_uri:
        run_info["tracking_uri"] = tracking_uri
    write_json(plan.output_dir / RUN_INFO_FILE, run_info)
    for folder, _ in plan.skipped:  # set aside, so the Trainer never mixes new files into a damaged folder
        folder.rename(folder.with_name(f"corrupt-{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    return run_info


def log_start(params: WorkbookParams, start: dict, attempt: dict, attempts: int, first: bool) -> None:
    """The start record, parameters and standard tags into the active MLflow run; a re-attached run gets the
    attempt (``train/attempt-N.json``) instead."""
    import mlflow
    import trl

    from papo_nb.infra.tracking import log_evidence
    from papo_nb.papo.contract import PAPO_ADAPTER_VERSION

    if not first:
        mlflow.log_dict(attempt, f"train/attempt-{attempts}.json")
        mlflow.set_tag("papo_nb.attempts", str(attempts))
        return
    log_evidence("start", start, prefix="start")
    mlflow.log_dict(params.model_dump(mode="json"), "train/params.json")
    mlflow.set_tags(
        {
            "papo_nb.adapter_version": PAPO_ADAPTER_VERSION,
            "papo_nb.trl_version": trl.__version__,
            "papo_nb.phase": start["phase"],
            "papo_nb.precision": params.precision,
            "papo_nb.num_processes": str(params.num_processes),
        }
    )


def write_summary(output_dir: Path, summary: dict) -> None:
    write_json(output_dir / SUMMARY_FILE, summary)


def log_probe(trainer, probe: dict | None, same_on_all_ranks: bool) -> None:
    """The probe's final evidence (``evidence/probe.json``, ``probe_final/*`` metrics) and its status tags."""
    if probe is None:
        return
    from papo_nb.infra.tracking import log_evidence

    log_evidence("probe", {**probe, "same_on_all_ranks": same_on_all_ranks}, prefix="probe_final")
    tag_probe_status(trainer)
