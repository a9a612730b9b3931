"""Which families share prefixes, and Qwen3-VL's own parts of the packed forward.

docs/families.md's "Prefix sharing by family" table is checked against the code's own list
(``common.SUPPORTED_MODEL_TYPES``) and against every tiny model of the testbed: each of the twelve families named
once, "yes" exactly where the model takes the packed path. On the tiny Qwen3-VL (exactness of log-probs, entropies
and gradients is ``test_prefix_sharing.py``'s, under checkpointing ``test_prefix_sharing_checkpointing.py``'s, the
masked branch ``test_shared_prefix.py``'s) the two things Qwen2-VL does not have are shown to reach the log-probs and
to be placed exactly: deepstack (the vision tower's features added at the image tokens after the first decoder
layers) and the interleaved multimodal rotary positions.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from test_prefix_sharing import (
    TEMPERATURE,
    TOLERANCE,
    completion_mask,
    in_dtype,
    max_error,
    plain,
    reference_setup,
)
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from papo_nb.prefix_sharing import common, trl_seams
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed import families
from papo_nb.testbed.models import TINY_FAMILIES, build_tiny_vlm, load_vlm

TABLE = Path(__file__).resolve().parents[1] / "docs" / "families.md"
HEADING = "## Prefix sharing by family"
FAMILY_COUNT = 12  # the testbed's families (tiled variants are their family's rows)


def names_in(cell: str) -> list[str]:
    """The backticked names of a table cell, in order."""
    return cell.split("`")[1::2]


def table_rows() -> list[dict]:
    """The table's rows: tiny names, model types, whether it shares."""
    section = TABLE.read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0].startswith(("family", "---")):
            continue
        rows.append(dict(tiny=names_in(cells[0]), model_types=names_in(cells[1]), shares=cells[2]))
    return rows


def tiny_model(name: str, tmp_path):
    """The tiny model of ``name`` (weights initialised from its config; the Qwen2 families built and loaded)."""
    if name in families.FAMILIES:
        spec = families.FAMILIES[name]
        return spec.model_cls(spec.build()[1])
    return load_vlm(str(build_tiny_vlm(name, cache_dir=tmp_path)))[0]


def test_the_table_names_every_tiny_family_once_and_shares_exactly_the_supported_types():
    rows = table_rows()
    assert len(rows) == FAMILY_COUNT
    named = [name for row in rows for name in row["tiny"]]
    assert sorted(named) == sorted(TINY_FAMILIES), "every tiny family once"
    assert {row["shares"] for row in rows} == {"yes", "no"}
    sharing = {model_type for row in rows if row["shares"] == "yes" for model_type in row["model_types"]}
    assert sharing == set(common.SUPPORTED_MODEL_TYPES)


@pytest.mark.model
def test_each_tiny_model_takes_the_packed_path_exactly_where_the_table_says(tmp_path):
    """Per tiny family: its config's model type is the row's, and the model is refused with its family's reason
    exactly where the row says "no" (on TRL 1.14+ every model runs TRL's forward, for the release's reason)."""
    release_reason = trl_seams.packed_path_reason()
    for row in table_rows():
        for name in row["tiny"]:
            model = tiny_model(name, tmp_path)
            assert model.config.model_type in row["model_types"], (name, model.config.model_type)
            reason = common.model_unsupported_reason(model)
            if release_reason is not None:
                assert reason == release_reason
            elif row["shares"] == "yes":
                assert reason is None, (name, reason)
            else:
                assert reason == f"model_type {model.config.model_type!r} is not one of {common.SUPPORTED_MODEL_TYPES}"
            del model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, shapes_dataset):
    """The tiny Qwen3-VL in float64, a trainer whose plain log-prob method is the reference, and the adversarial
    batch of ``test_prefix_sharing.py`` (three image prompts, one with two images of different grids, and a
    text-only one)."""
    folder = build_tiny_vlm("qwen3_vl", cache_dir=tmp_path_factory.mktemp("m"))
    setup = reference_setup(folder, shapes_dataset, tmp_path_factory.mktemp("q3"))
    model = setup["model"].to(torch.float64)
    assert model.config.text_config.mrope_interleaved and model.config.vision_config.deepstack_visual_indexes
    return dict(model=model, trainer=setup["trainer"], arguments=in_dtype(setup["arguments"], torch.float64))


def packed_error(qwen3, batch) -> float:
    """The packed batch's log-probs against TRL's plain forward, max abs over the completion tokens."""
    model, arguments = qwen3["model"], qwen3["arguments"]
    with torch.no_grad():
        reference = plain(qwen3["trainer"], model, arguments)[0]
        logps = prefix_sharing.logps_of_packed(model, batch, temperature=TEMPERATURE, compute_entropy=False,
                                               entropy_grad=False)[0]  # fmt: skip
    ours = torch.zeros_like(reference)
    ours[batch.rows, batch.columns] = logps
    return max_error(ours, reference, completion_mask(arguments))


def deepstack_calls(monkeypatch, shift: int) -> list[tuple[int, int]]:
    """Qwen3-VL's deepstack step recorded per call as ``(image positions, feature rows)``, its features rolled by
    ``shift`` rows (0: as the model adds them)."""
    calls = []
    own = Qwen3VLTextModel._deepstack_process

    def recorded(self, hidden_states, visual_pos_masks, visual_embeds):
        calls.append((int(visual_pos_masks.sum()), len(visual_embeds)))
        return own(self, hidden_states, visual_pos_masks, visual_embeds.roll(shift, 0))

    monkeypatch.setattr(Qwen3VLTextModel, "_deepstack_process", recorded)
    return calls


@pytest.mark.model
def test_deepstack_features_land_on_the_packed_image_tokens(qwen3, monkeypatch):
    """Each group's images pass the vision tower once and their deepstack features are added at the packed row's
    image tokens, one feature per token: exact; the same features one token off move the log-probs far."""
    (batch,) = prefix_sharing.packed_batches(qwen3["model"], qwen3["arguments"])
    image_tokens = int((batch.model_inputs["mm_token_type_ids"] == 1).sum())
    group_grids = batch.model_inputs["image_grid_thw"]
    merge = qwen3["model"].config.vision_config.spatial_merge_size
    assert image_tokens == int(group_grids.prod(1).sum()) // merge**2 > 0, "each group's images once"
    calls = deepstack_calls(monkeypatch, shift=0)
    exact = packed_error(qwen3, batch)
    layers = len(qwen3["model"].config.vision_config.deepstack_visual_indexes)
    assert calls[-layers:] == [(image_tokens, image_tokens)] * layers, calls
    monkeypatch.undo()
    deepstack_calls(monkeypatch, shift=1)
    misplaced = packed_error(qwen3, batch)
    print(f"qwen3_vl deepstack: exact {exact:.2e}, one token off {misplaced:.2e}")
    assert exact <= TOLERANCE[torch.float64][0] and misplaced > 100 * TOLERANCE[torch.float32][0]


@pytest.mark.model
def test_the_interleaved_rotary_positions_of_the_images_reach_the_log_probs(qwen3):
    """The packed row's positions are the plain forward's three rows per token (temporal, height, width), which
    Qwen3-VL interleaves over the rotary frequencies: the image tokens' height and width swapped move the log-probs
    far, the positions as packed are exact."""
    (batch,) = prefix_sharing.packed_batches(qwen3["model"], qwen3["arguments"])
    positions = batch.model_inputs["position_ids"]
    image = batch.model_inputs["mm_token_type_ids"][None].bool().expand_as(positions)
    swapped = torch.where(image, positions[[0, 2, 1]], positions)
    assert not torch.equal(swapped, positions), "an image that is not square in its merged grid"
    mutated = dataclasses.replace(batch, model_inputs={**batch.model_inputs, "position_ids": swapped})
    exact, broken = packed_error(qwen3, batch), packed_error(qwen3, mutated)
    print(f"qwen3_vl interleaved mrope: exact {exact:.2e}, height and width swapped {broken:.2e}")
    assert exact <= TOLERANCE[torch.float64][0] and broken > 100 * TOLERANCE[torch.float32][0]
