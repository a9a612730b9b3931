"""The official PAPO mask on raw images: 14x14-pixel squares blacked out before the processor runs.

Training masks ``pixel_values`` (``papo_nb.papo.masking``); this raw-image form is what evaluation uses, where
the images are still PIL images.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image


def square_mask(height: int, width: int, ratio: float, *, square: int = 14, seed: int | None = None) -> np.ndarray:
    """The official PAPO mask of a ``height`` x ``width`` raw image, a bool per pixel (True: blacked out): each
    ``square``x``square`` block is masked independently with probability ``ratio``."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio!r}")
    grid_h, grid_w = -(-height // square), -(-width // square)
    blocks = np.random.default_rng(seed).random((grid_h, grid_w)) < ratio
    return np.kron(blocks, np.ones((square, square), dtype=bool))[:height, :width]


def mask_pil_squares(image: Image.Image, ratio: float, *, square: int = 14, seed: int | None = None) -> Image.Image:
    """The official PAPO mask (``square_mask``) applied to the raw image before any processor runs: a new image."""
    pixels = np.array(image.convert("RGB"))
    keep = ~square_mask(*pixels.shape[:2], ratio, square=square, seed=seed)
    return Image.fromarray(pixels * keep[..., None].astype(pixels.dtype))


def image_mask_seed(seed: int, row: int, image: int | None = None) -> int:
    """The seed of an evaluation mask: ``seed + row`` for a row's single image, ``seed + 1000 * row + image`` for
    image ``image`` of a row's list, so every image keeps one fixed mask."""
    return seed + row if image is None else seed + 1000 * row + image


def mask_images(images: list, mask_ratio: float, seed: int) -> list:
    """Each row's image (or list of images) masked the official way (14-px squares), one fixed mask per image
    (``image_mask_seed``)."""
    return [
        [mask_pil_squares(im, mask_ratio, seed=image_mask_seed(seed, i, j)) for j, im in enumerate(img)]
        if isinstance(img, list)
        else mask_pil_squares(img, mask_ratio, seed=image_mask_seed(seed, i))
        for i, img in enumerate(images)
    ]


def reprocess_masked_images(
    images: Sequence[Image.Image], image_processor, ratio: float, *, square: int = 14, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Mask raw images with :func:`mask_pil_squares` and run them through ``image_processor``."""
    masked = [mask_pil_squares(img, ratio, square=square, seed=seed + i) for i, img in enumerate(images)]
    return dict(image_processor(images=masked, return_tensors="pt"))
