"""Which rows of a batch's image tensors belong to each sample: the image layout, detected from the batch's keys and
shapes, and each sample's range of ``pixel_values`` and of the tensors aligned with it. The layouts are listed in
``papo_nb/papo/layouts.py``, which numbers their real patches for masking; here is only where each sample's images
are, which prompt grouping (``prompt_identity.py``) and packing (``packed_rows.py``) read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

LAYOUTS = ("grid_rows", "tile_rows", "tiles", "images", "sized_images", "crops", "position_rows")


def sample_row_ranges(image_grid_thw: torch.Tensor, num_images: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` rows of each sample's images in flattened Qwen-VL ``pixel_values`` (TRL's ``num_images``
    lists how many images each sample has, in order)."""
    rows = image_grid_thw.prod(dim=-1).long().cpu().tolist()
    return count_ranges([sum(rows[a:b]) for a, b in count_ranges(num_images)])


def count_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of consecutive runs of ``counts`` items."""
    ends = torch.tensor([0, *counts], dtype=torch.long).cumsum(0).tolist()
    return list(zip(ends[:-1], ends[1:], strict=True))


def _describe(inputs: dict[str, Any]) -> str:
    seen = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in inputs.items() if v is not None}
    return ", ".join(f"{k}={v}" for k, v in sorted(seen.items()) if k not in ("advantages", "num_items_in_batch"))


def detect_layout(inputs: dict[str, Any]) -> str:
    """The layout of a batch, from its keys and shapes; an unknown one raises with what it saw."""
    pv = inputs.get("pixel_values")
    dim = pv.dim() if isinstance(pv, torch.Tensor) else None
    has = {k for k, v in inputs.items() if v is not None}
    if dim == 2 and "image_grid_thw" in has:
        return "grid_rows"
    if dim == 3 and {"spatial_shapes", "pixel_attention_mask"} <= has:
        return "tile_rows"
    if dim == 3 and "image_position_ids" in has and "image_grid_thw" not in has:
        return "position_rows"
    if "image_position_ids" not in has and "image_grid_thw" not in has and "spatial_shapes" not in has:
        if dim == 5:
            return "crops" if "image_sizes" in has else "tiles"
        if dim == 4 and "image_sizes" in has:
            return "sized_images"
        if dim == 4 and "pixel_attention_mask" not in has:
            return "images"
    raise ValueError(
        f"mask_type: no patch layout matches this batch ({_describe(inputs)}); known layouts: {', '.join(LAYOUTS)} "
        "(layouts.py): this family's images cannot be masked yet, with any mask_type"
    )


def _per_sample(n_rows: int, inputs: dict[str, Any]) -> list[int]:
    """Images per sample along dim 0: ``num_images`` when it covers the rows, else one row per sample."""
    num_images = inputs.get("num_images")
    if num_images is not None and sum(num_images) == n_rows:
        return list(num_images)
    n_samples = inputs["prompt_ids"].shape[0] if inputs.get("prompt_ids") is not None else n_rows
    if n_rows != n_samples:
        raise ValueError(f"pixel_values has {n_rows} images for {n_samples} samples and num_images={num_images!r}")
    return [1] * n_rows


def segments_per_sample(inputs: dict[str, Any], layout: str) -> list[int]:
    """How many images (or tiles) each sample owns, in order."""
    pv = inputs["pixel_values"]
    if layout == "grid_rows":
        return list(inputs.get("num_images") or [1] * len(inputs["image_grid_thw"]))
    if layout == "tile_rows":
        num_tiles = inputs.get("num_tiles")
        if num_tiles is None:
            raise ValueError(f"the tile_rows layout needs num_tiles to find each sample's tiles ({_describe(inputs)})")
        return list(num_tiles)
    if layout == "tiles":
        return [pv.shape[1]] * pv.shape[0]
    if layout == "crops":  # every entry of the padded list is a segment (padded ones have no unit)
        return [n * pv.shape[1] for n in _per_sample(pv.shape[0], inputs)]
    return _per_sample(pv.shape[0], inputs)


def image_rows(layout: str, segments: list[int], rows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each sample's range of the tensors with one row per image: ``image_grid_thw`` in grid rows (the other aligned
    tensors have one row per patch there), elsewhere its ``rows`` of ``pixel_values`` (``sample_rows``)."""
    return count_ranges(segments) if layout == "grid_rows" else rows


def sample_rows(inputs: dict[str, Any], layout: str) -> list[tuple[int, int]]:
    """The dim-0 range of ``pixel_values`` (and of the tensors aligned with it) of each sample."""
    segments = segments_per_sample(inputs, layout)
    if layout == "grid_rows":
        return sample_row_ranges(inputs["image_grid_thw"], segments)
    if layout == "tiles":  # dim 0 is the sample, its tiles on dim 1
        return count_ranges([1] * len(segments))
    if layout == "crops":  # dim 0 is the image, its entries on dim 1
        return count_ranges(_per_sample(inputs["pixel_values"].shape[0], inputs))
    return count_ranges(segments)


@dataclass(frozen=True)
class SampleRows:
    """Where each sample's images are in a batch: its ``layout``, and per sample its images or tiles
    (``segments_per_sample``), its rows of ``pixel_values`` and of the tensors aligned with it (``sample_rows``), its
    rows of the tensors with one row per image (``image_rows``) and its range of segments (``segment_ranges``)."""

    layout: str
    segments_per_sample: list[int]
    sample_rows: list[tuple[int, int]]
    image_rows: list[tuple[int, int]]
    segment_ranges: list[tuple[int, int]]


def sample_structure(inputs: dict[str, Any]) -> SampleRows:
    """The batch's ``SampleRows``, its layout detected from its keys and shapes (an unknown one raises)."""
    layout = detect_layout(inputs)
    segments = segments_per_sample(inputs, layout)
    rows = sample_rows(inputs, layout)
    return SampleRows(layout, segments, rows, image_rows(layout, segments, rows), count_ranges(segments))
