"""Image masks for PAPO's masked branch.

Every function here is vectorised, draws its randomness from an explicit ``torch.Generator``
(or a seed), and returns new tensors: it never writes into its input (upstream defect 3).
Masked pixels are set to *black after normalisation*, ``(0 - mean) / std`` per channel,
not to 0, which is the channel mean (upstream defect 2).

Qwen2-VL / Qwen2.5-VL ``pixel_values`` are 2-D, ``(sum_i t_i*h_i*w_i, C*T*P*P)``: one row per
14x14 patch, with the 4 patches of each 2x2 merge unit on consecutive rows. The upstream trainer
only handled 4-D/5-D tensors and left these unchanged (defect 1); patch masking works on rows.
The trainer masks every family's layout (Qwen-VL rows included) through ``masking_layouts``, which builds on
``black_pixel_values`` here; the row helpers below remain for the Qwen-only tools (shared prefix, benchmarks).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import torch

MaskUnit = Literal["patch", "merge_unit"]


def black_pixel_values(image_mean: Sequence[float], image_std: Sequence[float]) -> torch.Tensor:
    """Per-channel value of a black pixel after the processor's rescale-to-[0,1] and normalise."""
    mean = torch.as_tensor(image_mean, dtype=torch.float64)
    std = torch.as_tensor(image_std, dtype=torch.float64)
    return ((0.0 - mean) / std).to(torch.float32)


def _rank_within_segments(segment_ids: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A uniformly random rank 0..n_s-1 for each element of each segment (segments sorted, contiguous)."""
    noise = torch.rand(segment_ids.shape, generator=generator, dtype=torch.float64)
    order = torch.argsort(segment_ids.double() + noise)  # groups by segment, random order inside
    counts = torch.bincount(segment_ids)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel())
    return ranks - starts[segment_ids]


def select_patch_rows(
    image_grid_thw: torch.Tensor,
    ratio: float,
    *,
    unit: MaskUnit = "patch",
    merge_size: int = 2,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Boolean row mask choosing ``round(ratio * n_units)`` whole units per image.

    An exact count per image (rather than an independent coin per unit) guarantees that every
    image is perturbed the same amount, which keeps the perception KL comparable across batches.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio!r}")
    rows_per_image = image_grid_thw.prod(dim=-1).long().cpu()
    rows_per_unit = merge_size**2 if unit == "merge_unit" else 1
    if unit not in ("patch", "merge_unit"):
        raise ValueError(f"mask unit must be 'patch' or 'merge_unit', got {unit!r}")
    if torch.any(rows_per_image % rows_per_unit):
        raise ValueError(f"image_grid_thw {image_grid_thw.tolist()} is not divisible into {unit}s")
    units_per_image = rows_per_image // rows_per_unit
    image_of_unit = torch.repeat_interleave(torch.arange(len(units_per_image)), units_per_image)
    rank = _rank_within_segments(image_of_unit, generator)
    n_masked = torch.round(units_per_image.double() * ratio).long()
    unit_mask = rank < n_masked[image_of_unit]
    return unit_mask.repeat_interleave(rows_per_unit)


def mask_patches(
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    ratio: float,
    *,
    image_mean: Sequence[float],
    image_std: Sequence[float],
    unit: MaskUnit = "patch",
    merge_size: int = 2,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Black out whole patches (or 2x2 merge units) of flattened Qwen-VL pixel_values."""
    if pixel_values.dim() != 2:
        raise ValueError(
            f"patch masking expects 2-D (n_patches, C*T*P*P) pixel_values, got {tuple(pixel_values.shape)}"
        )
    rows = select_patch_rows(image_grid_thw, ratio, unit=unit, merge_size=merge_size, generator=generator)
    if rows.numel() != pixel_values.shape[0]:
        raise ValueError(f"image_grid_thw covers {rows.numel()} rows but pixel_values has {pixel_values.shape[0]}")
    black = black_pixel_values(image_mean, image_std)
    black_row = black.repeat_interleave(pixel_values.shape[1] // black.numel())
    black_row = black_row.to(device=pixel_values.device, dtype=pixel_values.dtype)
    return torch.where(rows.to(pixel_values.device)[:, None], black_row, pixel_values)


def mask_random_elements(
    pixel_values: torch.Tensor,
    ratio: float,
    *,
    image_mean: Sequence[float],
    image_std: Sequence[float],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Black out individual pixel values independently with probability ``ratio``.

    Works on Qwen's 2-D layout (channel is the slowest axis of each row) and on 4-D/5-D
    ``(..., C, H, W)`` layouts.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio!r}")
    black = black_pixel_values(image_mean, image_std).to(device=pixel_values.device, dtype=pixel_values.dtype)
    channels = black.numel()
    if pixel_values.dim() == 2:
        fill = black.repeat_interleave(pixel_values.shape[1] // channels)[None, :]
    elif pixel_values.dim() in (4, 5) and pixel_values.shape[-3] == channels:
        fill = black[:, None, None]
    else:
        raise ValueError(
            f"cannot find the {channels} colour channels in pixel_values of shape {tuple(pixel_values.shape)}"
        )
    coins = torch.rand(pixel_values.shape, generator=generator, device="cpu") < ratio
    return torch.where(coins.to(pixel_values.device), fill, pixel_values)


def sample_row_ranges(image_grid_thw: torch.Tensor, num_images: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` rows of each sample's images in flattened Qwen-VL ``pixel_values`` (TRL's ``num_images``
    lists how many images each sample has, in order)."""
    rows = image_grid_thw.prod(dim=-1).long().cpu().tolist()
    ranges, image, row = [], 0, 0
    for count in num_images:
        n = sum(rows[image : image + count])
        ranges.append((row, row + n))
        image, row = image + count, row + n
    return ranges


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def prompt_keys(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    num_images: Sequence[int],
) -> list[str]:
    """One key per completion, equal exactly when two completions share their prompt tokens and their images.

    TRL 1.9.1 shuffles a generation batch before splitting it into device batches (grpo_trainer.py:1576-1577), so
    the rollouts of one prompt are neither adjacent nor all in the same batch; their content is what they share."""
    keys = []
    image_offsets = [0]
    for count in num_images:
        image_offsets.append(image_offsets[-1] + count)
    for i, (start, end) in enumerate(sample_row_ranges(image_grid_thw, num_images)):
        digest = hashlib.blake2b(digest_size=16)
        digest.update(_tensor_bytes(prompt_ids[i][prompt_mask[i].bool()]))
        digest.update(_tensor_bytes(image_grid_thw[image_offsets[i] : image_offsets[i + 1]]))
        digest.update(_tensor_bytes(pixel_values[start:end]))
        keys.append(digest.hexdigest())
    return keys


def apply_mask(
    pixel_values: torch.Tensor,
    selected: torch.Tensor,
    *,
    image_mean: Sequence[float],
    image_std: Sequence[float],
) -> torch.Tensor:
    """Black out the rows (1-D ``selected``: whole patches) or values (2-D ``selected``) of 2-D Qwen-VL
    ``pixel_values`` chosen by ``selected``; returns a new tensor."""
    if pixel_values.dim() != 2:
        raise ValueError(f"apply_mask expects 2-D (n_patches, C*T*P*P) pixel_values, got {tuple(pixel_values.shape)}")
    if selected.shape[0] != pixel_values.shape[0] or (selected.dim() == 2 and selected.shape != pixel_values.shape):
        raise ValueError(
            f"mask of shape {tuple(selected.shape)} does not fit pixel_values {tuple(pixel_values.shape)}"
        )
    black = black_pixel_values(image_mean, image_std)
    black_row = black.repeat_interleave(pixel_values.shape[1] // black.numel())
    black_row = black_row.to(device=pixel_values.device, dtype=pixel_values.dtype)[None, :]
    selected = selected.to(pixel_values.device)
    return torch.where(selected[:, None] if selected.dim() == 1 else selected, black_row, pixel_values)
