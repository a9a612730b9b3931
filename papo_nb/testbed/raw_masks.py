"""The official PAPO mask on raw images: 14x14-pixel squares blacked out before the processor runs.

Training masks ``pixel_values`` (``papo_nb.papo.masking``); this raw-image form is what evaluation uses, where
the images are still PIL images.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image


def mask_pil_squares(image: Image.Image, ratio: float, *, square: int = 14, seed: int | None = None) -> Image.Image:
    """The official PAPO mask: each ``square``x``square`` block of the raw image is blacked out
    independently with probability ``ratio``, before any processor runs. Returns a new image."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mask ratio must be in [0, 1], got {ratio!r}")
    pixels = np.array(image.convert("RGB"))
    height, width = pixels.shape[:2]
    grid_h, grid_w = -(-height // square), -(-width // square)
    blocks = np.random.default_rng(seed).random((grid_h, grid_w)) < ratio
    keep = ~np.kron(blocks, np.ones((square, square), dtype=bool))[:height, :width]
    return Image.fromarray(pixels * keep[..., None].astype(pixels.dtype))


def reprocess_masked_images(
    images: Sequence[Image.Image], image_processor, ratio: float, *, square: int = 14, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Mask raw images with :func:`mask_pil_squares` and run them through ``image_processor``."""
    masked = [mask_pil_squares(img, ratio, square=square, seed=seed + i) for i, img in enumerate(images)]
    return dict(image_processor(images=masked, return_tensors="pt"))
