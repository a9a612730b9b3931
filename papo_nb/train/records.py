"""What rank 0 writes about a run: the folder's files and the MLflow record, at the start and at the end.

At the start: the start record (``start_record``: phase, trainable parameters, refused when there are none),
``params.yaml`` (fresh runs and forced resumes), ``run_info.json`` (the MLflow run and one entry per
attempt), corrupt checkpoints set aside, and in MLflow the start record, the parameters and the standard tags (a
re-attached run gets the attempt instead). At the end: ``train_summary.json``, the probe's final evidence and its
status tags (``papo_nb.probe_status``, and ``papo_nb.probe_warning`` when underpowered), and the trainer's forward plan
as it stood at the end (``train/forward_plan.json`` and the ``papo_nb.log_prob_forward`` tag: whether prefix sharing
ran and why, after ``prefix_sharing="auto"``'s first-batch check).
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from papo_nb.train.plan import RunPlan
from papo_nb.train.run_folder import PARAMS_FILE, RUN_INFO_FILE, SUMMARY_FILE, write_atomic, write_json
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.checkpoints import RestoredAdapter

PROBE_STATUS_TAG = "papo_nb.probe_status"
PROBE_WARNING_TAG = "papo_nb.probe_warning"
FORWARD_PLAN_TAG = "papo_nb.log_prob_forward"
MLFLOW_TAG_LIMIT = 5000  # characters MLflow keeps in a tag value


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


def log_start(params: WorkbookParams, start: dict, attempt: dict, attempts: int, first: bool, tracker=None) -> None:
    """The start record, parameters and standard tags into the active MLflow run (through ``tracker``, the ``mlflow``
    module or a run's spool); a re-attached run gets the attempt (``train/attempt-N.json``) instead."""
    import mlflow
    import trl

    from papo_nb.infra.tracking import log_evidence
    from papo_nb.papo.contract import PAPO_ADAPTER_VERSION

    tracker = tracker or mlflow
    if not first:
        tracker.log_dict(attempt, f"train/attempt-{attempts}.json")
        tracker.set_tag("papo_nb.attempts", str(attempts))
        return
    log_evidence("start", start, prefix="start", tracker=tracker)
    tracker.log_dict(params.model_dump(mode="json"), "train/params.json")
    tracker.log_params(run_identity_params(params))
    tracker.set_tags(
        {
            "papo_nb.adapter_version": PAPO_ADAPTER_VERSION,
            "papo_nb.trl_version": trl.__version__,
            "papo_nb.phase": start["phase"],
            "papo_nb.precision": params.precision,
            "papo_nb.num_processes": str(params.num_processes),
        }
    )


def run_identity_params(params: WorkbookParams) -> dict[str, str]:
    """What the run trained, as MLflow params beside the TrainingArguments transformers logs (none of these names is
    one of its fields): the model, the data and its splits, the reward entries and the functions they stand for."""
    from papo_nb.workbook.config.reward_names import reward_specs
    from papo_nb.workbook.training.rewards import weighted_rewards

    return {
        "model_name_or_path": params.model_name_or_path,
        "dataset": params.dataset,
        "dataset_schema": params.dataset_schema,
        "train_split": params.train_split,
        "eval_split": params.eval_split,
        "reward": ", ".join(reward_specs(params.reward, params.dataset_schema)),
        "reward_functions": ", ".join(function.__name__ for _, function, _ in weighted_rewards(params)),
    }


def write_summary(output_dir: Path, summary: dict) -> None:
    write_json(output_dir / SUMMARY_FILE, summary)


def log_probe(trainer, probe: dict | None, same_on_all_ranks: bool, tracker=None) -> None:
    """The probe's final evidence (``evidence/probe.json``, ``figures/probe.png``, headline ``probe_final/*`` metrics)
    and its status tags, through ``tracker`` (the ``mlflow`` module by default)."""
    if probe is None:
        return
    from papo_nb.workbook.results.probe_record import log_probe_evidence

    log_probe_evidence({**probe, "same_on_all_ranks": same_on_all_ranks}, prefix="probe_final", tracker=tracker)
    tag_probe_status(trainer, tracker)


def training_phase(params: WorkbookParams) -> str:
    return "phase2 (resumed adapter)" if params.init_adapter else "phase1 (fresh adapter)"


def start_record(params: WorkbookParams, trainer, restored: RestoredAdapter | None, reference: str) -> dict:
    """What a run starts from: phase, trainable parameters, KL reference, restored adapter, processes.

    Raises ValueError when nothing is trainable (a saved adapter loaded with ``is_trainable=False`` trains nothing,
    silently), before the first step."""
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ValueError(
            f"no trainable parameters in {type(trainer.model).__name__} (init_adapter = {params.init_adapter!r}): "
            "the run would train nothing; load the adapter trainable or leave init_adapter empty"
        )
    return {
        "phase": training_phase(params),
        "trainable_parameters": trainable,
        "reference_policy": reference,
        "restored_adapter": restored.to_dict() if restored else None,
        "num_processes": params.num_processes,
    }


def tag_probe_status(trainer, tracker=None) -> str | None:
    """Tag the active MLflow run ``papo_nb.probe_status`` with the in-training probe's status ("passed",
    "underpowered", "pending", ...) and, when underpowered, ``papo_nb.probe_warning`` with its message, so the
    warning shows next to the run; returns the status (None without a probe or evidence)."""
    evidence = getattr(getattr(trainer, "probe", None), "evidence", None)
    if evidence is None:
        return None
    import mlflow

    tracker = tracker or mlflow
    if mlflow.active_run() is not None:
        tracker.set_tag(PROBE_STATUS_TAG, evidence.status)
        if evidence.status == "underpowered":
            tracker.set_tag(PROBE_WARNING_TAG, evidence.message[:MLFLOW_TAG_LIMIT])
    return evidence.status


def forward_plan_record(trainer) -> dict | None:
    """The trainer's forward plan now (``papo_nb.papo.forward_plan.ForwardPlan``) as a dict, or None without one."""
    plan = getattr(trainer, "forward_plan", None)
    return dataclasses.asdict(plan) if plan is not None else None


def log_forward_plan(record: dict | None, tracker=None) -> None:
    """``forward_plan_record``'s dict as ``train/forward_plan.json`` and its log-prob forward, with the reason, as
    the ``papo_nb.log_prob_forward`` tag (through ``tracker``, the ``mlflow`` module by default)."""
    if record is None:
        return
    import mlflow

    tracker = tracker or mlflow
    tracker.log_dict(record, "train/forward_plan.json")
    tracker.set_tag(FORWARD_PLAN_TAG, f"{record['log_prob_forward']} ({record['log_prob_reason']})"[:MLFLOW_TAG_LIMIT])
