"""Masking the masked branch's images: ``round(ratio * n)`` units drawn per image, and the units (or single values)
chosen turned into pixels, on the real patches of a ``PatchMap`` (``layouts.py``) only.

Every function here draws its randomness from an explicit ``torch.Generator`` and returns new tensors: it never writes
into its input (upstream defect 3). The default fill is the map's: black after normalisation (upstream defect 2);
``"mean"`` fills with the processor's mean colour instead (0 after normalisation), for images whose background is
black, where a black fill changes nothing (as for a placebo mask over the background). Either fill is a constant, so
the masks drawn for a seed do not depend on it. A dataset may exclude units from masking per example
(``excluded_units``): they are never chosen, and an image masks ``round(ratio * n)`` of its ``n`` real units or every
unit it allows, whichever is fewer. The upstream v0.29.1 trainer masked only 4-D/5-D tensors and left Qwen-VL's 2-D
rows unchanged (defect 1); here every layout of ``layouts.py`` is masked by whole patches.
"""

from __future__ import annotations

import torch

from .layouts import PatchMap

MASK_FILLS = ("black", "mean")  # black after normalisation (upstream's aim); the processor's mean colour
EXCLUDED_UNITS_KEY = "papo_mask_excluded_units"  # a batch entry: per sample, the unit indices never masked (-1 pads)


def select_units(
    units_per_segment: torch.Tensor,
    ratio: float,
    generator: torch.Generator | None,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """``round(ratio * n)`` of the ``n`` units of every segment, uniformly at random; one bool per unit.
    ``excluded`` (one bool per unit) are never chosen: a segment then masks at most the units it allows. The
    generator draws the same numbers either way, so an exclusion changes only which of them are kept.

    An exact count per image (rather than an independent coin per unit) perturbs every image by the same amount,
    which keeps the perception KL comparable across batches."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio!r}")
    counts = units_per_segment.long().cpu()
    segment = torch.repeat_interleave(torch.arange(len(counts)), counts)
    noise = torch.rand(segment.shape, generator=generator, dtype=torch.float64)
    wanted = torch.round(counts.double() * ratio).long()
    if excluded is None:
        order = torch.argsort(segment.double() + noise)  # grouped by segment, random inside
    else:
        if excluded.shape != segment.shape:
            raise ValueError(f"excluded units of shape {tuple(excluded.shape)} for {segment.numel()} units")
        excluded = excluded.cpu().bool()
        # grouped by segment, its allowed units first, random inside each group
        order = torch.argsort(segment.double() * 4 + excluded.double() * 2 + noise)
        allowed = torch.zeros(len(counts), dtype=torch.long).index_add_(0, segment, (~excluded).long())
        wanted = torch.minimum(wanted, allowed)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    rank = rank - (counts.cumsum(0) - counts)[segment]
    return rank < wanted[segment]


def excluded_units(n_units: int, indices: list[int], *, sample: int) -> torch.Tensor:
    """One bool per unit of a sample (``n_units``): True at ``indices``, the units its dataset row excludes;
    refuses an index that is not one of the sample's units."""
    bad = [i for i in indices if not 0 <= i < n_units]
    if bad:
        raise ValueError(
            f"mask_excluded_column: sample {sample} excludes units {bad}; allowed: unit indices 0..{n_units - 1} "
            f"(the sample's {n_units} real patch units, in masking.select_units' order)"
        )
    flags = torch.zeros(n_units, dtype=torch.bool)
    flags[list(indices)] = True
    return flags


def fill_values(patches: PatchMap, fill: str = "black") -> torch.Tensor:
    """The value masked pixels take: ``"black"`` the map's normalised black, ``"mean"`` 0 (the mean colour)."""
    if fill not in MASK_FILLS:
        raise ValueError(f"mask_fill={fill!r} is unknown; allowed: {MASK_FILLS}")
    return patches.fill if fill == "black" else torch.zeros_like(patches.fill)


def selected_pixels(patches: PatchMap, selected_units: torch.Tensor) -> torch.Tensor:
    """The pixels of the units ``selected_units`` chooses (one bool per unit of the batch), real pixels only: a bool
    broadcastable to ``pixel_values``, where ``real_pixels`` lives (the images' device)."""
    total = int(patches.units_per_segment.sum())
    if selected_units.shape != (total,):
        raise ValueError(f"selection of shape {tuple(selected_units.shape)} for {total} patches ({patches.layout})")
    lookup = torch.cat([torch.zeros(1, dtype=torch.bool), selected_units.cpu().bool()])
    return lookup[patches.pixel_units + 1].to(patches.real_pixels.device) & patches.real_pixels


def apply_units(
    patches: PatchMap, pixel_values: torch.Tensor, selected_units: torch.Tensor, fill: str = "black"
) -> torch.Tensor:
    """Fill the units chosen by ``selected_units`` (one bool per unit of the batch) with ``fill``; a new tensor."""
    return _fill(patches, pixel_values, selected_pixels(patches, selected_units).to(pixel_values.device), fill)


def apply_values(
    patches: PatchMap, pixel_values: torch.Tensor, coins: torch.Tensor, fill: str = "black"
) -> torch.Tensor:
    """Fill single values chosen by ``coins`` (shape of ``pixel_values``) inside real patches only."""
    return _fill(patches, pixel_values, coins.to(pixel_values.device) & patches.real_pixels, fill)


def _fill(patches: PatchMap, pixel_values: torch.Tensor, chosen: torch.Tensor, fill: str) -> torch.Tensor:
    value = fill_values(patches, fill).to(device=pixel_values.device, dtype=pixel_values.dtype)
    return torch.where(chosen, value, pixel_values)
