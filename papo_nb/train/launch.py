"""``papo-nb train``: one PAPO-G training run that scales out with ``accelerate launch`` and survives being killed.

The output folder (``--output-dir``) holds everything a run needs to be resumed:

    params.yaml           the resolved parameters, written when the run starts; ``--resume`` compares against it
    run_info.json         the MLflow run (id and store) and one entry per attempt (start, each resume)
    checkpoint-N/         the Trainer's checkpoints every ``save_steps`` steps: adapter, optimizer, scheduler, RNG
                          states (the PAPO-G masking generator's included), trainer state
    resume_evidence.json  what the last resume restored, compared tensor by tensor with its checkpoint
    train_summary.json    at the end: final step, probe verdict (checked identical on every rank), log history

One process: ``papo-nb train`` trains in process. ``num_processes > 1``: it runs itself again under
``accelerate launch`` (``launch_distributed``), one process per device; every rank trains, only rank 0 writes
files and MLflow (TRL's MLflow callback logs on the world's main process only).

Resuming (``--resume``) picks the newest checkpoint that is complete (``checkpoint_problems``), warns about and
sets aside any newer corrupt or partial one, refuses parameters that differ from the run's in a way that matters
(``resume_differences``) unless ``--force-resume``, and re-attaches to the same MLflow run.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from papo_nb.infra.tracking import _free_port, _stop_process_group
from papo_nb.workbook.checkpoints import ADAPTER_FILE, CHECKPOINT_PREFIX, checkpoint_folders, checkpoint_step
from papo_nb.workbook.params import ParamsError, WorkbookParams, load_params, preflight_problems

PARAMS_FILE = "params.yaml"
RUN_INFO_FILE = "run_info.json"
RESUME_EVIDENCE_FILE = "resume_evidence.json"
SUMMARY_FILE = "train_summary.json"
TRAINER_STATE_FILE = "trainer_state.json"
PROGRESS_PREFIX = "papo-nb train:"

# Parameters a resumed run may change: they do not change what is trained (where it runs, how often it is saved,
# what the other notebooks or the final evaluation use). Every other parameter, including ones added later,
# must match the run's params.yaml unless --force-resume. max_steps matters: it sets the learning-rate (and a
# linear gamma) schedule; num_processes and accelerate_config matter: they change the global batch and the
# checkpoint format.
RESUME_SAFE_KEYS = frozenset(
    {
        "device",
        "save_steps",
        "require_gpu_contract_probe",
        "n_eval_prompts",
        "trl_releases",
        "upstream_wheel",
        "calibration_batches",
        "calibration_precisions",
        "phase2_train_steps",
        "phase2_checkpoint",
        "injected_leak_scale",
    }
)

CONFIG_DIR = Path("configs") / "accelerate"
DEFAULT_GPU_CONFIG = "multi_gpu.yaml"
DEFAULT_CPU_CONFIG = "cpu_gloo.yaml"


class LaunchError(RuntimeError):
    """A run that must not start; the message says why and what to do instead."""


class ResumeMismatch(LaunchError):
    """``--resume`` with parameters that differ from the original run's in a way that matters."""


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint folder is incomplete or damaged and is skipped."""


# --------------------------------------------------------------------------------------------
# ranks (read from the launcher's environment: usable before torch.distributed is initialised)
# --------------------------------------------------------------------------------------------


def process_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def under_launcher() -> bool:
    """Started by ``accelerate launch`` / torchrun (one of several processes, or a launcher of one)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


# --------------------------------------------------------------------------------------------
# files in the output folder
# --------------------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    from papo_nb.infra.tracking import _plain

    _write_atomic(path, json.dumps(_plain(data), indent=2) + "\n")


def read_saved_params(output_dir: str | Path) -> dict | None:
    path = Path(output_dir) / PARAMS_FILE
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def read_run_info(output_dir: str | Path) -> dict:
    path = Path(output_dir) / RUN_INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


# --------------------------------------------------------------------------------------------
# checkpoints: complete or not
# --------------------------------------------------------------------------------------------


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the data its offsets describe."""
    try:
        with path.open("rb") as f:
            (header_length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        return f"{path.name} is unreadable ({type(exc).__name__}: {exc})"
    expected, size = 8 + header_length + end, path.stat().st_size
    if size != expected:
        return f"{path.name} has {size} bytes where its header describes {expected} (truncated or damaged)"
    return None


def _torch_archive_problem(path: Path) -> str | None:
    """``torch.save`` writes a zip archive; a truncated one has lost its central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{path.name} is not a complete torch archive ({exc})"
    return None


def checkpoint_problems(folder: str | Path) -> list[str]:
    """Why ``folder`` cannot be resumed from (empty: it is complete).

    The Trainer writes a checkpoint as adapter, optimizer, scheduler, RNG states and, last, trainer_state.json,
    so a save cut short lacks trainer_state.json; a damaged file fails its format check. DeepSpeed checkpoints
    keep the optimizer in ``global_step*/`` instead of optimizer.pt.
    """
    folder = Path(folder)
    problems: list[str] = []
    adapters = [folder / ADAPTER_FILE] + sorted(
        p / ADAPTER_FILE for p in folder.iterdir() if p.is_dir() and (p / ADAPTER_FILE).is_file()
    )
    if not adapters[0].is_file():
        problems.append(f"missing {ADAPTER_FILE}")
    for adapter in adapters:
        if adapter.is_file() and (problem := _safetensors_problem(adapter)):
            problems.append(problem if adapter.parent == folder else f"{adapter.parent.name}/{problem}")
    state = folder / TRAINER_STATE_FILE
    if not state.is_file():
        problems.append(f"missing {TRAINER_STATE_FILE} (written last: the save was cut short)")
    else:
        try:
            step = json.loads(state.read_text())["global_step"]
            if step != checkpoint_step(folder):
                problems.append(f"{TRAINER_STATE_FILE} says step {step}, the folder name {checkpoint_step(folder)}")
        except (ValueError, KeyError) as exc:
            problems.append(f"{TRAINER_STATE_FILE} is unreadable ({type(exc).__name__}: {exc})")
    deepspeed = any(folder.glob("global_step*"))
    for name in ([] if deepspeed else ["optimizer.pt"]) + ["scheduler.pt"]:
        path = folder / name
        if not path.is_file():
            problems.append(f"missing {name}")
        elif problem := _torch_archive_problem(path):
            problems.append(problem)
    return problems


def find_resume_checkpoint(
    output_dir: str | Path, *, warn: bool = True
) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest complete checkpoint (or None), and the newer ones skipped with their problems.

    Each skipped checkpoint is named in a ``CorruptCheckpointWarning`` (when ``warn``)."""
    skipped: list[tuple[Path, list[str]]] = []
    for folder in checkpoint_folders(output_dir):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder, skipped
        skipped.append((folder, problems))
        if warn:
            warnings.warn(
                f"skipping corrupt or partial checkpoint {folder}: {'; '.join(problems)}",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
    return None, skipped


# --------------------------------------------------------------------------------------------
# parameters of a resumed run
# --------------------------------------------------------------------------------------------


def resume_differences(saved: dict, params: WorkbookParams) -> list[tuple[str, Any, Any]]:
    """``(key, original, now)`` for every parameter that differs from the run's saved ones and matters.

    A key the saved file lacks (a parameter added since) counts as its default."""
    now = params.model_dump(mode="json")
    defaults = WorkbookParams().model_dump(mode="json")
    differences = []
    for key in sorted(set(saved) | set(now)):
        if key in RESUME_SAFE_KEYS:
            continue
        original = saved.get(key, defaults.get(key))
        current = now.get(key, "<no longer a parameter>")
        if original != current:
            differences.append((key, original, current))
    return differences


def mismatch_message(output_dir: Path, differences: list[tuple[str, Any, Any]]) -> str:
    lines = [
        f"refusing to resume the run in {output_dir}: {len(differences)} parameter(s) differ from the ones it "
        f"started with ({output_dir / PARAMS_FILE}):"
    ]
    lines += [f"  {key}: {original!r} (original) -> {current!r} (now)" for key, original, current in differences]
    lines.append(
        "They change what is trained. Resume with the original values, train into a new --output-dir, or "
        "pass --force-resume to resume with the new values anyway."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# evidence that a resume restored its checkpoint
# --------------------------------------------------------------------------------------------


def _max_difference(a: Any, b: Any) -> float:
    """Largest absolute difference between two nested structures of tensors/numbers; inf if their shapes differ."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return float("inf")
        if a.numel() == 0:
            return 0.0
        return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return float("inf")
        return max((_max_difference(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max((_max_difference(x, y) for x, y in zip(a, b)), default=0.0)
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return abs(float(a) - float(b))
    return 0.0 if a == b else float("inf")


def _resume_callback(trainer, checkpoint: Path, is_main: bool, output_dir: Path):
    """A TrainerCallback that compares what ``train(resume_from_checkpoint=...)`` restored with the checkpoint:
    step, optimizer and scheduler state and adapter weights when training begins, the masking generator at the
    first step (the Trainer restores RNG states there). A difference stops the run."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class ResumeCheck(TrainerCallback):
        evidence: dict = {}

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            saved_state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
            evidence: dict[str, Any] = {
                "checkpoint": str(checkpoint),
                "checkpoint_step": saved_state["global_step"],
                "resumed_at_step": state.global_step,
            }
            saved_adapter = load_file(str(checkpoint / ADAPTER_FILE))
            evidence["adapter_max_abs_difference"] = _max_difference(
                saved_adapter, get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model))
            )
            if (checkpoint / "optimizer.pt").is_file() and optimizer is not None:
                saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
                evidence["optimizer_max_abs_difference"] = _max_difference(saved, optimizer.state_dict())
                evidence["optimizer_steps"] = max(
                    (int(s["step"]) for s in saved["state"].values() if "step" in s), default=0
                )
            if (checkpoint / "scheduler.pt").is_file() and lr_scheduler is not None:
                saved = torch.load(checkpoint / "scheduler.pt", map_location="cpu", weights_only=True)
                evidence["scheduler_max_abs_difference"] = _max_difference(saved, lr_scheduler.state_dict())
                evidence["scheduler_last_epoch"] = saved.get("last_epoch")
            self.evidence = evidence
            self.first_step = True

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.first_step:
                return
            self.first_step = False
            evidence = self.evidence
            mask_file = Path(trainer._mask_rng_file(str(checkpoint)))
            if mask_file.is_file():
                evidence["mask_rng_restored"] = bool(
                    torch.equal(torch.load(mask_file, weights_only=True), trainer.mask_generator.get_state())
                )
            checks = {
                "step": evidence["resumed_at_step"] == evidence["checkpoint_step"],
                "adapter": evidence["adapter_max_abs_difference"] == 0.0,
                "optimizer": evidence.get("optimizer_max_abs_difference", 0.0) == 0.0,
                "scheduler": evidence.get("scheduler_max_abs_difference", 0.0) == 0.0,
                "mask_rng": evidence.get("mask_rng_restored", True),
            }
            evidence["restored"] = all(checks.values())
            if is_main:
                _write_json(output_dir / RESUME_EVIDENCE_FILE, evidence)
                if _mlflow_active():
                    from papo_nb.infra.tracking import log_evidence

                    log_evidence("resume", evidence, prefix="resume", step=state.global_step)
            if not evidence["restored"]:
                failed = ", ".join(k for k, ok in checks.items() if not ok)
                raise RuntimeError(f"resume from {checkpoint} did not restore: {failed}; evidence {evidence}")
            if is_main:
                print(
                    f"{PROGRESS_PREFIX} resumed from {checkpoint.name} at step {state.global_step}: adapter, optimizer, "
                    "scheduler and RNG states restored exactly",
                    flush=True,
                )

    return ResumeCheck()


def _progress_callback():
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


# --------------------------------------------------------------------------------------------
# MLflow (rank 0 only)
# --------------------------------------------------------------------------------------------


def _mlflow_active() -> bool:
    import mlflow

    return mlflow.active_run() is not None


def _attach_mlflow(tracking_uri: str | None, run_id: str, output_dir: Path, params: WorkbookParams):
    """Make the run's MLflow run active: the one given or recorded in run_info.json (re-attached with
    ``start_run(run_id=...)``), an already active one (a notebook calling in process), or a new one.
    Returns (active run, whether this call started it)."""
    import mlflow

    from papo_nb.infra import tracking

    uri = tracking.absolute_tracking_uri(tracking_uri or tracking.default_tracking_uri())
    mlflow.set_tracking_uri(uri)  # also exports MLFLOW_TRACKING_URI for transformers' MLflowCallback
    active = mlflow.active_run()
    if active is not None and (not run_id or active.info.run_id == run_id):
        return active, False
    if active is not None:
        mlflow.end_run()
    tracking.tracking_client(uri)
    if run_id:
        return mlflow.start_run(run_id=run_id), True
    experiment_id = tracking.ensure_experiment(uri)
    run = mlflow.start_run(
        experiment_id=experiment_id,
        run_name=f"train-{output_dir.name}",
        tags={"papo_nb.kind": "train", "papo_nb.output_dir": str(output_dir)},
    )
    return run, True


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


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
        return [h for h in self.log_history if "reward" in h]


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
    from papo_nb.workbook.checkpoints import describe_reference
    from papo_nb.workbook.training import prepare_training

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
        _refuse_unsupported(trainer)
        trainer.add_callback(_progress_callback())
        if checkpoint is not None:
            trainer.add_callback(_resume_callback(trainer, checkpoint, is_main, output_dir))
        reference = describe_reference(trainer)
        trainer.accelerator.wait_for_everyone()
        if is_main:
            if use_mlflow:
                active, owns_run = _attach_mlflow(tracking_uri, run_id, output_dir, params)
                run_id = active.info.run_id
            if saved_params is None or forced:
                _write_atomic(
                    output_dir / PARAMS_FILE, yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False)
                )
            run_info = {
                **run_info,
                "mlflow_run_id": run_id or None,
                "attempts": run_info.get("attempts", []) + [attempt],
            }
            if use_mlflow:
                import mlflow

                run_info["tracking_uri"] = mlflow.get_tracking_uri()
            _write_json(output_dir / RUN_INFO_FILE, run_info)
            for folder, _ in skipped:  # set aside, so the Trainer never mixes new files into a damaged folder
                folder.rename(folder.with_name(f"corrupt-{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
            if use_mlflow:
                _log_start(params, trainer, restored, reference, attempt, first=not reattached)
        trainer.accelerator.wait_for_everyone()
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)

        probe = trainer.probe.evidence.to_dict() if trainer.probe is not None and trainer.probe.evidence else None
        probe_same, metrics_same = _same_on_all_ranks(trainer, probe)
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
            _write_json(output_dir / SUMMARY_FILE, summary)
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


def _refuse_unsupported(trainer) -> None:
    """The gamma-zero probe differentiates the adapter's parameters directly: not with sharded parameters."""
    deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if trainer.probe is not None and (trainer.is_fsdp_enabled or getattr(deepspeed, "zero_stage", 0) == 3):
        raise LaunchError(
            "require_gpu_contract_probe is not supported with sharded parameters (DeepSpeed ZeRO-3, FSDP); "
            "set it false for this run and run the probe in a short DDP job (configs/accelerate/multi_gpu.yaml)"
        )


# Logged metrics that must be identical on every rank: reduced (or gathered) across processes before logging.
RANK_INVARIANT_METRICS = (
    "reward",
    "reward_std",
    "entropy",
    "kl",
    "perception_kl",
    "perception_loss",
    "masked_entropy",
)


def _same_on_all_ranks(trainer, probe: dict | None) -> tuple[bool, bool]:
    """Whether every rank holds the same probe evidence, and the same per-step values of the metrics that are
    reduced across processes (a rank-local value would differ: each rank sees other prompts). One process: True."""
    if trainer.accelerator.num_processes == 1:
        return True, True
    from accelerate.utils import gather_object

    metrics = [
        {k: h[k] for k in sorted(h) if k in RANK_INVARIANT_METRICS or k.startswith("probe/")}
        for h in trainer.state.log_history
    ]
    probes, histories = zip(*gather_object([(json.dumps(probe, sort_keys=True), json.dumps(metrics, sort_keys=True))]))
    return len(set(probes)) == 1, len(set(histories)) == 1


def _log_start(params: WorkbookParams, trainer, restored, reference: str, attempt: dict, first: bool) -> None:
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


# --------------------------------------------------------------------------------------------
# several processes: accelerate launch
# --------------------------------------------------------------------------------------------


def accelerate_config_path(params: WorkbookParams) -> Path:
    """``accelerate_config`` (relative to the cwd or the project folder), else the DDP default for the device."""
    from papo_nb.infra.tracking import project_dir
    from papo_nb.workbook.builder import resolve_device

    name = params.accelerate_config or str(
        CONFIG_DIR / (DEFAULT_GPU_CONFIG if resolve_device(params) == "cuda" else DEFAULT_CPU_CONFIG)
    )
    path = Path(name).expanduser()
    for candidate in (path, project_dir() / path):
        if candidate.is_file():
            return candidate.resolve()
    raise LaunchError(
        f"accelerate config {name!r} not found (looked in {Path.cwd()} and {project_dir()}); "
        f"set parameter 'accelerate_config' to one of {project_dir() / CONFIG_DIR}/*.yaml or your own"
    )


def accelerate_command(
    params: WorkbookParams,
    params_file: str | Path,
    output_dir: str | Path,
    *,
    resume: bool = False,
    force_resume: bool = False,
    mlflow_run_id: str = "",
    port: int | None = None,
) -> list[str]:
    """``python -m accelerate.commands.launch --config_file C --num_processes N -m papo_nb.cli train ...``."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config_path(params)),
        "--num_processes",
        str(params.num_processes),
        "--main_process_port",
        str(port or _free_port("127.0.0.1")),
        "-m",
        "papo_nb.cli",
        "train",
        "--params",
        str(params_file),
        "--output-dir",
        str(output_dir),
    ]
    if resume:
        command.append("--resume")
    if force_resume:
        command.append("--force-resume")
    if mlflow_run_id:
        command += ["--mlflow-run-id", mlflow_run_id]
    return command


@dataclass
class LaunchResult:
    """What ``launch_distributed`` ran and where its results are."""

    returncode: int
    command: list[str]
    output_dir: Path
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def summary(self) -> dict:
        path = self.output_dir / SUMMARY_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the launched run did not finish (exit code {self.returncode})"
            )
        return json.loads(path.read_text())

    @property
    def log_history(self) -> list[dict]:
        return self.summary()["log_history"]

    @property
    def probe_evidence(self) -> dict | None:
        return self.summary()["probe"]

    @property
    def last_checkpoint(self) -> Path | None:
        last = self.summary()["last_checkpoint"]
        return Path(last) if last else None

    def check(self) -> LaunchResult:
        if not self.ok:
            raise RuntimeError(
                f"the launched training run failed with exit code {self.returncode}: {' '.join(self.command)}"
            )
        return self


def launch_distributed(
    params: WorkbookParams,
    output_dir: str | Path,
    *,
    resume: bool = False,
    force_resume: bool = False,
    mlflow_run_id: str = "",
    tracking_uri: str | None = None,
    stream: TextIO | None = None,
) -> LaunchResult:
    """Run ``papo-nb train`` on ``params.num_processes`` processes under ``accelerate launch``, streaming its output
    (to ``stream``, default stdout) line by line. Interrupting this call stops the whole launched job."""
    from papo_nb.infra.tracking import absolute_tracking_uri, default_tracking_uri

    stream = stream or sys.stdout
    output_dir = Path(output_dir).resolve()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="papo_nb-launch-") as folder:
        params_file = Path(folder) / "params.yaml"
        params_file.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
        command = accelerate_command(
            params, params_file, output_dir, resume=resume, force_resume=force_resume, mlflow_run_id=mlflow_run_id
        )
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "MLFLOW_TRACKING_URI": absolute_tracking_uri(tracking_uri or default_tracking_uri()),
        }
        stream.write(f"{PROGRESS_PREFIX} launching {params.num_processes} processes: {' '.join(command)}\n")
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            for line in process.stdout:
                stream.write(line)
                stream.flush()
            returncode = process.wait()
        except BaseException:
            _stop_process_group(process)
            raise
    return LaunchResult(returncode, command, output_dir, time.monotonic() - started)


def trained_policy(params: WorkbookParams, checkpoint: str | Path):
    """(model, processor, held-out eval dataset) with the adapter of ``checkpoint`` loaded, checked against its
    file, in this process: what a notebook evaluates after a launched run."""
    from papo_nb.workbook.builder import load_datasets, load_policy
    from papo_nb.workbook.checkpoints import load_trainable_adapter

    model, processor = load_policy(params)
    model, _ = load_trainable_adapter(model, checkpoint)
    return model, processor, load_datasets(params)[1]


# --------------------------------------------------------------------------------------------
# papo-nb train
# --------------------------------------------------------------------------------------------


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
