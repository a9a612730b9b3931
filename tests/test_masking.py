"""The trainer's masking on Qwen's 2-D pixel_values (``layouts.patch_map``, ``masking.select_units``,
``masking.apply_units``): whole patches turn black after normalisation, the input is never written; a prompt's
identity finds its rollouts.

The other layouts, on each family's real processor, are in test_families.py."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor

from papo_nb.papo import layouts, masking, prompt_identity
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


def _batch(pixel_values, grid, num_images=(1, 1)):
    """A two-sample grid_rows batch, one image each, as TRL's ``_compute_loss`` receives it."""
    n = len(num_images)
    return {
        "prompt_ids": torch.tensor([[0, 5, 6]] * n),
        "prompt_mask": torch.ones(n, 3, dtype=torch.long),
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
        "num_images": list(num_images),
    }


def _mask(processor, pixel_values, grid, ratio, seed=0, merge_size=1):
    patches = layouts.patch_map(_batch(pixel_values, grid), patch_size=14, merge_size=merge_size, **_stats(processor))
    chosen = masking.select_units(patches.units_per_segment, ratio, torch.Generator().manual_seed(seed))
    return patches, masking.apply_units(patches, pixel_values, chosen)


def test_patch_mask_changes_2d_qwen_pixel_values_to_black(processed):
    processor, pixel_values, grid = processed
    assert pixel_values.dim() == 2 and grid.tolist() == [[1, 8, 8], [1, 4, 4]]
    original = pixel_values.clone()
    patches, masked = _mask(processor, pixel_values, grid, 0.6)
    assert patches.layout == "grid_rows" and patches.sample_rows == [(0, 64), (64, 80)]
    assert torch.equal(pixel_values, original), "input was modified"
    changed = (masked != pixel_values).any(dim=1)
    assert changed[:64].sum().item() == round(0.6 * 64) and changed[64:].sum().item() == round(0.6 * 16)
    black = layouts.black_pixel_values(processor.image_mean, processor.image_std)
    expected_row = black.repeat_interleave(pixel_values.shape[1] // 3)
    assert torch.allclose(masked[changed], expected_row.expand(int(changed.sum()), -1))
    assert torch.equal(masked[~changed], pixel_values[~changed])


def test_black_value_matches_processing_a_black_image():
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    row = processor(images=[Image.new("RGB", (56, 56))], return_tensors="pt")["pixel_values"][0]
    per_channel = row.view(3, -1)
    assert torch.allclose(
        per_channel, layouts.black_pixel_values(processor.image_mean, processor.image_std)[:, None], atol=1e-6
    )


def test_merge_unit_mask_takes_whole_units(processed):
    processor, pixel_values, grid = processed
    patches, masked = _mask(processor, pixel_values, grid, 0.5, seed=1, merge_size=2)
    assert patches.units_per_segment.tolist() == [16, 4]
    changed = (masked != pixel_values).any(dim=1).view(-1, 4)
    assert torch.all(changed.all(1) | ~changed.any(1))
    assert changed.all(1).sum().item() == 8 + 2


def test_masks_are_seeded_and_reproducible(processed):
    processor, pixel_values, grid = processed
    run = lambda seed: _mask(processor, pixel_values, grid, 0.6, seed=seed)[1]  # noqa: E731
    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_random_values_are_blackened_per_channel_without_touching_the_input(processed):
    processor, pixel_values, grid = processed
    original = pixel_values.clone()
    patches = layouts.patch_map(_batch(pixel_values, grid), patch_size=14, **_stats(processor))
    coins = torch.rand(pixel_values.shape, generator=torch.Generator().manual_seed(0)) < 0.6
    masked = masking.apply_values(patches, pixel_values, coins)
    assert torch.equal(pixel_values, original)
    changed = masked != pixel_values
    assert not (changed & ~coins).any(), "a value changed where no coin fell"
    assert changed.float().mean().item() == pytest.approx(0.6, abs=0.05)
    black = layouts.black_pixel_values(processor.image_mean, processor.image_std)
    channel_of_column = torch.arange(pixel_values.shape[1]) // (pixel_values.shape[1] // 3)
    assert torch.allclose(masked[changed], black[channel_of_column.expand_as(masked)[changed]])


def test_a_selection_that_does_not_fit_the_batch_is_refused(processed):
    processor, pixel_values, grid = processed
    patches = layouts.patch_map(_batch(pixel_values, grid), patch_size=14, **_stats(processor))
    with pytest.raises(ValueError, match=r"selection of shape \(79,\) for 80 patches \(grid_rows\)"):
        masking.apply_units(patches, pixel_values, torch.zeros(79, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not cover pixel_values"):
        layouts.patch_map(_batch(pixel_values[:-1], grid), patch_size=14, **_stats(processor))


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
def test_bad_ratio_is_refused(ratio):
    with pytest.raises(ValueError, match=rf"mask ratio must be in \[0, 1\], got {ratio}"):
        masking.select_units(torch.tensor([4, 4]), ratio, None)


def test_the_prompt_identity_matches_exactly_equal_prompts_and_images(processed):
    _, pixel_values, grid = processed
    n0 = int(grid[0].prod())
    batch = _batch(torch.cat([pixel_values, pixel_values[:n0]]), torch.cat([grid, grid[:1]]), (1, 1, 1))  # A, B, A
    batch["prompt_mask"] = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])  # the third prompt has one more token
    keys = prompt_identity.sample_keys(batch)
    assert keys[0] != keys[1], "different images"
    assert keys[0] != keys[2], "same image but a different prompt (the unpadded tokens differ)"
    assert prompt_identity.group_samples(batch) == [[0], [1], [2]]
    batch["prompt_mask"] = torch.tensor([[0, 1, 1]] * 3)
    same = prompt_identity.sample_keys(batch)
    assert same[0] == same[2] != same[1] and prompt_identity.group_samples(batch) == [[0, 2], [1]]
    assert layouts.sample_row_ranges(batch["image_grid_thw"], [1, 1, 1])[2] == (80, 80 + n0)
    # the shared prefix groups by the masked images: a mask that differs splits a prompt's rows
    masked = batch["pixel_values"].clone()
    masked[80] = 0.0
    assert prompt_identity.group_samples(batch, masked) == [[0], [1], [2]]


def test_keys_do_not_depend_on_the_batch_a_prompt_lands_in(processed):
    """TRL shuffles a round's rollouts across device batches: a prompt's key is its content, not its position."""
    _, pixel_values, grid = processed
    whole = prompt_identity.sample_keys(_batch(pixel_values, grid))
    n0 = int(grid[0].prod())
    alone = prompt_identity.sample_keys(_batch(pixel_values[n0:], grid[1:], (1,)))
    assert alone == whole[1:] and whole[0] != whole[1]


def test_a_text_only_batch_is_grouped_by_its_tokens():
    batch = {"prompt_ids": torch.tensor([[1, 2], [1, 2], [3, 4]]), "prompt_mask": torch.ones(3, 2, dtype=torch.long)}
    assert prompt_identity.group_samples(batch) == [[0, 1], [2]]
    keys = prompt_identity.sample_keys(batch)
    assert keys[0] == keys[1] != keys[2]
