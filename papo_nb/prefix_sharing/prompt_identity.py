"""A prompt's identity in a batch (``group_samples``, ``keys_and_groups``): its unpadded prompt tokens and the bytes of
every image tensor aligned with its rows.

TRL 1.9.1 shuffles a generation round before splitting it into device batches
(https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L1576-L1577), so a prompt's rollouts are
found by their content: the mask cache keys on it, and the shared prompt prefix groups its rows by it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .image_rows import sample_structure

# Tensors that are indexed like pixel_values along dim 0 (same images/tiles): a sample's share of each is its image.
_ROW_ALIGNED = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "image_position_ids",
)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (where it lives): equal exactly when the bytes are."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _sample_parts(
    inputs: dict[str, Any], patches: Any = None
) -> tuple[str, list[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]]:
    """The layout (empty for a text-only batch) and, per sample, its unpadded prompt tokens and its share of every
    row-aligned image tensor; ``patches``, the batch's patch map where the caller built one (its ``rows``:
    ``image_rows.SampleRows``), says where each sample's rows are (else they are found from the batch)."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    tokens = [prompt_ids[i][prompt_mask[i].bool()] for i in range(len(prompt_ids))]
    if inputs.get("pixel_values") is None:
        return "", [(t, []) for t in tokens]
    structure = patches.rows if patches is not None else sample_structure(inputs)
    layout, rows, images = structure.layout, structure.sample_rows, structure.image_rows
    parts = []
    for i, (start, end) in enumerate(rows):
        named = []
        for name in _ROW_ALIGNED:
            value = inputs.get(name)
            if isinstance(value, torch.Tensor):
                a, b = images[i] if name == "image_grid_thw" else (start, end)
                named.append((name, value[a:b]))
        parts.append((tokens[i], named))
    return layout, parts


def group_samples(inputs: dict[str, Any], pixel_values: torch.Tensor | None = None) -> list[list[int]]:
    """The batch's rows grouped by prompt, in order of first appearance: equal unpadded prompt tokens and byte-equal
    images (``pixel_values`` and every tensor aligned with it). ``pixel_values``, when given, stands in for the
    batch's own (the shared prefix groups by the masked images). Compared with ``torch.equal`` where the tensors
    live, after a host-side match of tokens, dtypes and shapes."""
    if pixel_values is not None:
        inputs = {**inputs, "pixel_values": pixel_values}
    return _groups(_sample_parts(inputs)[1])


def _groups(parts) -> list[list[int]]:
    groups: list[list[int]] = []
    candidates: dict[tuple, list[tuple[list[torch.Tensor], int]]] = {}  # tokens and shapes -> (raw parts, group)
    for i, (tokens, named) in enumerate(parts):
        raw = [_raw(part) for _, part in named]
        signature = (tuple(tokens.tolist()), tuple((name, part.dtype, tuple(part.shape)) for name, part in named))
        same = (g for earlier, g in candidates.get(signature, []) if all(map(torch.equal, raw, earlier)))
        group = next(same, None)
        if group is None:
            group = len(groups)
            groups.append([])
            candidates.setdefault(signature, []).append((raw, group))
        groups[group].append(i)
    return groups


def keys_and_groups(inputs: dict[str, Any], patches: Any = None) -> tuple[list[str], list[list[int]]]:
    """One key per completion, equal exactly when two completions are the same prompt, also across device batches
    (a hash of the first sample's bytes in each group: one host copy per distinct prompt), and the groups of
    ``group_samples``. ``patches``: the batch's map, where the caller has it (``_sample_parts``)."""
    layout, parts = _sample_parts(inputs, patches)
    keys: list[str] = [""] * len(parts)
    groups = _groups(parts)
    for group in groups:
        tokens, named = parts[group[0]]
        digest = hashlib.blake2b(digest_size=16)
        digest.update(layout.encode())
        digest.update(_raw(tokens).cpu().numpy().tobytes())
        for name, part in named:
            digest.update(name.encode() + _raw(part).cpu().numpy().tobytes())
        for i in group:
            keys[i] = digest.hexdigest()
    return keys, groups
