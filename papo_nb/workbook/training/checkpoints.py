"""Checkpoints: find the latest (adapter or full model); resume into a trained adapter (phase 2) and prove it is
the one saved."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ADAPTER_FILE = "adapter_model.safetensors"
# A whole model as Trainer saves it after full fine-tuning (``save_pretrained``): one file, or shards and their index.
FULL_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json")
CHECKPOINT_PREFIX = "checkpoint-"


@dataclass
class RestoredAdapter:
    """Evidence that a loaded adapter is the checkpoint's, and that it will train."""

    checkpoint: str
    tensors_compared: int
    max_abs_difference: float
    equal: bool
    trainable_parameters: int

    def to_dict(self):
        return asdict(self)


def checkpoint_step(folder: str | Path) -> int:
    return int(Path(folder).name[len(CHECKPOINT_PREFIX) :])


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """``checkpoint-N`` folders, newest (highest N) first."""
    folders = [
        p
        for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
        if p.is_dir() and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(folders, key=checkpoint_step, reverse=True)


def holds_model(folder: str | Path) -> bool:
    """Whether a checkpoint folder holds a policy: a LoRA adapter or a whole model (single file or sharded)."""
    return any((Path(folder) / name).is_file() for name in (ADAPTER_FILE, *FULL_MODEL_FILES))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The highest-step ``checkpoint-N`` folder holding an adapter or, after ``finetuning: full``, a whole model;
    None when there is none (folders without either, e.g. a save cut short, are passed over)."""
    return next((p for p in checkpoint_folders(output_dir) if holds_model(p)), None)


def load_trainable_adapter(base_model, checkpoint: str | Path):
    """``PeftModel.from_pretrained(..., is_trainable=True)`` plus a tensor-by-tensor check against the file.

    ``is_trainable=False`` (peft's default) would load a frozen adapter and train nothing, silently.
    """
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    if not (checkpoint / ADAPTER_FILE).is_file():
        raise FileNotFoundError(
            f"checkpoint {str(checkpoint)!r} has no {ADAPTER_FILE}; expected a PEFT adapter folder"
        )
    model = PeftModel.from_pretrained(base_model, str(checkpoint), is_trainable=True)
    saved = load_file(str(checkpoint / ADAPTER_FILE))
    loaded = get_peft_model_state_dict(model)
    if set(saved) != set(loaded):
        raise ValueError(f"adapter in {checkpoint} does not match the model: {sorted(set(saved) ^ set(loaded))[:5]}")
    max_difference = max((saved[k].float() - loaded[k].detach().cpu().float()).abs().max().item() for k in saved)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    evidence = RestoredAdapter(str(checkpoint), len(saved), max_difference, max_difference == 0.0, trainable)
    if not evidence.equal:
        raise ValueError(f"restored adapter differs from {checkpoint} by up to {max_difference:.3e}")
    if trainable == 0:
        raise ValueError(f"adapter from {checkpoint} loaded with no trainable parameters")
    return model, evidence


def describe_reference(trainer) -> str:
    """What the KL reference policy is, as TRL 1.9.1 set it up."""
    if trainer.beta == 0.0:
        return "none: beta = 0, no reference KL"
    peft_config = getattr(trainer.model, "peft_config", {})
    if "ref" in peft_config:
        return "frozen copy of the loaded adapter (peft adapter 'ref'), the policy the run started from"
    if peft_config:
        return "the base model with the LoRA adapter disabled"
    return "a separate frozen copy of the initial model"


REFERENCE_MATCH_TOL = 1e-5  # log-prob agreement that counts as "the same policy" (same inputs, fp32)


def reference_evidence(trainer, inputs) -> dict:
    """Which policy TRL's reference log-probs really come from, measured rather than inferred from the setup.

    ``inputs``: a rollout batch made before any optimizer step with beta != 0 (e.g. ``rollout_batch``), so that
    ``inputs["ref_per_token_logps"]`` is TRL's own reference computation and the trainable adapter is still the
    policy the run started from. They are compared, on completion tokens, with the log-probs of the base model
    (adapters disabled) and of that starting policy; ``matches`` names the one within ``REFERENCE_MATCH_TOL``.
    """
    from papo_nb.papo.logp_inputs import logp_call_arguments

    if inputs.get("ref_per_token_logps") is None:
        raise ValueError("the batch has no ref_per_token_logps: with beta = 0 TRL computes no reference")
    model = trainer.accelerator.unwrap_model(trainer.model)
    positional, vlm_kwargs = logp_call_arguments(inputs)
    with torch.no_grad():
        with model.disable_adapter():
            base, _, _ = trainer._get_per_token_logps_and_entropies(model, *positional, **vlm_kwargs)
        start, _, _ = trainer._get_per_token_logps_and_entropies(model, *positional, **vlm_kwargs)
    tokens = inputs["completion_mask"].bool()
    ref = inputs["ref_per_token_logps"]
    gap = lambda a, b: (a - b)[tokens].abs().max().item()  # noqa: E731
    evidence = dict(
        reference_vs_base=gap(ref, base),
        reference_vs_start_policy=gap(ref, start),
        start_policy_vs_base=gap(start, base),
        tolerance=REFERENCE_MATCH_TOL,
        described=describe_reference(trainer),
    )
    if (
        evidence["reference_vs_base"] <= REFERENCE_MATCH_TOL
        and evidence["start_policy_vs_base"] <= REFERENCE_MATCH_TOL
    ):
        evidence["matches"] = "base = start policy"
    elif evidence["reference_vs_base"] <= REFERENCE_MATCH_TOL:
        evidence["matches"] = "base"
    elif evidence["reference_vs_start_policy"] <= REFERENCE_MATCH_TOL:
        evidence["matches"] = "init_adapter"
    else:
        evidence["matches"] = "neither"
    return evidence


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The trainable adapter's weights (cloned), keyed as in the saved file."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
