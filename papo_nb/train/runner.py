"""The one training path: ``run_training``, called by notebook 03 and by ``papo-nb train`` alike.

``run_training`` makes one run request (``request.RunRequest``). With ``num_processes > 1`` (outside a launcher) it
hands the request to ``papo-nb train`` under ``accelerate launch`` and reads the result back from the run folder;
otherwise it trains the request in this process (``train_here``), or as one rank of the launched job. Either way
the same code writes the start record (after the trainable-parameter check), the probe's evidence and its status
tags.

It refuses an output folder that already holds a run unless resuming; resuming picks the newest complete
checkpoint (``integrity``), sets aside newer corrupt ones, refuses parameter changes that matter
(``resume.resume_differences``) unless ``force_resume``, and re-attaches to the same MLflow run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from papo_nb.train.disk_full import DISK_FULL_EXIT, DiskFull, disk_full_cause, set_aside_partial
from papo_nb.train.distributed import (
    launch_distributed,
    process_rank,
    refuse_unsupported,
    refuse_wrong_world_size,
    same_on_all_ranks,
    under_launcher,
)
from papo_nb.train.final_review import review_run
from papo_nb.train.output import run_log_path, start_run_log, surviving_output
from papo_nb.train.plan import RunPlan, plan_run
from papo_nb.train.preemption import PREEMPTED_EXIT, Preempted, PreemptionCallback
from papo_nb.train.probe_state import ProbeStateCallback, restore_probe
from papo_nb.train.records import (
    forward_plan_record,
    log_forward_plan,
    log_probe,
    log_start,
    params_logged_once,
    start_record,
    write_start_files,
    write_summary,
)
from papo_nb.train.request import RunRequest
from papo_nb.train.resume import resume_callback
from papo_nb.train.run_folder import PROGRESS_PREFIX, LaunchError, LaunchFailed
from papo_nb.train.spool import TrackingSpool
from papo_nb.train.spooled_tracking import SpooledFluent, close_spool, open_spool, route_through_spool
from papo_nb.workbook.config.machine_checks import preflight_problems
from papo_nb.workbook.config.param_errors import where_set
from papo_nb.workbook.config.params import ParamsError, WorkbookParams, load_params
from papo_nb.workbook.training.builder import prepare_training
from papo_nb.workbook.training.checkpoints import CHECKPOINT_PREFIX, describe_reference, latest_checkpoint


@dataclass
class TrainOutcome:
    """What a run left: its folder, MLflow run, steps, checkpoints, probe evidence and start record. ``trainer`` and
    ``eval_dataset`` are set when it trained in this process."""

    output_dir: Path
    mlflow_run_id: str | None
    resumed_from: Path | None
    skipped_checkpoints: list[tuple[Path, list[str]]]
    global_step: int
    last_checkpoint: Path | None
    log_history: list[dict]
    probe_evidence: dict | None
    reference_policy: str
    start: dict = field(default_factory=dict)
    trainer: Any = field(default=None, repr=False)
    eval_dataset: Any = field(default=None, repr=False)

    @property
    def step_logs(self) -> list[dict]:
        """Per-step training logs (the final summary entry excluded)."""
        from papo_nb.workbook.training.figures import step_logs

        return step_logs(self.log_history)

    @classmethod
    def from_summary(cls, output_dir: Path, summary: dict, resumed_from: Path | None = None) -> TrainOutcome:
        """The outcome of a run trained elsewhere (a launched job, or a finished run), from train_summary.json."""
        last = summary.get("last_checkpoint")
        return cls(
            output_dir,
            summary.get("mlflow_run_id"),
            resumed_from,
            [],
            summary["global_step"],
            Path(last) if last else None,
            summary["log_history"],
            summary.get("probe"),
            summary.get("reference_policy", ""),
            summary.get("start", {}),
        )


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


def run_training(
    params: WorkbookParams,
    output_dir: str | Path,
    *,
    resume: bool = False,
    force_resume: bool = False,
    mlflow_run_id: str = "",
    tracking_uri: str | None = None,
    report_to: str = "mlflow",
) -> TrainOutcome:
    """Train (or resume) one run into ``output_dir``: on ``num_processes`` launched processes when it is > 1 and
    this process is not one of them (the job runs ``papo-nb train``, that is this function, on every rank), else
    here, as the whole run or as one rank of a launched job.

    Raises LaunchError (nothing written) for an output folder that already holds a run without ``resume``, for
    a resume whose parameters differ (``ResumeMismatch``) without ``force_resume``, or for a world size that is
    not ``num_processes``; LaunchFailed when a launched job fails.
    """
    request = RunRequest(params, output_dir, resume, force_resume, mlflow_run_id, tracking_uri)
    if params.num_processes > 1 and not under_launcher():
        launched = launch_distributed(request).check()
        return TrainOutcome.from_summary(launched.output_dir, launched.summary())
    return train_here(request, report_to)


def train_here(request: RunRequest, report_to: str) -> TrainOutcome:
    """Train ``request`` in this process, as the whole run or as one rank of a launched job."""
    params, output_dir, is_main = request.params, request.output_dir, process_rank() == 0
    refuse_wrong_world_size(params)
    plan = plan_run(params, output_dir, resume=request.resume, force_resume=request.force_resume, warn=is_main)
    if plan.finished:
        if is_main:
            print(
                f"{PROGRESS_PREFIX} the run in {output_dir} is complete at step {plan.final_state['global_step']} "
                f"(max_steps {params.max_steps}): nothing to train",
                flush=True,
            )
        return finished_outcome(plan)
    # Everything above only read the folder, on every rank, so every rank decided alike. Below, rank 0 writes; the
    # other ranks wait for it at a barrier (the process group exists once the trainer is built).
    use_mlflow = report_to == "mlflow" and is_main
    status, owns_run, spool, guard = "FAILED", False, None, None
    with params_logged_once(use_mlflow and plan.reattached):
        try:
            trainer, eval_dataset, start = run_trainer(request, plan, report_to, is_main)
            start_run_log()  # the run is accepted (its data, rewards and resume checked): its log file opens
            trainer.accelerator.wait_for_everyone()
            run_id = request.mlflow_run_id or plan.run_info.get("mlflow_run_id", "")
            if is_main:
                run_id, owns_run, spool = record_start(plan, params, start, run_id, request.tracking_uri, use_mlflow)
                guard = route_through_spool(trainer, spool) if spool is not None else None
            trainer.accelerator.wait_for_everyone()
            train_to_the_end(trainer, plan, is_main)
            tracker = SpooledFluent(spool) if spool is not None else None
            outcome = record_end(params, plan, trainer, start, run_id, use_mlflow, is_main, tracker)
            outcome.eval_dataset = eval_dataset
            status = "FINISHED"
            if params.num_processes > 1:
                trainer.accelerator.end_training()  # destroys the process group: a clean exit for every rank
            return outcome
        except (KeyboardInterrupt, Preempted):
            status = "KILLED"
            raise
        finally:
            if spool is not None:
                close_spool(spool, status, guard, end_run=owns_run)
            elif owns_run:
                import mlflow

                mlflow.end_run(status=status)


def train_to_the_end(trainer, plan: RunPlan, is_main: bool) -> None:
    """``trainer.train`` from the plan's checkpoint. Raises Preempted when a preemption signal stopped it at a marked
    checkpoint, DiskFull when a write failed for lack of space (partial checkpoints set aside)."""
    preemption = PreemptionCallback(trainer.accelerator)
    trainer.add_callback(preemption)
    try:
        trainer.train(resume_from_checkpoint=str(plan.checkpoint) if plan.checkpoint else None)
    except Exception as exc:
        cause = disk_full_cause(exc)
        if cause is None:
            raise
        raise set_aside_partial(plan.output_dir, cause) if is_main else DiskFull(cause) from exc
    trainer.accelerator.wait_for_everyone()
    preempted = preemption.mark(plan.output_dir, is_main)
    if preempted is not None:
        raise preempted


def run_trainer(request: RunRequest, plan: RunPlan, report_to: str, is_main: bool):
    """The run's trainer, refused when accelerate would not apply its config, with its start record (after the
    trainable-parameter check), the progress lines and, when resuming, the resume checks. Returns (trainer,
    held-out eval dataset, start record)."""
    trainer, eval_dataset, restored = prepare_training(request.params, request.output_dir, report_to=report_to)
    refuse_unsupported(trainer)
    start = start_record(request.params, trainer, restored, describe_reference(trainer))
    trainer.add_callback(progress_callback())
    if getattr(trainer, "probe", None) is not None:
        trainer.add_callback(ProbeStateCallback(trainer.probe))
        if plan.checkpoint is not None:
            restore_probe(trainer.probe, plan.checkpoint)
    if plan.checkpoint is not None:
        trainer.add_callback(resume_callback(trainer, plan.checkpoint, is_main, request.output_dir))
    return trainer, eval_dataset, start


def finished_outcome(plan: RunPlan) -> TrainOutcome:
    """A resumed run already at max_steps: its state and summary, nothing trained."""
    state, summary = plan.final_state, plan.summary()
    return TrainOutcome(
        plan.output_dir,
        plan.run_info.get("mlflow_run_id"),
        plan.checkpoint,
        plan.skipped,
        state["global_step"],
        plan.checkpoint,
        state["log_history"],
        summary.get("probe"),
        summary.get("reference_policy", ""),
        summary.get("start", {}),
    )


def record_start(
    plan: RunPlan, params: WorkbookParams, start: dict, run_id: str, tracking_uri: str | None, use_mlflow: bool
) -> tuple[str, bool, TrackingSpool | None]:
    """Rank 0, before the first step: attach the MLflow run, write the folder's start files, open the run's tracking
    spool and log the start into it. Returns (MLflow run id, whether this call started the run, the spool)."""
    owns_run, store, spool = False, "", None
    if use_mlflow:
        import mlflow

        active, owns_run = attach_train_run(tracking_uri, run_id, plan.output_dir)
        run_id, store = active.info.run_id, mlflow.get_tracking_uri()
    attempt = plan.attempt(params)
    run_info = write_start_files(plan, params, run_id, attempt, store)
    if use_mlflow:
        spool = open_spool(plan.output_dir, run_id)
        tracker = SpooledFluent(spool)
        log_start(params, start, attempt, len(run_info["attempts"]), first=not plan.reattached, tracker=tracker)
    return run_id, owns_run, spool


def record_end(
    params: WorkbookParams,
    plan: RunPlan,
    trainer,
    start: dict,
    run_id: str,
    use_mlflow: bool,
    is_main: bool,
    tracker=None,
) -> TrainOutcome:
    """After the last step: the probe's evidence (checked identical on every rank), the summary and, on rank 0 with
    MLflow, the probe's evidence and status tags (through ``tracker``, the run's spool)."""
    probe = trainer.probe.evidence.to_dict() if trainer.probe is not None and trainer.probe.evidence else None
    probe_same, metrics_same = same_on_all_ranks(trainer, probe)
    last = latest_checkpoint(plan.output_dir)
    outcome = TrainOutcome(
        plan.output_dir,
        run_id or None,
        plan.checkpoint,
        plan.skipped,
        trainer.state.global_step,
        last,
        list(trainer.state.log_history),
        probe,
        start["reference_policy"],
        start,
        trainer,
    )
    if is_main:
        summary = {
            "global_step": outcome.global_step,
            "max_steps": params.max_steps,
            "num_processes": params.num_processes,
            "last_checkpoint": str(last) if last else None,
            "mlflow_run_id": outcome.mlflow_run_id,
            "reference_policy": outcome.reference_policy,
            "start": start,
            "probe": probe,
            "probe_same_on_all_ranks": probe_same,
            "forward_plan": forward_plan_record(trainer),
            "metrics_same_on_all_ranks": metrics_same,
            "log_history": outcome.log_history,
        }
        write_summary(plan.output_dir, summary)
        if use_mlflow:
            log_probe(trainer, probe, probe_same, tracker)
            log_forward_plan(summary["forward_plan"], tracker)
    if not probe_same:
        raise RuntimeError("the gamma-zero probe's evidence differs between ranks: its reductions are broken")
    return outcome


def trained_policy(params: WorkbookParams, outcome: TrainOutcome):
    """(model, processor, held-out eval dataset) of a finished run, to evaluate: the trainer's own when it trained
    in this process, else the adapter of its last checkpoint, loaded and checked against its file."""
    if outcome.trainer is not None:
        return outcome.trainer.model, outcome.trainer.processing_class, outcome.eval_dataset
    from papo_nb.workbook.training.builder import load_datasets, load_policy
    from papo_nb.workbook.training.checkpoints import load_trainable_adapter

    if outcome.last_checkpoint is None:
        raise FileNotFoundError(f"the run in {outcome.output_dir} saved no checkpoint to evaluate")
    model, processor = load_policy(params)
    model, _ = load_trainable_adapter(model, outcome.last_checkpoint)
    return model, processor, load_datasets(params)[1]


def train_command(
    params_file: str | None,
    overrides: list[str],
    output_dir: str,
    *,
    resume: bool = False,
    force_resume: bool = False,
    mlflow_run_id: str = "",
    report_to: str = "mlflow",
    evaluate: bool = True,
) -> int:
    """The body of ``papo-nb train``; ``evaluate`` False skips the held-out evaluation at the end. Exit codes: 0
    trained, 1 training failed, 2 bad parameters or a refused run, 74 a full disk (DiskFull), 75 stopped by SIGTERM
    or SIGUSR1 at a marked checkpoint (Preempted); a launched job that fails exits with its own code."""
    try:
        params = load_params(params_file, overrides)
    except ParamsError as exc:
        print(f"papo-nb train: error: {exc}", file=sys.stderr)
        return 2
    from papo_nb.infra.tracking import project_dir

    problems = preflight_problems(params, project_dir())  # an accelerate config named relative to the project
    if problems:
        print("papo-nb train: error: " + "\n".join(where_set(p, params.origin) for p in problems), file=sys.stderr)
        return 2
    # a closed terminal or pipe never stops the run; its log file carries on
    with surviving_output(run_log_path(output_dir, process_rank())):
        return train_and_report(params, output_dir, resume, force_resume, mlflow_run_id, report_to, evaluate)


def train_and_report(
    params: WorkbookParams,
    output_dir: str,
    resume: bool,
    force_resume: bool,
    mlflow_run_id: str,
    report_to: str,
    evaluate: bool,
) -> int:
    """``train_command`` once the parameters are valid: the run, its held-out evaluation and results page (not on
    the ranks of a launched job: the launching process writes them), its last line, and its exit code."""
    try:
        outcome = run_training(
            params,
            output_dir,
            resume=resume,
            force_resume=force_resume,
            mlflow_run_id=mlflow_run_id,
            report_to=report_to,
        )
    except (LaunchError, ParamsError) as exc:  # ParamsError here: own rows or a reward refused before the model loads
        print(f"papo-nb train: error: {where_set(str(exc), params.origin)}", file=sys.stderr)
        return 2
    except LaunchFailed as exc:
        print(f"{PROGRESS_PREFIX} {exc}", file=sys.stderr)
        return exc.returncode
    except Preempted as exc:
        print(f"{PROGRESS_PREFIX} {exc}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except DiskFull as exc:
        print(f"papo-nb train: error: {exc}", file=sys.stderr, flush=True)
        return DISK_FULL_EXIT
    if report_to == "mlflow" and not under_launcher():
        review_after_training(params, outcome, evaluate)
    if process_rank() == 0:
        print(
            f"{PROGRESS_PREFIX} done at step {outcome.global_step}; last checkpoint {outcome.last_checkpoint}; "
            f"MLflow run {outcome.mlflow_run_id}",
            flush=True,
        )
    return 0


def review_after_training(params: WorkbookParams, outcome: TrainOutcome, evaluate: bool) -> None:
    """The run's held-out evaluation and results page (``final_review``); a tracking server that stopped answering
    after training costs the review, said in one line, never the trained run (its records reach MLflow through the
    spool's ``papo-nb sync``)."""
    from mlflow.exceptions import MlflowException

    try:
        review_run(params, outcome, lambda: trained_policy(params, outcome), evaluate=evaluate)
    except (MlflowException, OSError) as exc:
        print(
            f"{PROGRESS_PREFIX} the held-out evaluation and results page were not logged: MLflow did not answer "
            f"({str(exc).splitlines()[0][:300]}); the trained run is complete",
            file=sys.stderr,
            flush=True,
        )


def short_run_checkpoint(params: WorkbookParams, steps: int, output_dir: str | Path) -> str:
    """The last checkpoint of a short run of ``steps`` steps trained here into ``output_dir``: a trained policy to
    start from (probe calibration's phase 2, when no checkpoint is given), untracked and without the GPU contract
    probe, since the run only makes the policy."""
    short = params.model_copy(update={"max_steps": steps, "save_steps": steps, "require_gpu_contract_probe": False})
    return str(run_training(short, output_dir, report_to="none").last_checkpoint)
