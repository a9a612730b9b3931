"""The published configurations of the models the recipes train, shipped as data (``published_configs/*.json``,
each naming its source), and the widths the memory forecast reads from a configuration: no weights, no hub.

``published_config`` resolves a hub id to the shipped file whose name matches (``Qwen/Qwen2.5-VL-3B-Instruct``),
a local folder to its ``config.json``, and ``tiny:<family>`` to the testbed's tiny configuration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

PUBLISHED_DIR = Path(__file__).with_name("published_configs")
LORA_TARGETS = ("q_proj", "v_proj")  # papo_nb.workbook.training.builder.LORA_TARGETS (kept here: no torch/peft import)


def published_names() -> list[str]:
    return sorted(p.stem for p in PUBLISHED_DIR.glob("*.json"))


def config_from_dict(values: dict):
    """The transformers configuration of a config.json's values (keys starting with ``_``, the source note, are
    not configuration)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = {k: v for k, v in values.items() if not k.startswith("_")}
    return CONFIG_MAPPING[values["model_type"]](**values)


def published_config(model_name_or_path: str):
    """The configuration of ``model_name_or_path`` without its weights: a shipped published configuration, a local
    folder's config.json, or a tiny testbed family's. Raises ValueError naming the allowed values otherwise."""
    if model_name_or_path.startswith("tiny:"):
        from papo_nb.testbed.models import build_tiny_tokenizer, tiny_config

        return tiny_config(model_name_or_path[len("tiny:") :], build_tiny_tokenizer())
    local = Path(model_name_or_path).expanduser() / "config.json"
    if local.is_file():
        return config_from_dict(json.loads(local.read_text()))
    shipped = PUBLISHED_DIR / f"{model_name_or_path.rsplit('/', 1)[-1]}.json"
    if shipped.is_file():
        return config_from_dict(json.loads(shipped.read_text()))
    raise ValueError(
        f"parameter 'model_name_or_path' = {model_name_or_path!r}: no configuration to forecast from; allowed: a "
        f"local model folder with config.json, tiny:<family>, or a hub id of a shipped configuration "
        f"({', '.join('Qwen/' + n for n in published_names())})"
    )


def meta_model(config):
    """The model of ``config`` on the meta device (shapes only, no memory)."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


@dataclass(frozen=True)
class Widths:
    """What the forecast needs of a model: sizes from the configuration, parameter counts from a meta model."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    patch: int
    merge: int
    temporal_patch: int
    parameters: int  # every parameter, the vision tower's included (tied embeddings counted once)
    vision_parameters: int
    layer_parameters: int  # one decoder layer
    embedding_parameters: int  # the input embedding (and the lm_head when untied)
    lora_per_rank: int  # LoRA parameters on q_proj/v_proj per unit of rank: sum of (in + out) features
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)
    vision_norm: str  # "rmsnorm" (Qwen2.5-VL) or "layernorm" (Qwen3-VL)

    def lora_parameters(self, rank: int) -> int:
        return rank * self.lora_per_rank


def widths(config) -> Widths:
    text, vision = config.get_text_config(), config.vision_config
    model = meta_model(config)
    inner = getattr(model, "model", model)
    visual = getattr(inner, "visual", None) or model.visual
    language = getattr(inner, "language_model", inner)
    lora = sum(
        module.in_features + module.out_features
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear)
    )
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    embedding = model.get_input_embeddings().weight.numel() * (1 if tied else 2)
    heads = text.num_attention_heads
    return Widths(
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=text.num_key_value_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        tied=tied,
        vision_depth=vision.depth,
        vision_hidden=getattr(vision, "hidden_size", None) or vision.embed_dim,
        vision_intermediate=getattr(vision, "intermediate_size", 0) or vision.embed_dim * vision.mlp_ratio,
        vision_heads=vision.num_heads,
        patch=vision.patch_size,
        merge=vision.spatial_merge_size,
        temporal_patch=vision.temporal_patch_size,
        parameters=sum(p.numel() for p in model.parameters()),
        vision_parameters=sum(p.numel() for p in visual.parameters()),
        layer_parameters=sum(p.numel() for p in language.layers[0].parameters()),
        embedding_parameters=embedding,
        lora_per_rank=lora,
        qk_norm=hasattr(language.layers[0].self_attn, "q_norm"),
        vision_norm="layernorm" if isinstance(visual.blocks[0].norm1, torch.nn.LayerNorm) else "rmsnorm",
    )


def with_depth(config, layers: int):
    """A copy of ``config`` with ``layers`` decoder layers and as many vision blocks (the rehearsal's model); the
    vision tower's full-attention and deepstack indexes are kept where they still exist."""
    config = config.__class__.from_dict(config.to_dict())
    text, vision = config.get_text_config(), config.vision_config
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    vision.depth = layers
    for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if getattr(vision, name, None):
            kept = [i for i in getattr(vision, name) if i < layers]
            setattr(vision, name, kept or ([layers - 1] if name == "fullatt_block_indexes" else []))
    return config
