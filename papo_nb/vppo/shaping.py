"""VPPO's per-token maths, free of the trainer: visual dependency, the kept tokens, and the trajectory advantage scale.

Everything follows the official actor (huaixuheqing/VPPO-RL at a23c54b, ``verl/workers/actor/dp_actor.py``; line
numbers below are that file's), all in fp32:

- visual dependency of token t: the bounded k3 estimate ``exp(d) - d - 1`` with d = log pi(o_t | I_mask) -
  log pi(o_t | I) clamped to [-20, 20], the value clamped to [0, 10] (L403-L405), from two no-grad log-probs of the
  rollout-time policy (``aug_log_probs`` and ``old_log_probs``);
- token filtering: the ``ceil(n * token_fraction)`` tokens of each completion with the highest dependency keep their
  policy gradient, the others are zeroed in the per-token loss while the normaliser still counts them (L411-L426,
  ``core_algos.py`` L495-L499);
- trajectory shaping: each completion's mean dependency (its sensitivity score, L282-L288) is min-max normalised
  against the range of its optimisation batch (L290-L296), clamped to [0, 1], and mapped to
  ``[scale_min, scale_min + (1 - scale_min) / mean]`` where ``mean`` is the micro-batch's mean normalised score
  (L496-L523): the scale averages to 1 over the micro-batch. With ``scale_min = 1`` the band is [1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..papo.terms import bounded_k3, zero_outside

# Official guards (dp_actor.py L499 and L512): a flat score range leaves every scale at 1; epsilon under the mean.
FLAT_RANGE = 1e-6
MEAN_EPSILON = 1e-8


def token_dependency(masked_logps: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token visual dependency (B, T), fp32, exactly 0 outside ``mask`` (L403-L405)."""
    return zero_outside(bounded_k3(masked_logps, logps).clamp(min=0.0), mask)


def kept_tokens(dependency: torch.Tensor, mask: torch.Tensor, token_fraction: float) -> torch.Tensor:
    """Bool (B, T): the ``ceil(n_i * token_fraction)`` most dependent of each row's ``n_i`` tokens (L411-L426).

    Ties are broken by position, earlier first (a stable sort; the official sort is not stable, so which of two
    equal tokens it keeps is unspecified). ``token_fraction`` 1.0 keeps every token."""
    valid = mask > 0
    counts = valid.sum(dim=1)
    keep_count = torch.ceil(counts.float() * token_fraction).long()  # fp32 product, as the official int * float
    ranked = torch.where(valid, dependency, torch.full_like(dependency, -torch.inf))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices
    rank_kept = torch.arange(ranked.shape[1], device=ranked.device).expand_as(ranked) < keep_count.unsqueeze(1)
    kept = torch.zeros_like(valid).scatter(1, order, rank_kept)
    return kept & valid


def sensitivity_scores(dependency: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean dependency over its tokens (L282-L288); 0 for a row without tokens."""
    counts = (mask > 0).sum(dim=1)
    return (dependency * (mask > 0)).sum(dim=1) / counts.clamp(min=1)


def score_range(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` of the scores of rows with tokens (L290-L296); NaN where fewer than two rows have tokens (the
    official code then leaves every scale at 1)."""
    valid = scores[(mask > 0).any(dim=1)]
    if valid.numel() <= 1:
        return scores.new_full((2,), torch.nan)
    return torch.stack([valid.min(), valid.max()])


@dataclass
class AdvantageScale:
    """One micro-batch's trajectory scale: ``scale`` (B,) multiplies each row's advantage; ``upper`` is the dynamic
    top of the band (NaN where the range is flat and every scale is 1)."""

    scale: torch.Tensor
    upper: torch.Tensor


def advantage_scale(scores: torch.Tensor, low_high: torch.Tensor, has_tokens: torch.Tensor, scale_min: float):
    """The official trajectory scale of a micro-batch (L496-L523): rows with tokens are normalised against
    ``low_high`` (the optimisation batch's ``[min, max]``), clamped to [0, 1] and mapped to
    ``[scale_min, scale_min + (1 - scale_min) / mean]``; rows without tokens, and every row of a flat or unknown
    range, keep 1."""
    scale = torch.ones_like(scores)
    low, high = low_high[0], low_high[1]
    span = high - low
    if not bool(torch.isfinite(span)) or not bool(span > FLAT_RANGE) or not bool(has_tokens.any()):
        return AdvantageScale(scale, scores.new_tensor(torch.nan))
    normalised = ((scores[has_tokens] - low) / span).clamp(0.0, 1.0)
    upper = scale_min + (1.0 - scale_min) / (normalised.mean() + MEAN_EPSILON)
    scale[has_tokens] = scale_min + normalised * (upper - scale_min)
    return AdvantageScale(scale, upper)


def shaped_advantages(advantages: torch.Tensor, scale: torch.Tensor, filtered: torch.Tensor) -> torch.Tensor:
    """(B, T) advantages for the parent's loss: each row's advantage times its scale, and exactly 0 on ``filtered``
    tokens (completion tokens outside the kept share), so that their per-token loss and gradient are 0 for every
    loss type while the parent's normaliser still counts them, as the official mask does (``core_algos.py``
    L495-L499). Nothing filtered and a scale of 1 give the parent's advantages value for value."""
    per_row = (advantages * scale).unsqueeze(1).expand_as(filtered)
    return torch.where(filtered, torch.zeros((), dtype=per_row.dtype, device=per_row.device), per_row)
