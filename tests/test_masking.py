"""Masking really changes Qwen's 2-D pixel_values, to black, without touching its input."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor

from papo_nb.papo import masking
from papo_nb.testbed import raw_masks


@pytest.fixture(scope="module")
def processed():
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(1, 255, (112, 112, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(1, 255, (56, 56, 3), dtype=np.uint8)),
    ]
    out = processor(images=images, return_tensors="pt")
    return processor, out["pixel_values"], out["image_grid_thw"]


def _stats(processor):
    return dict(image_mean=processor.image_mean, image_std=processor.image_std)


def test_patch_mask_changes_2d_qwen_pixel_values_to_black(processed):
    processor, pixel_values, grid = processed
    assert pixel_values.dim() == 2 and grid.tolist() == [[1, 8, 8], [1, 4, 4]]
    original = pixel_values.clone()
    masked = masking.mask_patches(
        pixel_values, grid, 0.6, generator=torch.Generator().manual_seed(0), **_stats(processor)
    )
    assert torch.equal(pixel_values, original), "input was modified"
    changed = (masked != pixel_values).any(dim=1)
    assert changed[:64].sum().item() == round(0.6 * 64) and changed[64:].sum().item() == round(0.6 * 16)
    black = masking.black_pixel_values(processor.image_mean, processor.image_std)
    expected_row = black.repeat_interleave(pixel_values.shape[1] // 3)
    assert torch.allclose(masked[changed], expected_row.expand(int(changed.sum()), -1))
    assert torch.equal(masked[~changed], pixel_values[~changed])


def test_black_value_matches_processing_a_black_image():
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    row = processor(images=[Image.new("RGB", (56, 56))], return_tensors="pt")["pixel_values"][0]
    per_channel = row.view(3, -1)
    assert torch.allclose(
        per_channel, masking.black_pixel_values(processor.image_mean, processor.image_std)[:, None], atol=1e-6
    )


def test_merge_unit_mask_takes_whole_units(processed):
    processor, pixel_values, grid = processed
    masked = masking.mask_patches(
        pixel_values, grid, 0.5, unit="merge_unit", generator=torch.Generator().manual_seed(1), **_stats(processor)
    )
    changed = (masked != pixel_values).any(dim=1).view(-1, 4)
    assert torch.all(changed.all(1) | ~changed.any(1))
    assert changed.all(1).sum().item() == 8 + 2


def test_masks_are_seeded_and_reproducible(processed):
    processor, pixel_values, grid = processed
    run = lambda seed: masking.mask_patches(
        pixel_values, grid, 0.6, generator=torch.Generator().manual_seed(seed), **_stats(processor)
    )  # noqa: E731
    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_random_element_mask(processed):
    processor, pixel_values, grid = processed
    original = pixel_values.clone()
    masked = masking.mask_random_elements(
        pixel_values, 0.6, generator=torch.Generator().manual_seed(0), **_stats(processor)
    )
    assert torch.equal(pixel_values, original)
    fraction = (masked != pixel_values).float().mean().item()
    assert 0.55 < fraction < 0.65
    black = masking.black_pixel_values(processor.image_mean, processor.image_std)
    channel_of_column = torch.arange(pixel_values.shape[1]) // (pixel_values.shape[1] // 3)
    changed = masked != pixel_values
    assert torch.allclose(masked[changed], black[channel_of_column.expand_as(masked)[changed]])
    four_d = torch.randn(2, 3, 8, 8)
    masked_4d = masking.mask_random_elements(four_d, 1.0, **_stats(processor))
    assert torch.allclose(masked_4d, black[None, :, None, None].expand_as(four_d))


def test_pil_square_mask_and_reprocessing():
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    image = Image.new("RGB", (112, 112), (200, 100, 50))
    masked = raw_masks.mask_pil_squares(image, 0.6, seed=0)
    pixels = np.array(masked).reshape(8, 14, 8, 14, 3)
    black_squares = (pixels == 0).all(axis=(1, 3, 4))
    untouched = (pixels == (200, 100, 50)).all(axis=(1, 3, 4))
    assert np.all(black_squares | untouched) and 0 < black_squares.sum() < 64
    assert np.array(image).min() > 0, "input image was modified"
    out = raw_masks.reprocess_masked_images([image], processor, 0.6)
    reference = processor(images=[image], return_tensors="pt")["pixel_values"]
    assert out["pixel_values"].shape == reference.shape and not torch.equal(out["pixel_values"], reference)


@pytest.mark.parametrize("ratio", [-0.1, 1.5])
def test_bad_ratio_is_refused(processed, ratio):
    processor, pixel_values, grid = processed
    with pytest.raises(ValueError, match="mask ratio"):
        masking.mask_patches(pixel_values, grid, ratio, **_stats(processor))


def test_apply_mask_blackens_rows_or_values_and_checks_the_shape(processed):
    processor, pixel_values, grid = processed
    rows = torch.zeros(pixel_values.shape[0], dtype=torch.bool)
    rows[:3] = True
    out = masking.apply_mask(pixel_values, rows, **_stats(processor))
    black = masking.black_pixel_values(processor.image_mean, processor.image_std)
    assert torch.allclose(out[:3, 0], black[0].expand(3)) and torch.equal(out[3:], pixel_values[3:])
    values = torch.zeros(pixel_values.shape, dtype=torch.bool)
    values[5, 7] = True
    assert (masking.apply_mask(pixel_values, values, **_stats(processor)) != pixel_values).sum() <= 1
    with pytest.raises(ValueError, match="does not fit"):
        masking.apply_mask(pixel_values, rows[:-1], **_stats(processor))


def test_prompt_keys_match_exactly_equal_prompts_and_images(processed):
    _, pixel_values, grid = processed
    n0 = int(grid[0].prod())
    pv = torch.cat([pixel_values, pixel_values[:n0]])  # images: A, B, A again
    grids = torch.cat([grid, grid[:1]])
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])  # third: same tokens after padding? no: an extra 0
    keys = masking.prompt_keys(ids, mask, pv, grids, [1, 1, 1])
    assert keys[0] != keys[1], "different images"
    assert keys[0] != keys[2], "same image but a different prompt (the unpadded tokens differ)"
    same = masking.prompt_keys(ids, torch.tensor([[0, 1, 1]] * 3), pv, grids, [1, 1, 1])
    assert same[0] == same[2] != same[1]
    assert masking.sample_row_ranges(grids, [1, 1, 1])[2] == (pv.shape[0] - n0, pv.shape[0])
