"""A batch's prompt groups as one flat packed row ``[p1; c11 ... c1g; p2; ...]``, and their log-probs back in the
batch's row order.

TRL 1.9.1 runs every completion as its own row ``[prompt; completion]``
(https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L1435-L1545), so each group's prompt and
image pass through the model once per completion. Here a group (the rows of one prompt with byte-equal images,
``prompt_identity.group_samples``) is packed once: the prompt's real tokens, then each completion's real tokens but
its last (whose logit predicts nothing TRL keeps), the groups of a chunk one after another in one row of batch 1
(no padding). The text model's attention runs grouped (``grouped_attention.py``): each prompt causal over itself,
each completion over its prompt and causally over itself, never another completion or group. Positions are those of
the plain forward (``forward_positions``), taken from the unpacked row: each completion restarts where the prompt
ends. The logit of the prompt's last token predicts every completion's first token; completion ``j``'s token ``t``
is predicted at its own token ``t - 1``; ``logits_to_keep`` is the list of those positions, so the vocabulary head
runs on needed positions only.

Tokens the completion mask drops (after the end of a completion) are not packed: their log-probs and entropies are
0, where TRL's plain forward leaves values that the losses mask out (``sharing.py`` runs the plain path for
the one aggregation that reads them, ``luspo`` with ``beta != 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .common import rope_positions
from .grouped_attention import GroupedLayout, build_layout
from .image_rows import sample_row_ranges


@dataclass
class PackedBatch:
    """One forward's flat packed row: ``model_inputs`` for the model (the ``GroupedLayout`` as its attention mask,
    ``logits_to_keep`` the needed positions), each token's ``segments`` id (``(1, W)``: 0 prompt, k the k-th
    completion of its group) and group (``token_groups``, ``(W,)``), and per needed logit, in ``logits_to_keep``'s
    order, the batch row and completion column it belongs to (``rows``, ``columns``) and the token it predicts
    (``targets``)."""

    model_inputs: dict[str, Any]
    segments: torch.Tensor
    token_groups: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    targets: torch.Tensor

    @property
    def layout(self) -> GroupedLayout:
        return self.model_inputs["attention_mask"]["full_attention"]


def forward_positions(hf_model, input_ids, attention_mask, mm_token_type_ids, image_grid_thw) -> torch.Tensor:
    """``(3, B, L)`` positions of the unpacked rows as the plain forward computes them: ``get_rope_index`` (padding
    skipped) when the batch has images, else the column index, which is what Qwen-VL's forward falls back to without
    ``image_grid_thw`` (``compute_3d_position_ids`` returns None)."""
    if image_grid_thw is not None:
        return rope_positions(hf_model, input_ids, attention_mask, mm_token_type_ids, image_grid_thw)
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    return columns.view(1, 1, -1).expand(3, input_ids.shape[0], -1)


def completion_lengths(attention_mask: torch.Tensor, n_completion: int) -> torch.Tensor | None:
    """Each row's real completion tokens, or None when a completion mask has a gap (TRL's masks are a prefix of
    ones: everything up to the first end-of-sequence) or a prompt does not end in a real token (right padding)."""
    if attention_mask.shape[1] <= n_completion:
        return None
    completion = attention_mask[:, -n_completion:].bool()
    lengths = completion.sum(1)
    prefix = torch.arange(n_completion, device=lengths.device)[None, :] < lengths[:, None]
    if not torch.equal(prefix, completion) or not attention_mask[:, -n_completion - 1].bool().all():
        return None
    return lengths


@dataclass
class _GroupRow:
    """One group's packed row before padding: its tokens, positions, modality types and segment ids (0: the
    prompt, k: the k-th completion), and per needed logit ``(position in the row, batch row, completion column)``."""

    tokens: torch.Tensor
    positions: torch.Tensor
    types: torch.Tensor | None
    segments: torch.Tensor
    picks: list[tuple[int, int, int]]


def _group_row(input_ids, attention_mask, positions, mm_types, n_prompt: int, group: list[int], lengths) -> _GroupRow:
    first = group[0]
    real = attention_mask[first, :n_prompt].bool().nonzero().flatten()
    parts = [real]  # columns of the unpacked rows, prompt first
    sources = [torch.full_like(real, first)]
    picks = [(len(real) - 1, row, 0) for row in group if lengths[row] > 0]  # the prompt's last logit: token 0
    start = len(real)
    for row in group:
        packed = max(lengths[row] - 1, 0)  # its last token predicts nothing that is kept
        parts.append(torch.arange(n_prompt, n_prompt + packed, device=real.device))
        sources.append(torch.full((packed,), row, dtype=real.dtype, device=real.device))
        picks += [(start + t - 1, row, t) for t in range(1, lengths[row])]
        start += packed
    columns, source_rows = torch.cat(parts), torch.cat(sources)
    segments = torch.cat([torch.full((len(p),), k, dtype=torch.long, device=real.device) for k, p in enumerate(parts)])
    return _GroupRow(
        tokens=input_ids[source_rows, columns],
        positions=positions[:, source_rows, columns],
        types=None if mm_types is None else mm_types[source_rows, columns],
        segments=segments,
        picks=picks,
    )


def _group_images(pixel_values, image_grid_thw, num_images, firsts: list[int]) -> dict[str, torch.Tensor]:
    """Each group's images once (its first row's pixel rows and grids), in group order."""
    ranges = sample_row_ranges(image_grid_thw, num_images)
    offsets = torch.tensor([0, *num_images]).cumsum(0).tolist()
    return {
        "pixel_values": torch.cat([pixel_values[ranges[i][0] : ranges[i][1]] for i in firsts]),
        "image_grid_thw": torch.cat([image_grid_thw[offsets[i] : offsets[i + 1]] for i in firsts]),
    }


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    n_completion: int,
    lengths: torch.Tensor,
    groups: list[list[int]],
    *,
    mm_token_type_ids: torch.Tensor | None = None,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    num_images: list[int] | None = None,
) -> PackedBatch:
    """The flat packed row of ``groups``: rows of ``input_ids`` = ``[prompt; completion]`` whose last
    ``n_completion`` columns are the completion (``lengths`` real tokens each, ``completion_lengths``); each group's
    images once (its first row's); ``positions`` from ``forward_positions``."""
    n_prompt = input_ids.shape[1] - n_completion
    built = [
        _group_row(input_ids, attention_mask, positions, mm_token_type_ids, n_prompt, group, lengths.tolist())
        for group in groups
    ]
    offsets = torch.tensor([0, *[len(row.tokens) for row in built]]).cumsum(0).tolist()
    picks = [(offsets[g] + p, r, c) for g, row in enumerate(built) for p, r, c in row.picks]
    device = input_ids.device
    segments = torch.cat([row.segments for row in built])
    token_groups = torch.cat([torch.full_like(row.segments, g) for g, row in enumerate(built)])
    logit_positions, rows_t, columns_t = (
        torch.tensor([pick[i] for pick in picks], dtype=torch.long, device=device) for i in range(3)
    )
    model_inputs = dict(
        input_ids=torch.cat([row.tokens for row in built])[None],
        attention_mask={"full_attention": build_layout(token_groups, segments)},
        position_ids=torch.cat([row.positions for row in built], dim=1)[:, None],
        logits_to_keep=logit_positions,
    )
    if mm_token_type_ids is not None:
        model_inputs["mm_token_type_ids"] = torch.cat([row.types for row in built])[None]
    if pixel_values is not None and image_grid_thw is not None:
        model_inputs.update(_group_images(pixel_values, image_grid_thw, num_images, [g[0] for g in groups]))
    targets = input_ids[rows_t, n_prompt + columns_t]
    return PackedBatch(model_inputs, segments[None], token_groups, rows_t, columns_t, targets)
