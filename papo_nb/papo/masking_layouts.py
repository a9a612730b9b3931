"""Patch masks on every image layout TRL 1.9.1's GRPOTrainer passes to the forward.

TRL 1.9.1 forwards whatever the processor returns (``grpo_trainer.py``:2436-2490) and slices it per batch in
``_get_per_token_logps_and_entropies`` (``grpo_trainer.py``:1466-1497). The layouts it knows, and the families that
produce them in transformers 5.24:

- ``grid_rows``: 2-D patch rows ``(sum t*h*w, C*T*P*P)`` + ``image_grid_thw`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V).
- ``tile_rows``: ``(tiles, max_patches, P*P*C)`` channel-last rows + ``pixel_attention_mask`` (real patches) +
  ``spatial_shapes`` + ``num_tiles`` (LFM2-VL; ``image_processing_lfm2_vl.py``:134-147).
- ``tiles``: 5-D ``(B, N, C, H, W)`` + ``pixel_attention_mask`` ``(B, N, H, W)``; padded tiles are all-zero pixels
  (Idefics3, SmolVLM; ``modeling_idefics3.py``:553-574, whose rule "a patch is real when any of its pixels is" is
  kept here).
- ``images``: 4-D ``(n_images, C, H, W)``, every pixel real (Gemma3 with ``token_type_ids``, LLaVA, PaliGemma).
- ``sized_images``: 4-D ``(n_images, C, Hmax, Wmax)`` + ``image_sizes``; the image sits top-left, the rest is
  padding (Pixtral, Mistral3).

Not handled (refused with the keys and shapes seen): 5-D ``pixel_values`` + ``image_sizes`` (LLaVA-NeXT,
LLaVA-OneVision: padded patch lists with an unpadding step) and ``image_position_ids`` (Gemma4).

A ``PatchMap`` numbers the real patches (or merge units) of a batch: ``units`` holds, at patch resolution, the unit id
of each patch or -1 for padding, and ``units_per_segment`` the real units of each image or tile. A selection is one
boolean per unit; ``PatchMap.apply`` turns it into pixels without touching padding, and never writes into its input.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .masking import black_pixel_values

LAYOUTS = ("grid_rows", "tile_rows", "tiles", "images", "sized_images")


@dataclass
class PatchMap:
    """The real patches of one batch's ``pixel_values`` (see the module docstring)."""

    layout: str
    patch_size: int
    units: torch.Tensor  # int64 at patch resolution; -1 = padding
    units_per_segment: torch.Tensor  # (n_segments,) real units of each image or tile
    segments_per_sample: list[int]  # how many images/tiles each sample owns (in order)
    sample_rows: list[tuple[int, int]]  # the dim-0 range of pixel_values (and aux tensors) of each sample
    expand: Callable[[torch.Tensor], torch.Tensor]  # patch-resolution bool -> bool broadcastable to pixel_values
    fill: torch.Tensor  # normalised black, broadcastable to pixel_values
    real_pixels: torch.Tensor  # bool broadcastable to pixel_values: pixels inside a real patch

    def sample_units(self) -> list[tuple[int, int]]:
        """The unit-id range of each sample (units are numbered sample by sample)."""
        per_sample = [int(c.sum()) for c in torch.split(self.units_per_segment, self.segments_per_sample)]
        ends = torch.tensor(per_sample, dtype=torch.long).cumsum(0).tolist()
        return [(end - n, end) for n, end in zip(per_sample, ends, strict=True)]

    def sample_segments(self, i: int) -> torch.Tensor:
        start = sum(self.segments_per_sample[:i])
        return self.units_per_segment[start : start + self.segments_per_sample[i]]

    def apply(self, pixel_values: torch.Tensor, selected_units: torch.Tensor) -> torch.Tensor:
        """Black out the units chosen by ``selected_units`` (one bool per unit of the batch); a new tensor."""
        total = int(self.units_per_segment.sum())
        if selected_units.shape != (total,):
            raise ValueError(f"selection of shape {tuple(selected_units.shape)} for {total} patches ({self.layout})")
        lookup = torch.cat([torch.zeros(1, dtype=torch.bool), selected_units.cpu().bool()])
        chosen = self.expand(lookup[self.units + 1]).to(pixel_values.device) & self.real_pixels
        return torch.where(chosen, self.fill.to(device=pixel_values.device, dtype=pixel_values.dtype), pixel_values)

    def apply_values(self, pixel_values: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
        """Black out single values chosen by ``coins`` (shape of ``pixel_values``) inside real patches only."""
        chosen = coins.to(pixel_values.device) & self.real_pixels
        return torch.where(chosen, self.fill.to(device=pixel_values.device, dtype=pixel_values.dtype), pixel_values)


def select_units(units_per_segment: torch.Tensor, ratio: float, generator: torch.Generator | None) -> torch.Tensor:
    """``round(ratio * n)`` of the ``n`` units of every segment, uniformly at random; one bool per unit."""
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


def _dense_units(real_patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit ids for a padded ``(segments, ...)`` bool grid of real patches, and the real count of each segment."""
    flat = real_patches.reshape(-1)
    ids = torch.where(flat, flat.long().cumsum(0) - 1, torch.full_like(flat, -1, dtype=torch.long))
    return ids.reshape(real_patches.shape), real_patches.reshape(len(real_patches), -1).sum(1)


def _pixel_grid(patch_mask: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """Patch-resolution ``(..., hp, wp)`` to pixel resolution ``(..., H, W)``; pixels past the last whole patch
    (which a stride-P patch embedding drops) are False."""
    full = patch_mask.repeat_interleave(patch_size, -2).repeat_interleave(patch_size, -1)
    pad = (0, width - full.shape[-1], 0, height - full.shape[-2])
    return torch.nn.functional.pad(full, pad, value=False)


def _ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    ends = torch.tensor([0, *counts]).cumsum(0).tolist()
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
    if "image_position_ids" not in has and "image_grid_thw" not in has and "spatial_shapes" not in has:
        if dim == 5 and "image_sizes" not in has:
            return "tiles"
        if dim == 4 and "image_sizes" in has:
            return "sized_images"
        if dim == 4 and "pixel_attention_mask" not in has:
            return "images"
    raise ValueError(
        f"mask_type: no patch layout matches this batch ({_describe(inputs)}); known layouts: {', '.join(LAYOUTS)} "
        "(papo_nb/papo/masking_layouts.py): this family's images cannot be masked yet, with any mask_type"
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


def patch_map(
    inputs: dict[str, Any],
    *,
    patch_size: int,
    image_mean: Sequence[float],
    image_std: Sequence[float],
    merge_size: int = 1,
) -> PatchMap:
    """The ``PatchMap`` of a batch. ``merge_size > 1`` (grid rows only) makes each 2x2 merge unit one unit."""
    layout = detect_layout(inputs)
    pv = inputs["pixel_values"]
    black = black_pixel_values(image_mean, image_std)
    channels = black.numel()
    if merge_size > 1 and layout != "grid_rows":
        raise ValueError(f"mask_type='merge_unit' needs the grid_rows (Qwen-VL) layout, this batch is {layout}")
    if layout == "grid_rows":
        grid = inputs["image_grid_thw"].long().cpu()
        rows_per_image = grid.prod(-1)
        rows_per_unit = merge_size**2
        if rows_per_image.sum() != pv.shape[0] or torch.any(rows_per_image % rows_per_unit):
            raise ValueError(f"image_grid_thw {grid.tolist()} does not cover pixel_values {tuple(pv.shape)}")
        num_images = inputs.get("num_images") or [1] * len(grid)
        units = torch.arange(pv.shape[0]) // rows_per_unit
        return PatchMap(
            layout,
            patch_size,
            units,
            rows_per_image // rows_per_unit,
            list(num_images),
            _ranges([int(rows_per_image[a:b].sum()) for a, b in _ranges(num_images)]),
            lambda m: m[:, None],
            black.repeat_interleave(pv.shape[1] // channels)[None, :],  # a row is (C, T, P, P)
            torch.ones(1, 1, dtype=torch.bool, device=pv.device),
        )
    if layout == "tile_rows":
        real = inputs["pixel_attention_mask"].bool().cpu()
        if real.shape != pv.shape[:2]:
            raise ValueError(f"pixel_attention_mask {tuple(real.shape)} does not fit pixel_values {tuple(pv.shape)}")
        num_tiles = inputs.get("num_tiles")
        if num_tiles is None:
            raise ValueError(f"the tile_rows layout needs num_tiles to find each sample's tiles ({_describe(inputs)})")
        units, per_tile = _dense_units(real)
        return PatchMap(
            layout,
            patch_size,
            units,
            per_tile,
            list(num_tiles),
            _ranges(num_tiles),
            lambda m: m[..., None],
            black.repeat(pv.shape[-1] // channels)[None, None, :],  # a row is (P, P, C): channel fastest
            real.to(pv.device)[..., None],
        )
    height, width = pv.shape[-2:]
    hp, wp = height // patch_size, width // patch_size
    fill = black[:, None, None]
    if layout == "tiles":
        batch, n_tiles = pv.shape[:2]
        pixel_mask = inputs.get("pixel_attention_mask")
        pixel_mask = torch.ones(pv.shape[:2] + pv.shape[-2:], dtype=torch.bool) if pixel_mask is None else pixel_mask
        pixel_mask = pixel_mask.bool().cpu()
        # The model drops all-zero tiles (padding) and counts a patch as real when any pixel is (idefics3:553-574).
        real_tile = (pv != 0).flatten(2).any(-1).cpu()
        blocks = pixel_mask[..., : hp * patch_size, : wp * patch_size].reshape(
            batch, n_tiles, hp, patch_size, wp, patch_size
        )
        real = blocks.any(-1).any(-2) & real_tile[..., None, None]
        units, per_tile = _dense_units(real.reshape(batch * n_tiles, hp, wp))
        units = units.reshape(batch, n_tiles, hp, wp)
        real_pixels = (pixel_mask & real_tile[..., None, None]).to(pv.device)[:, :, None]
        return PatchMap(
            layout,
            patch_size,
            units,
            per_tile,
            [n_tiles] * batch,
            _ranges([1] * batch),
            lambda m: _pixel_grid(m, patch_size, height, width)[:, :, None],
            fill,
            real_pixels,
        )
    per_sample = _per_sample(pv.shape[0], inputs)
    n_images = pv.shape[0]
    if layout == "sized_images":
        sizes = inputs["image_sizes"].long().cpu()
        if sizes.shape != (n_images, 2):
            raise ValueError(f"image_sizes {tuple(sizes.shape)} does not fit pixel_values {tuple(pv.shape)}")
        ys, xs = torch.arange(height), torch.arange(width)
        pixel_real = (ys[None, :, None] < sizes[:, 0, None, None]) & (xs[None, None, :] < sizes[:, 1, None, None])
    else:
        pixel_real = torch.ones(n_images, height, width, dtype=torch.bool)
    real = pixel_real[:, : hp * patch_size, : wp * patch_size].reshape(n_images, hp, patch_size, wp, patch_size)
    units, per_image = _dense_units(real.any(-1).any(-2))
    return PatchMap(
        layout,
        patch_size,
        units,
        per_image,
        per_sample,
        _ranges(per_sample),
        lambda m: _pixel_grid(m, patch_size, height, width)[:, None],
        fill,
        pixel_real.to(pv.device)[:, None],
    )


# Tensors that are indexed like pixel_values along dim 0 (same images/tiles), hashed with a sample's pixels.
_ROW_ALIGNED = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (where it lives): equal exactly when the bytes are."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def sample_keys(inputs: dict[str, Any], patches: PatchMap) -> list[str]:
    """One key per completion, equal exactly when two completions share their prompt tokens and their images (the
    pixels and every tensor aligned with them). TRL 1.9.1 shuffles rollouts across device batches
    (grpo_trainer.py:1576-1577), so a prompt's rollouts are found by their content.

    A key is a hash of the sample's bytes; a sample byte-equal to an earlier one of the batch (the other rollouts of
    its prompt) takes that one's key without hashing (``torch.equal`` where the tensors live, no host copy)."""
    keys = []
    grid_rows = patches.layout == "grid_rows"
    image_ranges = _ranges(patches.segments_per_sample) if grid_rows else patches.sample_rows
    hashed: dict[tuple, list[tuple[list[torch.Tensor], str]]] = {}  # tokens and shapes -> (raw parts, key)
    for i, (start, end) in enumerate(patches.sample_rows):
        tokens = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()]
        named = []
        for name in _ROW_ALIGNED:
            value = inputs.get(name)
            if isinstance(value, torch.Tensor):
                a, b = image_ranges[i] if grid_rows and name == "image_grid_thw" else (start, end)
                named.append((name, value[a:b]))
        raw = [_raw(part) for _, part in named]
        signature = (tuple(tokens.tolist()), tuple((name, part.dtype, tuple(part.shape)) for name, part in named))
        same = (key for earlier, key in hashed.get(signature, []) if all(map(torch.equal, raw, earlier)))
        key = next(same, None)
        if key is None:
            digest = hashlib.blake2b(digest_size=16)
            digest.update(patches.layout.encode())
            digest.update(_raw(tokens).cpu().numpy().tobytes())
            for (name, _), part in zip(named, raw, strict=True):
                digest.update(name.encode() + part.cpu().numpy().tobytes())
            key = digest.hexdigest()
            hashed.setdefault(signature, []).append((raw, key))
        keys.append(key)
    return keys
