"""What both prefix paths share (``papo_nb.prefix_sharing.common``): the rotary positions refuse a batch with images
but without ``mm_token_type_ids`` rather than placing every image token as text, and the masked branch then leaves
the batch to the full forward, whose own behaviour applies (issue 42, item 6)."""

from __future__ import annotations

import pytest
import torch

from papo_nb.papo.masked_branch import prefill_layout_reason
from papo_nb.prefix_sharing.common import rope_positions
from papo_nb.testbed.models import load_vlm
from papo_nb.testbed.shapes import make_shapes_dataset


@pytest.fixture(scope="module")
def image_batch(tiny_vlm_path):
    """The tiny Qwen2-VL and one processed prompt with an image (its ``mm_token_type_ids`` included)."""
    model, processor = load_vlm(str(tiny_vlm_path))
    example = make_shapes_dataset(1, seed=0)[0]
    text = processor.apply_chat_template(example["prompt"], add_generation_prompt=True)
    return model, processor(text=[text], images=[example["image"]], return_tensors="pt")


@pytest.mark.model
def test_positions_of_an_image_batch_without_token_types_are_refused_naming_the_field(image_batch):
    model, batch = image_batch
    ids, mask, grid = batch["input_ids"], batch["attention_mask"], batch["image_grid_thw"]
    expected, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=batch["mm_token_type_ids"], image_grid_thw=grid, attention_mask=mask
    )
    assert torch.equal(rope_positions(model, ids, mask, batch["mm_token_type_ids"], grid), expected)
    with pytest.raises(ValueError, match=r"mm_token_type_ids=None with image_grid_thw of 1 images.*allowed"):
        rope_positions(model, ids, mask, None, grid)
    text_positions = rope_positions(model, ids, mask, None, None)  # text only: zeros are the truth
    columns = torch.arange(ids.shape[1])
    assert torch.equal(text_positions, columns.view(1, 1, -1).expand(3, 1, -1))


def test_the_masked_branch_leaves_an_image_batch_without_token_types_to_the_full_forward():
    grid = torch.tensor([[1, 4, 4]])
    complete = {"pixel_values": torch.zeros(16, 8), "image_grid_thw": grid, "mm_token_type_ids": torch.zeros(1, 9)}
    assert prefill_layout_reason(complete) is None
    assert prefill_layout_reason({"prompt_ids": torch.zeros(1, 3)}) is None  # text only
    missing = {k: v for k, v in complete.items() if k != "mm_token_type_ids"}
    assert "image_grid_thw without mm_token_type_ids" in prefill_layout_reason(missing)
    assert prefill_layout_reason({"pixel_values": complete["pixel_values"]}) == "pixel_values without image_grid_thw"
