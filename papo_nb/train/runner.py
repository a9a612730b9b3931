"""One training run, in this process or as one rank of a launched job: ``train()`` and ``papo-nb train``'s body.

``train`` refuses an output folder that already holds a run unless resuming; resuming picks the newest complete
checkpoint (``integrity``), sets aside newer corrupt ones, refuses parameter changes that matter
(``resume.resume_differences``) unless ``force_resume``, and re-attaches to the same MLflow run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from papo_nb.train.distributed import (
    launch_distributed,
    process_rank,
    refuse_unsupported,
    same_on_all_ranks,
    under_launcher,
    world_size,
)
from papo_nb.train.integrity import find_resume_checkpoint
from papo_nb.train.resume import ResumeMismatch, mismatch_message, resume_callback, resume_differences
from papo_nb.train.run_folder import (
    PARAMS_FILE,
    PROGRESS_PREFIX,
    RUN_INFO_FILE,
    SUMMARY_FILE,
    TRAINER_STATE_FILE,
    LaunchError,
    read_run_info,
    read_saved_params,
    write_atomic,
    write_json,
)
from papo_nb.workbook.config.params import ParamsError, WorkbookParams, load_params, preflight_problems
from papo_nb.workbook.training.checkpoints import CHECKPOINT_PREFIX, checkpoint_folders, checkpoint_step


def progress_callback():
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        """One line per optimizer step and per checkpoint on the main process (what a watcher or test reads)."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                print(f"{PROGRESS_PREFIX} step {state.global_step}/{state.max_steps}", flush=True)

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                print(f"{PROGRESS_PREFIX} saved {CHECKPOINT_PREFIX}{state.global_step}", flush=True)

    return Progress()


def attach_train_run(tracking_uri: str | None, run_id: str, output_dir: Path):
    """Make the run's MLflow run active: the one given or recorded in run_info.json, an already active one (a
    notebook calling in process), or a new ``train-<folder>`` run. Returns (active run, whether this call started
    it)."""
    from papo_nb.infra.tracking import attach_run

    return attach_run(
        tracking_uri or "",
        run_id,
        run_name=f"train-{output_dir.name}",
        tags={"papo_nb.kind": "train", "papo_nb.output_dir": str(output_dir)},
        reuse_active=True,
    )


@dataclass
class TrainOutcome:
    output_dir: Path
    mlflow_run_id: str | None
    resumed_from: Path | None
    skipped_checkpoints: list[tuple[Path, list[str]]]
    global_step: int
    last_checkpoint: Path | None
    log_history: list[dict]
    probe_evidence: dict | None
    reference_policy: str
    trainer: Any = field(default=None, repr=False)

    @property
    def step_logs(self) -> list[dict]:
        from papo_nb.workbook.training.figures import step_logs

        return step_logs(self.log_history)


def train(
    params: WorkbookParams,
    output_dir: str | Path,
    *,
    resume: bool = False,
    force_resume: bool = False,
    mlflow_run_id: str = "",
    tracking_uri: str | None = None,
    report_to: str = "mlflow",
) -> TrainOutcome:
    """Train (or resume) one run into ``output_dir``. Runs in this process, or as one rank of a launched job.

    Raises LaunchError (nothing written) for an output folder that already holds a run without ``resume``, for
    a resume whose parameters differ (``ResumeMismatch``) without ``force_resume``, or for a world size that is
    not ``num_processes``.
    """
    from papo_nb.workbook.training.checkpoints import describe_reference
    from papo_nb.workbook.training.run import prepare_training

    output_dir = Path(output_dir).resolve()
    is_main = process_rank() == 0
    if world_size() != params.num_processes:
        raise LaunchError(
            f"parameter 'num_processes' = {params.num_processes} but this job has {world_size()} process(es); "
            "run papo-nb train with -p num_processes=N (it starts accelerate launch itself), or launch "
            "exactly num_processes processes"
        )
    resume = resume or force_resume
    saved_params, run_info = read_saved_params(output_dir), read_run_info(output_dir)
    checkpoint, skipped, forced = None, [], []
    if not resume:
        if saved_params is not None or run_info or checkpoint_folders(output_dir):
            raise LaunchError(
                f"{output_dir} already holds a run ({PARAMS_FILE}, {RUN_INFO_FILE} or checkpoints); pass "
                "--resume to continue it, or choose a new --output-dir"
            )
    else:
        if saved_params is not None:
            forced = resume_differences(saved_params, params)
            if forced and not force_resume:
                raise ResumeMismatch(mismatch_message(output_dir, forced))
        checkpoint, skipped = find_resume_checkpoint(output_dir, warn=is_main)

    if checkpoint is not None and checkpoint_step(checkpoint) >= params.max_steps:
        # The Trainer would run one step past max_steps when resumed at max_steps: a finished run stays finished.
        state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
        summary = json.loads((output_dir / SUMMARY_FILE).read_text()) if (output_dir / SUMMARY_FILE).is_file() else {}
        if is_main:
            print(
                f"{PROGRESS_PREFIX} the run in {output_dir} is complete at step {state['global_step']} "
                f"(max_steps {params.max_steps}): nothing to train",
                flush=True,
            )
        return TrainOutcome(
            output_dir,
            run_info.get("mlflow_run_id"),
            checkpoint,
            skipped,
            state["global_step"],
            checkpoint,
            state["log_history"],
            summary.get("probe"),
            summary.get("reference_policy", ""),
        )

    # Everything above only read the folder, on every rank, so every rank decided alike. Below, rank 0 writes; the
    # other ranks wait for it at a barrier (the process group exists once the trainer is built).
    run_id = mlflow_run_id or run_info.get("mlflow_run_id", "")
    use_mlflow = report_to == "mlflow" and is_main
    reattached = bool(run_info.get("attempts"))
    attempt = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "resume": resume,
        "num_processes": params.num_processes,
        "resumed_from": str(checkpoint) if checkpoint else None,
        "skipped_checkpoints": {str(p): problems for p, problems in skipped},
        "forced_parameter_changes": {k: [old, new] for k, old, new in forced},
    }
    # transformers' MLflowCallback logs the TrainingArguments as params at setup; MLflow refuses to change a
    # logged value, and a re-attached run has them already.
    previous_max_params = os.environ.get("MLFLOW_MAX_LOG_PARAMS")
    if use_mlflow and reattached:
        os.environ["MLFLOW_MAX_LOG_PARAMS"] = "0"
    status, owns_run = "FAILED", False
    try:
        trainer, _, restored = prepare_training(params, output_dir, report_to=report_to)
        refuse_unsupported(trainer)
        trainer.add_callback(progress_callback())
        if checkpoint is not None:
            trainer.add_callback(resume_callback(trainer, checkpoint, is_main, output_dir))
        reference = describe_reference(trainer)
        trainer.accelerator.wait_for_everyone()
        if is_main:
            if use_mlflow:
                active, owns_run = attach_train_run(tracking_uri, run_id, output_dir)
                run_id = active.info.run_id
            if saved_params is None or forced:
                write_atomic(output_dir / PARAMS_FILE, yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
            run_info = {
                **run_info,
                "mlflow_run_id": run_id or None,
                "attempts": run_info.get("attempts", []) + [attempt],
            }
            if use_mlflow:
                import mlflow

                run_info["tracking_uri"] = mlflow.get_tracking_uri()
            write_json(output_dir / RUN_INFO_FILE, run_info)
            for folder, _ in skipped:  # set aside, so the Trainer never mixes new files into a damaged folder
                folder.rename(folder.with_name(f"corrupt-{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
            if use_mlflow:
                log_start(params, trainer, restored, reference, attempt, first=not reattached)
        trainer.accelerator.wait_for_everyone()
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)

        probe = trainer.probe.evidence.to_dict() if trainer.probe is not None and trainer.probe.evidence else None
        probe_same, metrics_same = same_on_all_ranks(trainer, probe)
        last = next(iter(checkpoint_folders(output_dir)), None)
        outcome = TrainOutcome(
            output_dir,
            run_id or None,
            checkpoint,
            skipped,
            trainer.state.global_step,
            last,
            list(trainer.state.log_history),
            probe,
            reference,
            trainer,
        )
        if is_main:
            summary = {
                "global_step": outcome.global_step,
                "max_steps": params.max_steps,
                "num_processes": params.num_processes,
                "last_checkpoint": str(last) if last else None,
                "mlflow_run_id": outcome.mlflow_run_id,
                "reference_policy": reference,
                "probe": probe,
                "probe_same_on_all_ranks": probe_same,
                "metrics_same_on_all_ranks": metrics_same,
                "log_history": outcome.log_history,
            }
            write_json(output_dir / SUMMARY_FILE, summary)
            if use_mlflow and probe is not None:
                from papo_nb.infra.tracking import log_evidence

                log_evidence("probe", {**probe, "same_on_all_ranks": probe_same}, prefix="probe_final")
        if not probe_same:
            raise RuntimeError("the gamma-zero probe's evidence differs between ranks: its reductions are broken")
        status = "FINISHED"
        if params.num_processes > 1:
            trainer.accelerator.end_training()  # destroys the process group: a clean exit for every rank
        return outcome
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if previous_max_params is None:
            os.environ.pop("MLFLOW_MAX_LOG_PARAMS", None)
        else:
            os.environ["MLFLOW_MAX_LOG_PARAMS"] = previous_max_params
        if owns_run:
            import mlflow

            mlflow.end_run(status=status)


def log_start(params: WorkbookParams, trainer, restored, reference: str, attempt: dict, first: bool) -> None:
    import mlflow
    import trl

    from papo_nb.infra.tracking import log_evidence
    from papo_nb.papo.contract import PAPO_ADAPTER_VERSION

    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if first:
        start = {
            "phase": "phase2 (resumed adapter)" if params.init_adapter else "phase1 (fresh adapter)",
            "trainable_parameters": trainable,
            "reference_policy": reference,
            "restored_adapter": restored.to_dict() if restored else None,
            "num_processes": params.num_processes,
        }
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
    else:
        n = len(read_run_info(trainer.args.output_dir).get("attempts", []))
        mlflow.log_dict(attempt, f"train/attempt-{n}.json")
        mlflow.set_tag("papo_nb.attempts", str(n))


def trained_policy(params: WorkbookParams, checkpoint: str | Path):
    """(model, processor, held-out eval dataset) with the adapter of ``checkpoint`` loaded, checked against its
    file, in this process: what a notebook evaluates after a launched run."""
    from papo_nb.workbook.training.builder import load_datasets, load_policy
    from papo_nb.workbook.training.checkpoints import load_trainable_adapter

    model, processor = load_policy(params)
    model, _ = load_trainable_adapter(model, checkpoint)
    return model, processor, load_datasets(params)[1]


def train_command(
    params_file: str | None,
    overrides: list[str],
    output_dir: str,
    *,
    resume: bool = False,
    force_resume: bool = False,
    mlflow_run_id: str = "",
) -> int:
    """The body of ``papo-nb train``. Exit codes: 0 trained, 1 training failed, 2 bad parameters or a refused run."""
    try:
        params = load_params(params_file, overrides)
    except ParamsError as exc:
        print(f"papo-nb train: error: {exc}", file=sys.stderr)
        return 2
    problems = preflight_problems(params)
    if problems:
        print("papo-nb train: error: " + "\n".join(problems), file=sys.stderr)
        return 2
    if params.num_processes > 1 and not under_launcher():
        try:
            result = launch_distributed(
                params, output_dir, resume=resume, force_resume=force_resume, mlflow_run_id=mlflow_run_id
            )
        except LaunchError as exc:
            print(f"papo-nb train: error: {exc}", file=sys.stderr)
            return 2
        print(f"{PROGRESS_PREFIX} launched run exited with code {result.returncode} after {result.wall_seconds:.1f} s")
        return result.returncode
    try:
        outcome = train(params, output_dir, resume=resume, force_resume=force_resume, mlflow_run_id=mlflow_run_id)
    except LaunchError as exc:
        print(f"papo-nb train: error: {exc}", file=sys.stderr)
        return 2
    if process_rank() == 0:
        print(
            f"{PROGRESS_PREFIX} done at step {outcome.global_step}; last checkpoint {outcome.last_checkpoint}; "
            f"MLflow run {outcome.mlflow_run_id}",
            flush=True,
        )
    return 0
