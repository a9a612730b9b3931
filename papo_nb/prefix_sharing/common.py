"""What both "prompt once per group" paths need: the model families they were checked against, the Hugging Face
model under its wrappers, the plain forward's rotary positions, and the one chunker of whole groups.

The two paths: ``prefill.py`` (the no-grad masked branch: each prompt prefilled once, its key/value cache copied to
its completions) and ``sharing.py`` (every log-prob forward: each group packed once, grouped attention).
"""

from __future__ import annotations

import inspect

import torch

from . import trl_seams

# model_type of the language-vision models whose forward, cache and get_rope_index both paths were checked against
# (tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL models against the full forward; docs/families.md says why others are not).
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def core_model(model):
    """The Hugging Face ``...ForConditionalGeneration`` under DDP/accelerate (``.module``) and PEFT wrappers."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def model_unsupported_reason(model) -> str | None:
    """Why this model (on the installed TRL) cannot take either prefix path (its family, positions or window), or
    None."""
    release_reason = trl_seams.packed_path_reason()  # a log-prob form prefix sharing does not reproduce
    if release_reason is not None:
        return release_reason
    hf_model = core_model(model)
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if not hasattr(getattr(hf_model, "model", None), "get_rope_index"):
        return f"{type(hf_model).__name__}.model has no get_rope_index"
    text_config = hf_model.config.get_text_config()
    if getattr(text_config, "use_sliding_window", False):
        return "the language model uses sliding-window attention (its cache would be cropped)"
    return None


def rope_positions(hf_model, input_ids, attention_mask, mm_token_type_ids, image_grid_thw) -> torch.Tensor:
    """``(3, B, L)`` positions of the whole sequences, as the full forward computes them. A model whose
    ``get_rope_index`` takes ``mm_token_type_ids`` gets them: with images (``image_grid_thw``) they are refused when
    missing, as the plain forward refuses them (zeros would place every image token as text); without images every
    token is text, which zeros say exactly."""
    rope_index = hf_model.model.get_rope_index
    kwargs = dict(image_grid_thw=image_grid_thw, attention_mask=attention_mask)
    if "mm_token_type_ids" in inspect.signature(rope_index).parameters:
        if mm_token_type_ids is None and image_grid_thw is not None:
            raise ValueError(
                f"mm_token_type_ids=None with image_grid_thw of {len(image_grid_thw)} images: "
                f"{type(hf_model.model).__name__}.get_rope_index needs each token's modality to place the images; "
                "allowed: the processor's mm_token_type_ids (text 0, image 1, video 2) for every token"
            )
        kwargs["mm_token_type_ids"] = torch.zeros_like(input_ids) if mm_token_type_ids is None else mm_token_type_ids
    positions, _ = rope_index(input_ids, **kwargs)
    return positions


def whole_group_chunks(groups: list[list[int]], max_rows: int) -> list[list[list[int]]]:
    """Consecutive whole groups, at most ``max_rows`` rows per chunk (a larger group is a chunk of its own)."""
    chunks, current = [], []
    for group in groups:
        if current and sum(map(len, current)) + len(group) > max_rows:
            chunks.append(current)
            current = []
        current.append(group)
    return chunks + ([current] if current else [])
