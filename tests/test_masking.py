"""The trainer's masking on Qwen's 2-D pixel_values (``layouts.patch_map``, ``masking.select_units``,
``masking.apply_units``): whole patches turn black after normalisation, the input is never written; a prompt's
identity finds its rollouts. The placebo's options (issue 41): the ``mean`` fill and the units a dataset excludes,
down to the testbed's placebo batch through the real trainer.

The other layouts, on each family's real processor, are in test_families.py."""

import hashlib
import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor

from papo_nb.papo import PAPOGConfig, layouts, masking
from papo_nb.prefix_sharing import image_rows, prompt_identity
from papo_nb.testbed import raw_masks
from papo_nb.testbed.perception import (
    GREY,
    SQUARE_UNITS,
    TESTBED_RECIPES,
    held_out_items,
    make_item,
    make_perception_dataset,
)


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
    keys, groups = prompt_identity.keys_and_groups(batch)
    assert keys[0] != keys[1], "different images"
    assert keys[0] != keys[2], "same image but a different prompt (the unpadded tokens differ)"
    assert prompt_identity.group_samples(batch) == groups == [[0], [1], [2]]
    batch["prompt_mask"] = torch.tensor([[0, 1, 1]] * 3)
    same, groups = prompt_identity.keys_and_groups(batch)
    assert same[0] == same[2] != same[1] and prompt_identity.group_samples(batch) == groups == [[0, 2], [1]]
    assert image_rows.sample_row_ranges(batch["image_grid_thw"], [1, 1, 1])[2] == (80, 80 + n0)
    # the shared prefix groups by the masked images: a mask that differs splits a prompt's rows
    masked = batch["pixel_values"].clone()
    masked[80] = 0.0
    assert prompt_identity.group_samples(batch, masked) == [[0], [1], [2]]


def test_keys_do_not_depend_on_the_batch_a_prompt_lands_in(processed):
    """TRL shuffles a round's rollouts across device batches: a prompt's key is its content, not its position."""
    _, pixel_values, grid = processed
    whole, _ = prompt_identity.keys_and_groups(_batch(pixel_values, grid))
    n0 = int(grid[0].prod())
    alone, _ = prompt_identity.keys_and_groups(_batch(pixel_values[n0:], grid[1:], (1,)))
    assert alone == whole[1:] and whole[0] != whole[1]


def test_a_text_only_batch_is_grouped_by_its_tokens():
    batch = {"prompt_ids": torch.tensor([[1, 2], [1, 2], [3, 4]]), "prompt_mask": torch.ones(3, 2, dtype=torch.long)}
    assert prompt_identity.group_samples(batch) == [[0, 1], [2]]
    keys, groups = prompt_identity.keys_and_groups(batch)
    assert keys[0] == keys[1] != keys[2] and groups == [[0, 1], [2]]


# ---- the placebo's options (issue 41): the fill, and the units a dataset excludes ----
# The units select_units drew on the fixture at ratio 0.6, seed 0, before these options existed: bools from the CPU
# generator, the same on every machine.
SELECTION_BEFORE_THE_OPTIONS = "d25b3695abf16d101f454d1b2dc9a5cb96119fc64f8343ff00d3432e7eedad93"


def _patches(processor, pixel_values, grid):
    return layouts.patch_map(_batch(pixel_values, grid), patch_size=14, **_stats(processor))


def test_the_default_fill_and_draw_are_todays_bit_for_bit(processed):
    processor, pixel_values, grid = processed
    patches = _patches(processor, pixel_values, grid)
    chosen = masking.select_units(patches.units_per_segment, 0.6, torch.Generator().manual_seed(0))
    assert hashlib.sha256(chosen.numpy().tobytes()).hexdigest() == SELECTION_BEFORE_THE_OPTIONS
    nothing_excluded = torch.zeros(len(chosen), dtype=torch.bool)
    again = masking.select_units(patches.units_per_segment, 0.6, torch.Generator().manual_seed(0), nothing_excluded)
    assert torch.equal(again, chosen), "excluding no unit must draw today's masks"
    masked = masking.apply_units(patches, pixel_values, chosen)
    assert torch.equal(masked, masking.apply_units(patches, pixel_values, chosen, "black"))
    black = layouts.black_pixel_values(processor.image_mean, processor.image_std).repeat_interleave(1176 // 3)
    assert torch.equal(masked[chosen], black.expand(int(chosen.sum()), -1))
    assert torch.equal(masked[~chosen], pixel_values[~chosen])


def test_the_mean_fill_changes_exactly_the_chosen_patches_to_zero(processed):
    processor, pixel_values, grid = processed
    patches = _patches(processor, pixel_values, grid)
    chosen = masking.select_units(patches.units_per_segment, 0.6, torch.Generator().manual_seed(0))
    masked = masking.apply_units(patches, pixel_values, chosen, "mean")
    changed = (masked != pixel_values).any(dim=1)
    assert torch.equal(changed, chosen), "the mean fill changed other patches than the chosen ones"
    assert torch.equal(masked[chosen], torch.zeros(int(chosen.sum()), pixel_values.shape[1]))
    coins = torch.rand(pixel_values.shape, generator=torch.Generator().manual_seed(0)) < 0.6
    values = masking.apply_values(patches, pixel_values, coins, "mean")
    assert torch.equal(values != pixel_values, coins) and not values[coins].any()


@pytest.mark.parametrize("seed", range(5))
def test_excluded_units_are_never_masked_and_the_count_is_kept(processed, seed):
    processor, pixel_values, grid = processed
    patches = _patches(processor, pixel_values, grid)  # two images: 64 and 16 units
    excluded = torch.zeros(80, dtype=torch.bool)
    excluded[torch.randperm(64, generator=torch.Generator().manual_seed(seed))[: 30 + 4 * seed]] = True
    excluded[64:76] = True  # the small image allows 4 units, fewer than round(0.6 * 16) = 10
    chosen = masking.select_units(patches.units_per_segment, 0.6, torch.Generator().manual_seed(seed), excluded)
    assert not (chosen & excluded).any()
    assert int(chosen[:64].sum()) == min(round(0.6 * 64), 34 - 4 * seed)
    assert int(chosen[64:].sum()) == int((~excluded[64:]).sum()) == 4
    masked = masking.apply_units(patches, pixel_values, chosen, "mean")
    assert torch.equal(masked[excluded], pixel_values[excluded])


def test_bad_fill_and_exclusions_are_refused(processed):
    processor, pixel_values, grid = processed
    patches = _patches(processor, pixel_values, grid)
    with pytest.raises(ValueError, match=r"mask_fill='grey' is unknown; allowed: \('black', 'mean'\)"):
        masking.apply_units(patches, pixel_values, torch.zeros(80, dtype=torch.bool), "grey")
    with pytest.raises(ValueError, match=r"sample 1 excludes units \[16, -1\]; allowed: unit indices 0..15"):
        masking.excluded_units(16, [3, 16, -1], sample=1)
    with pytest.raises(ValueError, match=r"excluded units of shape \(79,\) for 80 units"):
        masking.select_units(patches.units_per_segment, 0.6, None, torch.zeros(79, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"PAPOGConfig.mask_fill='grey' is invalid.*one of \('black', 'mean'\)"):
        PAPOGConfig(output_dir="unused", mask_fill="grey")
    with pytest.raises(ValueError, match=r"PAPOGConfig.mask_excluded_column='' is invalid.*name of a dataset column"):
        PAPOGConfig(output_dir="unused", mask_excluded_column="")
    with pytest.raises(ValueError, match=r"mask_excluded_column='square_units' is invalid with mask_type='random'"):
        PAPOGConfig(output_dir="unused", mask_excluded_column="square_units", mask_type="random")


def test_the_testbed_square_units_are_the_processor_rows_that_show_the_square():
    """The testbed's column is in the processor's own row order (2x2 merge blocks): the rows it names are exactly the
    rows of the processed image that are not black, for squares in every cell and with decoy paint."""
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    black = layouts.black_pixel_values(processor.image_mean, processor.image_std)[:, None]
    rng, seen = random.Random(0), set()
    for _ in range(40):
        item = make_item(rng, "vision", prior_rate=0.0, decoy_share=(0.1, 0.7))
        rows = processor(images=[item["image"]], return_tensors="pt")["pixel_values"].view(16, 3, -1)
        shown = [i for i in range(16) if not torch.allclose(rows[i], black.expand_as(rows[i]), atol=1e-6)]
        assert item[SQUARE_UNITS] == shown and len(shown) == 1
        seen.update(shown)
    assert len(seen) >= 12, "the items should put the square in most cells"


def test_on_the_grey_testbed_square_units_are_the_rows_that_differ_from_the_grey_background():
    """Issue 56: on shapes_shortcut_grey the column names exactly the processed rows that are not the background's
    grey (not "not black": every row there is not black), so a mask over the other units never covers the square."""
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    grey = torch.tensor(GREY) / 255
    grey = ((grey - torch.tensor(processor.image_mean)) / torch.tensor(processor.image_std))[:, None]
    data = held_out_items("shapes_shortcut_grey", 40, seed=5, prior_rate=0.0)
    for image, units in zip(data["image"], data[SQUARE_UNITS]):
        rows = processor(images=[image], return_tensors="pt")["pixel_values"].view(16, 3, -1)
        shown = [i for i in range(16) if not torch.allclose(rows[i], grey.expand_as(rows[i]), atol=1e-5)]
        assert units == shown and len(shown) == 1
        assert image.getpixel((0, 0) if shown != [0] else (55, 55)) == GREY
    assert TESTBED_RECIPES["shapes_shortcut_grey"].background == GREY != (0, 0, 0)


@pytest.mark.model
def test_the_placebo_batch_masks_background_only_and_its_kl_is_not_zero(tiny_vlm_path, tmp_path):
    """The placebo (issue 41) through the real trainer on testbed items: TRL's generation carries the dataset's
    excluded units into the batch, the masked image keeps every patch that shows the square (all the task's
    information) and fills round(0.6 * 16) = 10 of the 15 background patches with the mean colour, and the
    perception KL against it is not zero (the term's form is real). A black fill would change nothing there."""
    from tiny_trainers import tiny_trainer

    from papo_nb.testbed.models import load_vlm
    from papo_nb.workbook.rollouts import rollout_batch

    model, processor = load_vlm(str(tiny_vlm_path))
    data = make_perception_dataset(4, seed=0, prior_rate=0.0, kinds=("vision",))
    trainer = tiny_trainer(
        model, processor, data, tmp_path, mask_fill="mean", mask_excluded_column=SQUARE_UNITS, mask_ratio=0.6
    )
    batch = rollout_batch(trainer, data, n_prompts=2, seed=0)
    masked = trainer.masked_pixel_values(batch)
    rows = batch["pixel_values"].view(-1, 16, batch["pixel_values"].shape[1])  # one 56x56 image (16 rows) each
    for sample, units in enumerate(batch[masking.EXCLUDED_UNITS_KEY].tolist()):
        square = [u for u in units if u >= 0]
        assert square == data[sample // trainer.num_generations][SQUARE_UNITS]
        changed = (masked.view_as(rows)[sample] != rows[sample]).any(dim=1)
        assert not changed[square].any(), "the placebo covered the square"
        assert int(changed.sum()) == 10 and not masked.view_as(rows)[sample][changed].any()
    _, terms = trainer.papo_loss_parts(trainer.model, batch)
    assert terms.kl_sum.item() > 0
    trainer.args.mask_fill = "black"
    black_over_black = trainer.masked_pixel_values(batch)  # equal up to the processor's float rounding of black
    assert torch.allclose(black_over_black, batch["pixel_values"], atol=1e-6, rtol=0), "black over black changed"


@pytest.mark.model
def test_on_the_grey_testbed_papo_g_black_fill_over_background_units_changes_them(tiny_vlm_path, tmp_path):
    """Issue 56: the black-fill placebo on shapes_shortcut_grey's items, through the real trainer's masking: it keeps
    every patch that shows the square and fills round(0.6 * 16) = 10 of the 15 grey background patches with black,
    which changes them (on the black testbed the same fill changed nothing), and its perception KL is not zero."""
    from tiny_trainers import tiny_trainer

    from papo_nb.testbed.models import load_vlm
    from papo_nb.workbook.rollouts import rollout_batch

    model, processor = load_vlm(str(tiny_vlm_path))
    data = held_out_items("shapes_shortcut_grey", 4, seed=0, prior_rate=0.0)
    trainer = tiny_trainer(
        model, processor, data, tmp_path, mask_fill="black", mask_excluded_column=SQUARE_UNITS, mask_ratio=0.6
    )
    batch = rollout_batch(trainer, data, n_prompts=2, seed=0)
    masked = trainer.masked_pixel_values(batch)
    rows = batch["pixel_values"].view(-1, 16, batch["pixel_values"].shape[1])
    black = layouts.black_pixel_values(processor.image_processor.image_mean, processor.image_processor.image_std)
    for sample, units in enumerate(batch[masking.EXCLUDED_UNITS_KEY].tolist()):
        square = [u for u in units if u >= 0]
        assert square == data[sample // trainer.num_generations][SQUARE_UNITS]
        changed = (masked.view_as(rows)[sample] != rows[sample]).any(dim=1)
        assert not changed[square].any(), "the placebo covered the square"
        assert int(changed.sum()) == 10
        filled = masked.view_as(rows)[sample][changed].view(10, 3, -1)
        assert torch.allclose(filled, black[None, :, None].expand_as(filled), atol=1e-6), "the fill is not black"
    _, terms = trainer.papo_loss_parts(trainer.model, batch)
    assert terms.kl_sum.item() > 0
