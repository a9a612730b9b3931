"""The per-term metrics of PAPO-G, logged by the trainer once per loss call."""

from __future__ import annotations

import torch


def log_perception_metrics(
    metrics: dict, accelerator, sums, token_count, parent_loss, *, gamma: float, discount: float, eta: tuple
) -> None:
    """Every term on its own, as token means over all ranks (so comparable with the official actor/* logs), into
    ``metrics`` (the trainer's lists of this mode): KL, both entropies, gamma * KL, each weighted entropy term
    (``eta``: the effective weights, discount applied), gamma, the discount and the parent's loss."""
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
        metrics[key].append(value)
