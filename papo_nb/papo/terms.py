"""The PAPO-G per-token maths, free of the trainer: the bounded k3 perception KL, the GRPO-style reductions, and
the terms of one batch built from them.

Everything here runs in fp32 whatever the model dtype, as the official code does (verl's ``compute_kl`` upcasts both
log-probs, ``verl/trainer/core_algos.py`` line 585 of the official repository, linked below); the masks and token
counts are fp32 too, so a bf16 step cannot round a count.

Sources, by URL and line:

- official ``low_var_kl`` and its fp32 upcast:
  https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4533b78da5a2bb17bc812375dcb620887d/verl/trainer/core_algos.py#L585-L601
- official optional perception-KL clamp (``use_kl_prcp_clipping``):
  https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4533b78da5a2bb17bc812375dcb620887d/verl/workers/actor/dp_actor.py#L352-L354
- TRL 1.9.1's reduction of the policy term, which ``normalise_like_parent`` repeats for the PAPO terms:
  https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L3124-L3153
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The official low_var_kl (core_algos.py lines 597-601, linked above): the log-ratio clamped to [-20, 20] and the k3
# value to at most 10, so one token whose masked branch is far more confident cannot produce a gradient that grows
# like exp(r).
LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0


def bounded_k3(masked_logps: torch.Tensor, logps: torch.Tensor, extra_clamp: float | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi(.|I) || pi(.|I_mask)), in fp32: ``exp(d) - d - 1``, d = logp_masked - logp.

    ``extra_clamp`` is the official optional ``use_kl_prcp_clipping``: clamp the value to ``[0, extra_clamp]``
    (``dp_actor.py`` lines 353-354, linked in the module docstring)."""
    log_ratio = (masked_logps.float() - logps.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    per_token = (torch.exp(log_ratio) - log_ratio - 1.0).clamp(max=K3_BOUND)
    if extra_clamp is not None:
        per_token = per_token.clamp(0.0, extra_clamp)
    return per_token


def zero_outside(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``per_token`` where ``mask`` is set, exactly 0 elsewhere: a non-finite value at a padded position (where the
    model was never asked to be sensible) then cannot reach the sum as ``inf * 0 = nan``."""
    return torch.where(mask > 0, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))


def normalise_like_parent(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    accumulation: float,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | None,
    num_processes: int,
    steps_per_generation: int,
    training: bool,
) -> torch.Tensor:
    """Reduce a (B, T) per-token quantity exactly as GRPOTrainer 1.9.1 reduces its policy term
    (``grpo_trainer.py`` lines 3124-3153, linked in the module docstring); ``accumulation`` is 1 outside training,
    as there."""
    masked = zero_outside(per_token, mask) * mask
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length) / accumulation
    if loss_type in ("cispo", "dapo", "vespo"):
        normaliser = num_items_in_batch.float().clamp(min=1.0) / num_processes
        if training:
            normaliser = normaliser * accumulation / steps_per_generation
        return masked.sum() / normaliser
    if loss_type == "luspo":  # per-sequence mean times length = per-sequence sum
        return masked.sum(-1).mean() / accumulation
    raise ValueError(f"PAPOGTrainer does not know how to normalise for loss_type={loss_type!r}")


@dataclass
class PerceptionTerms:
    """The adapter's differentiable pieces for one batch (fp32), each normalised like the parent's policy term."""

    perception_kl: torch.Tensor  # normalised mean k3 KL, to be maximised
    original_entropy: torch.Tensor
    masked_entropy: torch.Tensor
    kl_sum: torch.Tensor  # un-normalised sums (no grad), reduced across ranks by the probe
    token_count: torch.Tensor
    has_images: bool


def perception_terms(
    inputs: dict[str, Any], logps, entropies, masked, *, kl_clamp: float | None, estimator: str, normalise: Callable
) -> tuple[PerceptionTerms, torch.Tensor, list[list[float]]]:
    """The terms of one batch from the parent's ``logps`` (and ``entropies``) and the masked branch ``masked``
    (``(logps, entropies)``, or None where it equals the original branch: a text-only batch, a run at gamma 0), on
    completion tokens (times ``tool_mask`` where present); ``normalise(per_token, mask)`` is the parent's
    reduction. Also returns the (KL, H, H_masked) sums and, per completion, their token means (no grad). All fp32."""
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    mask = mask.float()
    has_images = inputs.get("pixel_values") is not None
    if masked is not None:
        masked_logps, masked_entropies = masked
    else:  # a text-only batch, or a run that never uses the branch: it is the original branch, KL exactly 0
        masked_logps, masked_entropies = logps.detach(), None if entropies is None else entropies.detach()
    per_token_kl = bounded_k3(masked_logps, logps, kl_clamp)
    if estimator == "sampled":  # -log pi(o_t): its mean is the sampled entropy estimate
        original_h, masked_h = -logps.float(), -masked_logps.float()
    else:
        original_h, masked_h = entropies.float(), masked_entropies.float()
    with torch.no_grad():
        pieces = (per_token_kl, original_h, masked_h)
        sums = torch.stack([(zero_outside(x, mask) * mask).sum() for x in pieces])
        rows = torch.stack([(zero_outside(x, mask) * mask).sum(1) for x in pieces])
        rows = (rows / mask.sum(1).clamp(min=1.0)).T.tolist()
    terms = PerceptionTerms(
        perception_kl=normalise(per_token_kl, mask),
        original_entropy=normalise(original_h, mask),
        masked_entropy=normalise(masked_h, mask),
        kl_sum=sums[0],
        token_count=mask.sum().detach(),
        has_images=has_images,
    )
    return terms, sums, rows


def assemble_loss(parent_loss: torch.Tensor, terms: PerceptionTerms, gamma: float, eta1: float, eta2: float):
    """The total loss, the one place it is assembled (the probe differentiates it at gamma = 0): the parent's loss
    minus gamma times the perception KL plus the weighted entropies; ``eta1``/``eta2`` are the effective weights,
    the annealing discount already applied."""
    papo = -gamma * terms.perception_kl + eta1 * terms.original_entropy + eta2 * terms.masked_entropy
    return parent_loss + papo
