"""The per-term metrics of PAPO-G, logged by the trainer once per loss call, and the per-completion record a reviewer
reads (``PerceptionRecord``)."""

from __future__ import annotations

from collections import deque

import torch

ROLLOUT_ROW_KEY = "papo_rollout_row"  # a batch entry: each completion's row in its generation batch, for review


class PerceptionRecord:
    """Per completion, the (KL, H, H_masked) token means of the latest loss calls on this rank.

    ``completions``: ``(prompt_ids, completion_ids, KL, H, H_masked)`` of the latest ``keep`` completions;
    ``rollout``: by a completion's row in this rank's latest generation batch (``ROLLOUT_ROW_KEY``, carried through
    TRL's shuffle), its ``(KL, H, H_masked)``, emptied when a new round is generated."""

    def __init__(self, keep: int):
        self.completions: deque = deque(maxlen=keep)
        self.rollout: dict[int, tuple[float, float, float]] = {}

    def add(self, inputs, rows: list[list[float]]) -> None:
        """``rows``: the batch's per-completion token means, in its row order."""
        ids = zip(inputs["prompt_ids"].tolist(), inputs["completion_ids"].tolist(), strict=True)
        self.completions.extend((p, c, *r) for (p, c), r in zip(ids, rows, strict=True))
        for row, row_terms in zip(inputs.get(ROLLOUT_ROW_KEY, torch.empty(0)).tolist(), rows, strict=False):
            self.rollout[row] = tuple(row_terms)


# What the masked branch measures: with the branch skipped these would read the original branch (a KL of exactly 0,
# the original entropy under the masked name), so they are not logged at all rather than logged as numbers.
MASKED_BRANCH_METRICS = (
    "perception_kl",
    "perception_loss",
    "masked_entropy",
    "papo/gamma_kl",
    "papo/masked_entropy_term",
)


def log_perception_metrics(
    metrics: dict,
    accelerator,
    sums,
    token_count,
    parent_loss,
    *,
    gamma: float,
    discount: float,
    eta: tuple,
    masked_measured: bool = True,
) -> None:
    """Every term on its own, as token means over all ranks (so comparable with the official actor/* logs), into
    ``metrics`` (the trainer's lists of this mode): KL, both entropies, gamma * KL, each weighted entropy term
    (``eta``: the effective weights, discount applied), gamma, the discount and the parent's loss. Without
    ``masked_measured`` (the masked branch skipped) the terms of ``MASKED_BRANCH_METRICS`` are left out."""
    # One all-reduce per step: the parent's loss rides along (its mean over ranks is its sum / processes).
    parent = sums.new_zeros(1) if parent_loss is None else parent_loss.detach().float().reshape(1)
    totals = accelerator.reduce(torch.cat([sums, token_count[None], parent]).float(), reduction="sum")
    kl, original_h, masked_h = (totals[:3] / totals[3].clamp(min=1.0)).tolist()
    eta1, eta2 = eta
    values = {
        "perception_kl": kl,
        "perception_loss": -kl,
        "masked_entropy": masked_h,
        "original_entropy": original_h,
        "perception_gamma": gamma,
        "papo/gamma_kl": gamma * kl,
        "papo/original_entropy_term": eta1 * original_h,
        "papo/masked_entropy_term": eta2 * masked_h,
        "papo/discount": discount,
    }
    if parent_loss is not None:
        values["papo/parent_loss"] = (totals[4] / accelerator.num_processes).item()
    for key, value in values.items():
        if masked_measured or key not in MASKED_BRANCH_METRICS:
            metrics[key].append(value)
