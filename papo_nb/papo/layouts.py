"""Where the real patches of a batch are: the image layout, detected from the batch's keys and shapes, and the
``PatchMap`` that numbers its real patches (or merge units).

TRL 1.9.1 forwards whatever the processor returns (grpo_trainer.py#L2436-L2490) and slices it per sample in
``_get_per_token_logps_and_entropies`` (#L1466-L1497), both under
https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py. The layouts, and the families that produce
them in transformers 5.24:

- ``grid_rows``: 2-D patch rows ``(sum t*h*w, C*T*P*P)`` + ``image_grid_thw`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
  GLM-4V); the 4 patches of a 2x2 merge unit are consecutive rows.
- ``tile_rows``: ``(tiles, max_patches, P*P*C)`` channel-last rows + ``pixel_attention_mask`` (real patches) +
  ``spatial_shapes`` + ``num_tiles`` (LFM2-VL).
- ``tiles``: 5-D ``(B, N, C, H, W)`` + ``pixel_attention_mask`` ``(B, N, H, W)``; padded tiles are all-zero pixels
  (Idefics3, SmolVLM). A patch is real when any of its pixels is, the model's own rule:
  https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/models/idefics3/modeling_idefics3.py#L553-L574
- ``images``: 4-D ``(n_images, C, H, W)``, every pixel real (Gemma3 with ``token_type_ids``, LLaVA, PaliGemma).
- ``sized_images``: 4-D ``(n_images, C, Hmax, Wmax)`` + ``image_sizes``; the image sits top-left, the rest is padding
  (Pixtral, Mistral3).
- ``crops``: 5-D ``(n_images, max_entries, C, H, W)`` + ``image_sizes`` (LLaVA-NeXT, LLaVA-OneVision): each image's
  base view then its any-resolution crops; the list is padded with all-zero entries, which are never masked. Inside an
  entry the processor pads with a uniform fill (the letterbox of a crop is black, OneVision's square padding the mean
  colour): a patch of one uniform fill colour is padding, not a unit (blacking a black patch changes nothing anyway).
- ``position_rows``: ``(n_images, max_patches, P*P*C)`` channel-last rows + ``image_position_ids`` (Gemma4); padded
  rows have position -1.

Anything else is refused with the keys and shapes seen.

A ``PatchMap`` numbers the real patches (or merge units) of a batch: ``units`` holds, at patch resolution, the unit id
of each patch or -1 for padding, and ``units_per_segment`` the real units of each image or tile. Its ``fill`` is black
*after normalisation*, ``(0 - mean) / std`` per channel, not 0, which is the channel mean (upstream defect 2).
Choosing units and blacking them out is ``masking.py``'s; which rows are one prompt is ``prompt_identity.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..prefix_sharing.image_rows import SampleRows, sample_structure


def black_pixel_values(image_mean: Sequence[float], image_std: Sequence[float]) -> torch.Tensor:
    """Per-channel value of a black pixel after the processor's rescale-to-[0,1] and normalise."""
    mean = torch.as_tensor(image_mean, dtype=torch.float64)
    std = torch.as_tensor(image_std, dtype=torch.float64)
    return ((0.0 - mean) / std).to(torch.float32)


@dataclass(frozen=True, kw_only=True)
class PatchMap:
    """The real patches of one batch's ``pixel_values`` (see the module docstring); ``masking.apply_units`` turns a
    selection of its units into pixels without touching padding."""

    rows: SampleRows  # the layout, and where each sample's images are (``image_rows.sample_structure``)
    patch_size: int
    units: torch.Tensor  # int64 at patch resolution; -1 = padding
    units_per_segment: torch.Tensor  # (n_segments,) real units of each image or tile
    pixel_units: torch.Tensor  # ``units`` at pixel resolution, broadcastable to pixel_values; -1 = padding
    fill: torch.Tensor  # normalised black, broadcastable to pixel_values
    real_pixels: torch.Tensor  # bool broadcastable to pixel_values: pixels inside a real patch

    # Read per sample by the masking and the prompt identity: kept here so that neither re-derives the layout.
    layout: str = field(init=False)
    segments_per_sample: list[int] = field(init=False)  # how many images/tiles each sample owns (in order)
    sample_rows: list[tuple[int, int]] = field(init=False)  # the dim-0 range of pixel_values (and aux tensors)
    image_rows: list[tuple[int, int]] = field(init=False)  # each sample's rows of image_grid_thw (else its images)
    sample_units: list[torch.Tensor] = field(init=False)  # the real units of each sample's images or tiles

    def __post_init__(self):
        for name in ("layout", "segments_per_sample", "sample_rows", "image_rows"):
            object.__setattr__(self, name, getattr(self.rows, name))
        ranges = self.rows.segment_ranges
        object.__setattr__(self, "sample_units", [self.units_per_segment[a:b] for a, b in ranges])


def _dense_units(real_patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit ids for a padded ``(segments, ...)`` bool grid of real patches, and the real count of each segment."""
    flat = real_patches.reshape(-1)
    ids = torch.where(flat, flat.long().cumsum(0) - 1, torch.full_like(flat, -1, dtype=torch.long))
    return ids.reshape(real_patches.shape), real_patches.reshape(len(real_patches), -1).sum(1)


def _pixel_grid(per_patch: torch.Tensor, patch_size: int, height: int, width: int, pad_value=False) -> torch.Tensor:
    """Patch-resolution ``(..., hp, wp)`` to pixel resolution ``(..., H, W)``; pixels past the last whole patch
    (which a stride-P patch embedding drops) take ``pad_value``."""
    full = per_patch.repeat_interleave(patch_size, -2).repeat_interleave(patch_size, -1)
    pad = (0, width - full.shape[-1], 0, height - full.shape[-2])
    return torch.nn.functional.pad(full, pad, value=pad_value)


# One builder per layout: (inputs, its SampleRows, patch_size, black per channel, merge_size) -> PatchMap.


def _grid_rows_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, merge_size: int) -> PatchMap:
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"].long().cpu()
    rows_per_image, rows_per_unit = grid.prod(-1), merge_size**2
    if rows_per_image.sum() != pv.shape[0] or torch.any(rows_per_image % rows_per_unit):
        raise ValueError(f"image_grid_thw {grid.tolist()} does not cover pixel_values {tuple(pv.shape)}")
    units = torch.arange(pv.shape[0]) // rows_per_unit
    return PatchMap(
        rows=rows,
        patch_size=patch_size,
        units=units,
        units_per_segment=rows_per_image // rows_per_unit,
        pixel_units=units[:, None],
        fill=black.repeat_interleave(pv.shape[1] // black.numel())[None, :],  # a row is (C, T, P, P)
        real_pixels=torch.ones(1, 1, dtype=torch.bool, device=pv.device),
    )


def _tile_rows_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, merge_size: int) -> PatchMap:
    return _channel_last_rows_map(inputs, rows, patch_size, black, inputs["pixel_attention_mask"].bool().cpu())


def _position_rows_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, merge_size: int) -> PatchMap:
    positions = inputs["image_position_ids"]
    if positions.dim() != 3 or positions.shape[-1] != 2:
        raise ValueError(f"image_position_ids {tuple(positions.shape)} is not (n_images, max_patches, 2)")
    return _channel_last_rows_map(inputs, rows, patch_size, black, (positions >= 0).all(-1).cpu())


def _channel_last_rows_map(
    inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, real: torch.Tensor
) -> PatchMap:
    """``tile_rows`` and ``position_rows``: one patch per row of ``(segments, max_patches, P*P*C)``, real where
    ``real`` ``(segments, max_patches)`` says."""
    pv = inputs["pixel_values"]
    if real.shape != pv.shape[:2]:
        raise ValueError(f"the real-patch mask {tuple(real.shape)} does not fit pixel_values {tuple(pv.shape)}")
    units, per_segment = _dense_units(real)
    return PatchMap(
        rows=rows,
        patch_size=patch_size,
        units=units,
        units_per_segment=per_segment,
        pixel_units=units[..., None],
        fill=black.repeat(pv.shape[-1] // black.numel())[None, None, :],  # a row is (P, P, C): channel fastest
        real_pixels=real.to(pv.device)[..., None],
    )


def _tiles_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, merge_size: int) -> PatchMap:
    pv = inputs["pixel_values"]
    hp, wp = pv.shape[-2] // patch_size, pv.shape[-1] // patch_size
    pixel_mask = inputs.get("pixel_attention_mask")
    pixel_mask = torch.ones(pv.shape[:2] + pv.shape[-2:], dtype=torch.bool) if pixel_mask is None else pixel_mask
    # The model drops all-zero tiles (padding) and counts a patch as real when any of its pixels is.
    pixel_mask = pixel_mask.bool().cpu() & (pv != 0).flatten(2).any(-1).cpu()[..., None, None]
    blocks = pixel_mask[..., : hp * patch_size, : wp * patch_size].unflatten(-1, (wp, patch_size))
    real = blocks.unflatten(-3, (hp, patch_size)).any(-1).any(-2)
    return _entries_map(inputs, rows, patch_size, black, real, pixel_mask)


def padding_fills(image_mean: Sequence[float], image_std: Sequence[float]) -> torch.Tensor:
    """``(2, C)``: the uniform colours the any-resolution processors pad with, normalised: black (LLaVA-NeXT's
    letterbox pads with 0 before normalising) and the mean colour as 8-bit (LLaVA-OneVision's ``pad_to_square``)."""
    mean = torch.as_tensor(image_mean, dtype=torch.float64)
    std = torch.as_tensor(image_std, dtype=torch.float64)
    return torch.stack([-mean / std, (torch.floor(mean * 255) / 255 - mean) / std]).to(torch.float32)


def _crops_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, fills: torch.Tensor) -> PatchMap:
    pv = inputs["pixel_values"]
    if inputs["image_sizes"].shape != (pv.shape[0], 2):
        raise ValueError(
            f"image_sizes {tuple(inputs['image_sizes'].shape)} does not fit pixel_values {tuple(pv.shape)}"
        )
    real_entry = (pv != 0).flatten(2).any(-1).cpu()
    if torch.any(real_entry[:, 1:] & ~real_entry[:, :-1]):
        raise ValueError(f"an all-zero entry precedes a real one in pixel_values {tuple(pv.shape)}: not list padding")
    hp, wp = pv.shape[-2] // patch_size, pv.shape[-1] // patch_size
    blocks = pv[..., : hp * patch_size, : wp * patch_size].unflatten(-1, (wp, patch_size))
    blocks = blocks.unflatten(-3, (hp, patch_size)).detach().float().cpu()  # (n, N, C, hp, P, wp, P)
    colour = blocks[..., 0, :, 0]  # (n, N, C, hp, wp)
    uniform = (blocks.amax((-3, -1)) == blocks.amin((-3, -1))).all(2)
    tolerance = 1e-4 + 2 * torch.finfo(pv.dtype).eps * fills.abs()  # the processor's float rounding, bf16's if cast
    is_fill = ((colour[..., None, :, :, :] - fills[:, :, None, None]).abs() <= tolerance[:, :, None, None]).all(-3)
    real = real_entry[..., None, None] & ~(uniform & is_fill.any(-3))
    pixel_real = _pixel_grid(real, patch_size, *pv.shape[-2:])
    return _entries_map(inputs, rows, patch_size, black, real, pixel_real)


def _entries_map(
    inputs, rows: SampleRows, patch_size: int, black, real: torch.Tensor, pixel_real: torch.Tensor
) -> PatchMap:
    """``tiles`` and ``crops``: 5-D ``(rows, entries, C, H, W)``, real patches ``real`` ``(rows, entries, hp, wp)``
    and real pixels ``pixel_real`` ``(rows, entries, H, W)``; each entry is a segment."""
    pv = inputs["pixel_values"]
    (n_rows, entries), (height, width) = pv.shape[:2], pv.shape[-2:]
    units, per_entry = _dense_units(real.reshape(n_rows * entries, *real.shape[-2:]))
    return PatchMap(
        rows=rows,
        patch_size=patch_size,
        units=units.reshape(real.shape),
        units_per_segment=per_entry,
        pixel_units=_pixel_grid(units.reshape(real.shape), patch_size, height, width, -1)[:, :, None],
        fill=black[:, None, None],
        real_pixels=pixel_real.to(pv.device)[:, :, None],
    )


def _whole_images_map(
    inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, pixel_real: torch.Tensor
) -> PatchMap:
    """``images`` and ``sized_images``: one image per dim-0 row, real where ``pixel_real`` (n, H, W) says."""
    pv = inputs["pixel_values"]
    n_images, (height, width) = pv.shape[0], pv.shape[-2:]
    hp, wp = height // patch_size, width // patch_size
    real = pixel_real[:, : hp * patch_size, : wp * patch_size].reshape(n_images, hp, patch_size, wp, patch_size)
    units, per_image = _dense_units(real.any(-1).any(-2))
    return PatchMap(
        rows=rows,
        patch_size=patch_size,
        units=units,
        units_per_segment=per_image,
        pixel_units=_pixel_grid(units, patch_size, height, width, -1)[:, None],
        fill=black[:, None, None],
        real_pixels=pixel_real.to(pv.device)[:, None],
    )


def _images_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, merge_size: int) -> PatchMap:
    pv = inputs["pixel_values"]
    every_pixel = torch.ones(pv.shape[0], *pv.shape[-2:], dtype=torch.bool)
    return _whole_images_map(inputs, rows, patch_size, black, every_pixel)


def _sized_images_map(inputs, rows: SampleRows, patch_size: int, black: torch.Tensor, merge_size: int) -> PatchMap:
    pv, sizes = inputs["pixel_values"], inputs["image_sizes"].long().cpu()
    if sizes.shape != (pv.shape[0], 2):
        raise ValueError(f"image_sizes {tuple(sizes.shape)} does not fit pixel_values {tuple(pv.shape)}")
    ys, xs = torch.arange(pv.shape[-2]), torch.arange(pv.shape[-1])
    top_left = (ys[None, :, None] < sizes[:, 0, None, None]) & (xs[None, None, :] < sizes[:, 1, None, None])
    return _whole_images_map(inputs, rows, patch_size, black, top_left)


PATCH_MAP_BUILDERS: dict[str, Callable[..., PatchMap]] = {
    "grid_rows": _grid_rows_map,
    "tile_rows": _tile_rows_map,
    "tiles": _tiles_map,
    "images": _images_map,
    "sized_images": _sized_images_map,
    "position_rows": _position_rows_map,
}


def patch_map(
    inputs: dict[str, Any],
    *,
    patch_size: int,
    image_mean: Sequence[float],
    image_std: Sequence[float],
    merge_size: int = 1,
) -> PatchMap:
    """The ``PatchMap`` of a batch. ``merge_size > 1`` (grid rows only) makes each 2x2 merge unit one unit."""
    rows = sample_structure(inputs)
    layout = rows.layout
    if merge_size > 1 and layout != "grid_rows":
        raise ValueError(f"mask_type='merge_unit' needs the grid_rows (Qwen-VL) layout, this batch is {layout}")
    black = black_pixel_values(image_mean, image_std)
    if layout == "crops":  # its padding is found by the processors' fill colours
        return _crops_map(inputs, rows, patch_size, black, padding_fills(image_mean, image_std))
    return PATCH_MAP_BUILDERS[layout](inputs, rows, patch_size, black, merge_size)
