"""Blacking out the masked branch's images: ``round(ratio * n)`` units drawn per image, and the units (or single
values) chosen turned into pixels, on the real patches of a ``PatchMap`` (``layouts.py``) only.

Every function here draws its randomness from an explicit ``torch.Generator`` and returns new tensors: it never writes
into its input (upstream defect 3). The fill is the map's: black after normalisation (upstream defect 2). The upstream
v0.29.1 trainer masked only 4-D/5-D tensors and left Qwen-VL's 2-D rows unchanged (defect 1); here every layout of
``layouts.py`` is masked by whole patches.
"""

from __future__ import annotations

import torch

from .layouts import PatchMap


def select_units(units_per_segment: torch.Tensor, ratio: float, generator: torch.Generator | None) -> torch.Tensor:
    """``round(ratio * n)`` of the ``n`` units of every segment, uniformly at random; one bool per unit.

    An exact count per image (rather than an independent coin per unit) perturbs every image by the same amount,
    which keeps the perception KL comparable across batches."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio!r}")
    counts = units_per_segment.long().cpu()
    segment = torch.repeat_interleave(torch.arange(len(counts)), counts)
    noise = torch.rand(segment.shape, generator=generator, dtype=torch.float64)
    order = torch.argsort(segment.double() + noise)  # grouped by segment, random inside
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    rank = rank - (counts.cumsum(0) - counts)[segment]
    return rank < torch.round(counts.double() * ratio).long()[segment]


def apply_units(patches: PatchMap, pixel_values: torch.Tensor, selected_units: torch.Tensor) -> torch.Tensor:
    """Black out the units chosen by ``selected_units`` (one bool per unit of the batch); a new tensor."""
    total = int(patches.units_per_segment.sum())
    if selected_units.shape != (total,):
        raise ValueError(f"selection of shape {tuple(selected_units.shape)} for {total} patches ({patches.layout})")
    lookup = torch.cat([torch.zeros(1, dtype=torch.bool), selected_units.cpu().bool()])
    chosen = patches.expand(lookup[patches.units + 1]).to(pixel_values.device) & patches.real_pixels
    return _fill(patches, pixel_values, chosen)


def apply_values(patches: PatchMap, pixel_values: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Black out single values chosen by ``coins`` (shape of ``pixel_values``) inside real patches only."""
    return _fill(patches, pixel_values, coins.to(pixel_values.device) & patches.real_pixels)


def _fill(patches: PatchMap, pixel_values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return torch.where(chosen, patches.fill.to(device=pixel_values.device, dtype=pixel_values.dtype), pixel_values)
