"""Resuming a run: which parameter changes are refused, and evidence that the checkpoint was really restored.

``resume_differences`` lists the parameters that differ from the run's ``params.yaml`` in a way that matters
(``--force-resume`` accepts them); ``resume_callback`` compares what ``Trainer.train(resume_from_checkpoint=...)``
restored with the checkpoint's files, tensor by tensor, and stops the run on any difference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from papo_nb.train.run_folder import (
    PARAMS_FILE,
    PROGRESS_PREFIX,
    RESUME_EVIDENCE_FILE,
    TRAINER_STATE_FILE,
    LaunchError,
    write_json,
)
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.checkpoints import ADAPTER_FILE

# Parameters a resumed run may change: they do not change what is trained (where it runs, how often it is saved,
# what the other notebooks or the final evaluation use). Every other parameter, including ones added later,
# must match the run's params.yaml unless --force-resume. max_steps matters: it sets the learning-rate (and a
# linear gamma) schedule; num_processes and accelerate_config matter: they change the global batch and the
# checkpoint format.
RESUME_SAFE_KEYS = frozenset(
    {
        "device",
        "save_steps",
        "save_total_limit",
        "gradient_checkpointing",  # recomputes the same activations: memory and time, not what is trained
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


class ResumeMismatch(LaunchError):
    """``--resume`` with parameters that differ from the original run's in a way that matters."""


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


def max_difference(a: Any, b: Any) -> float:
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
        return max((max_difference(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max((max_difference(x, y) for x, y in zip(a, b)), default=0.0)
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return abs(float(a) - float(b))
    return 0.0 if a == b else float("inf")


def restored_evidence(trainer, checkpoint: Path, state, optimizer, lr_scheduler) -> dict[str, Any]:
    """What ``train(resume_from_checkpoint=...)`` restored, beside the checkpoint: the step, the adapter weights and
    (when saved) the optimizer and scheduler states, as largest absolute differences."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved_state = json.loads((checkpoint / TRAINER_STATE_FILE).read_text())
    evidence: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "checkpoint_step": saved_state["global_step"],
        "resumed_at_step": state.global_step,
    }
    saved_adapter = load_file(str(checkpoint / ADAPTER_FILE))
    evidence["adapter_max_abs_difference"] = max_difference(
        saved_adapter, get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model))
    )
    if (checkpoint / "optimizer.pt").is_file() and optimizer is not None:
        saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
        evidence["optimizer_max_abs_difference"] = max_difference(saved, optimizer.state_dict())
        evidence["optimizer_steps"] = max((int(s["step"]) for s in saved["state"].values() if "step" in s), default=0)
    if (checkpoint / "scheduler.pt").is_file() and lr_scheduler is not None:
        saved = torch.load(checkpoint / "scheduler.pt", map_location="cpu", weights_only=True)
        evidence["scheduler_max_abs_difference"] = max_difference(saved, lr_scheduler.state_dict())
        evidence["scheduler_last_epoch"] = saved.get("last_epoch")
    return evidence


def restore_checks(evidence: dict[str, Any]) -> dict[str, bool]:
    """Each restored piece, exactly as saved (pieces the checkpoint did not hold count as restored)."""
    return {
        "step": evidence["resumed_at_step"] == evidence["checkpoint_step"],
        "adapter": evidence["adapter_max_abs_difference"] == 0.0,
        "optimizer": evidence.get("optimizer_max_abs_difference", 0.0) == 0.0,
        "scheduler": evidence.get("scheduler_max_abs_difference", 0.0) == 0.0,
        "mask_rng": evidence.get("mask_rng_restored", True),
    }


def resume_callback(trainer, checkpoint: Path, is_main: bool, output_dir: Path):
    """A TrainerCallback that compares what ``train(resume_from_checkpoint=...)`` restored with the checkpoint:
    step, optimizer and scheduler state and adapter weights when training begins, the masking generator at the
    first step (the Trainer restores RNG states there). A difference stops the run."""
    import mlflow
    import torch
    from transformers import TrainerCallback

    from papo_nb.infra.tracking import log_evidence

    class ResumeCheck(TrainerCallback):
        evidence: dict = {}

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            self.evidence = restored_evidence(trainer, checkpoint, state, optimizer, lr_scheduler)
            self.first_step = True

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.first_step:
                return
            self.first_step = False
            evidence = self.evidence
            mask_file = Path(trainer.masks.rng_file(str(checkpoint)))
            if mask_file.is_file():
                evidence["mask_rng_restored"] = bool(
                    torch.equal(torch.load(mask_file, weights_only=True), trainer.mask_generator.get_state())
                )
            checks = restore_checks(evidence)
            evidence["restored"] = all(checks.values())
            if is_main:
                write_json(output_dir / RESUME_EVIDENCE_FILE, evidence)
                if mlflow.active_run() is not None:
                    log_evidence("resume", evidence, prefix="resume", step=state.global_step)
            if not evidence["restored"]:
                failed = ", ".join(k for k, ok in checks.items() if not ok)
                raise RuntimeError(f"resume from {checkpoint} did not restore: {failed}; evidence {evidence}")
            if is_main:
                print(
                    f"{PROGRESS_PREFIX} resumed from {checkpoint.name} at step {state.global_step}: adapter, "
                    "optimizer, scheduler and RNG states restored exactly",
                    flush=True,
                )

    return ResumeCheck()
