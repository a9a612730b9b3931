"""The shipped published configurations: transformers loads each, and the meta-device model built from it has the
published parameter count (the hub's model cards: 3.75B, 8.29B and 4.44B parameters, vision towers included)."""

import json

import pytest

from papo_nb.workbook.recipe.architectures import (
    PUBLISHED_DIR,
    config_from_dict,
    published_config,
    published_names,
    widths,
    with_depth,
)

# The published parameter counts, from each model's model.safetensors.index.json total_size / 2 bytes (bf16).
PUBLISHED_PARAMETERS = {
    "Qwen2.5-VL-3B-Instruct": 3_754_622_976,
    "Qwen2.5-VL-7B-Instruct": 8_292_166_656,
    "Qwen3-VL-4B-Instruct": 4_437_815_808,
}


def test_every_recipe_model_is_shipped():
    assert published_names() == sorted(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_published_config_loads_and_counts(name):
    values = json.loads((PUBLISHED_DIR / f"{name}.json").read_text())
    assert "huggingface.co/Qwen/" + name in values["_source"]
    config = config_from_dict(values)
    assert type(config).__name__ in ("Qwen2_5_VLConfig", "Qwen3VLConfig")
    assert widths(config).parameters == PUBLISHED_PARAMETERS[name]
    assert widths(published_config(f"Qwen/{name}")).parameters == PUBLISHED_PARAMETERS[name]


def test_3b_widths_as_published():
    w = widths(published_config("Qwen/Qwen2.5-VL-3B-Instruct"))
    assert (w.hidden, w.intermediate, w.layers, w.heads, w.kv_heads, w.head_dim, w.vocab, w.tied) == (
        2048, 11008, 36, 16, 2, 128, 151936, True,
    )  # fmt: skip
    assert (w.vision_depth, w.vision_hidden, w.patch, w.merge, w.temporal_patch) == (32, 1280, 14, 2, 2)
    assert w.lora_per_rank == 36 * ((2048 + 2048) + (2048 + 256))  # q_proj and v_proj of every decoder layer


def test_with_depth_keeps_widths():
    config = published_config("Qwen/Qwen3-VL-4B-Instruct")
    short = widths(with_depth(config, 2))
    full = widths(config)
    assert (short.layers, short.vision_depth) == (2, 2)
    assert (short.hidden, short.vocab, short.patch, short.layer_parameters) == (
        full.hidden, full.vocab, full.patch, full.layer_parameters,
    )  # fmt: skip


def test_unknown_model_names_the_parameter():
    with pytest.raises(ValueError, match="parameter 'model_name_or_path' = 'org/unknown'.*Qwen/Qwen2.5-VL-3B"):
        published_config("org/unknown")


def test_local_folder_reads_its_config(tmp_path):
    (tmp_path / "config.json").write_text((PUBLISHED_DIR / "Qwen2.5-VL-3B-Instruct.json").read_text())
    assert widths(published_config(str(tmp_path))).parameters == PUBLISHED_PARAMETERS["Qwen2.5-VL-3B-Instruct"]
