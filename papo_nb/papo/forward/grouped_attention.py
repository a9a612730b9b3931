"""Grouped attention for packed prompt groups: each prompt's self-attention once, each completion's attention over
``[its prompt's K/V; its own K/V]``, with masks linear in the group size and no ``W x W`` tensor anywhere.

The packed forward (``packed_rows.py``) runs a chunk of groups as one flat row ``[p1; c11 ... c1g; p2; c21 ...]``
(batch 1, no padding). The text model's attention layers then receive, in place of a mask, a ``GroupedLayout``
(passed as ``attention_mask={"full_attention": layout}``, which Qwen-VL's text model hands to each layer as it is),
and the text config's attention implementation is switched to ``NAME`` for the forward (``grouped_attention``).
Per layer the function gathers the flat row's queries/keys/values into two batched calls of the text model's own
attention (SDPA with boolean masks, or the model module's eager function with additive ones):

- prompts: ``(groups, heads, P, d)``, causal over each prompt's real tokens (``P``: the chunk's longest prompt);
- completions: ``(completions, heads, R, d)`` against ``[prompt K/V of its group; its own K/V]`` of width
  ``P + R``: the whole prompt, then causal over itself (``R``: the chunk's longest packed completion).

Attention then costs ``P^2 + G R (P + R)`` query-key pairs per group, never more than the plain path's
``G (P + R)^2``; masks are ``(groups, 1, P, P)`` and ``(completions, 1, R, P + R)``. The outputs are gathered back
into the flat row's order. Every step is a gather, a concatenation or the model's own attention call, so the
backward is autograd's (each prompt key receives the gradients of its group's completions). This follows the
prefix/suffix split of PrefixGrouper (arXiv 2506.05433; verl's ``use_prefix_grouper``), written here for
Qwen-VL's attention interface; padding inside the two batched calls is masked out and its outputs never read.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "papo_grouped"  # the attention implementation registered for the packed forward
# The text model's own attention implementations the grouped path reproduces (SDPA's call, or the model's eager one).
TEXT_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class GroupedLayout:
    """Where each prompt and each completion lie in the flat row.

    ``prompt_index`` ``(groups, P)`` and ``completion_index`` ``(completions, R)``: flat positions, real tokens first
    (``*_valid``); ``completion_group``: each completion's group; ``source``: per flat position, its row in
    ``[prompt outputs; completion outputs]`` flattened; ``prompt_allowed`` ``(groups, 1, P, P)`` and
    ``completion_allowed`` ``(completions, 1, R, P + R)``: the boolean masks; ``inner``: the text model's own
    implementation the two calls run through (set by ``grouped_attention``)."""

    prompt_index: torch.Tensor
    prompt_valid: torch.Tensor
    completion_index: torch.Tensor
    completion_valid: torch.Tensor
    completion_group: torch.Tensor
    source: torch.Tensor
    prompt_allowed: torch.Tensor
    completion_allowed: torch.Tensor
    inner: str = "sdpa"

    @property
    def pairs(self) -> int:
        """Query-key pairs the two calls compute per head (padding included)."""
        return self.prompt_allowed[:, 0].numel() + self.completion_allowed[:, 0].numel()


def _padded_index(members: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)``: each member's flat positions, right-padded with position 0 to the longest."""
    width = max([len(m) for m in members], default=0)
    index = torch.zeros((len(members), width), dtype=torch.long, device=device)
    valid = torch.zeros((len(members), width), dtype=torch.bool, device=device)
    for i, positions in enumerate(members):
        index[i, : len(positions)] = positions
        valid[i, : len(positions)] = True
    return index, valid


def build_layout(token_groups: torch.Tensor, segments: torch.Tensor) -> GroupedLayout:
    """The layout of a flat row from each token's group (``token_groups``, ``(W,)``, 0..n-1 in row order) and segment
    (``segments``: 0 the group's prompt, k its k-th completion; each group's prompt non-empty and first)."""
    device = token_groups.device
    keys = token_groups * (int(segments.max()) + 1) + segments  # one key per (group, segment), in row order
    unique, inverse = torch.unique_consecutive(keys, return_inverse=True)
    members = [(inverse == i).nonzero().flatten() for i in range(len(unique))]
    is_prompt = [bool(segments[m[0]] == 0) for m in members]
    prompts = [m for m, p in zip(members, is_prompt, strict=True) if p]
    completions = [m for m, p in zip(members, is_prompt, strict=True) if not p]
    prompt_index, prompt_valid = _padded_index(prompts, device)
    completion_index, completion_valid = _padded_index(completions, device)
    completion_group = torch.tensor([int(token_groups[m[0]]) for m in completions], dtype=torch.long, device=device)
    # Per flat position, its row in [prompt outputs (groups * P); completion outputs (completions * R)].
    source = torch.empty(len(token_groups), dtype=torch.long, device=device)
    source[prompt_index[prompt_valid]] = prompt_valid.flatten().nonzero().flatten()
    source[completion_index[completion_valid]] = prompt_valid.numel() + completion_valid.flatten().nonzero().flatten()
    n_prompt, n_completion = prompt_index.shape[1], completion_index.shape[1]
    prompt_causal = torch.ones(n_prompt, n_prompt, dtype=torch.bool, device=device).tril()
    completion_causal = torch.ones(n_completion, n_completion, dtype=torch.bool, device=device).tril()
    # A padded query sees real keys only (the prompt's first token at least), so no attention row is empty.
    prompt_allowed = prompt_causal[None] & prompt_valid[:, None, :]
    completion_allowed = torch.cat(
        [
            prompt_valid[completion_group][:, None, :].expand(-1, n_completion, -1),
            completion_causal[None] & completion_valid[:, None, :],
        ],
        dim=2,
    )
    return GroupedLayout(
        prompt_index, prompt_valid, completion_index, completion_valid, completion_group, source,
        prompt_allowed[:, None], completion_allowed[:, None],
    )  # fmt: skip


def _inner_call(inner: str, module, query, key, value, allowed, dropout, scaling, kwargs):
    """The text model's own attention on one batched call: SDPA with the boolean mask, or the model module's eager
    function with the additive mask it expects."""
    if inner == "sdpa":
        return sdpa_attention_forward(
            module, query, key, value, allowed, dropout=dropout, scaling=scaling, is_causal=False, **kwargs
        )[0]
    eager = sys.modules[type(module).__module__].eager_attention_forward
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    additive = additive.masked_fill(~allowed, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, additive, scaling=scaling, dropout=dropout, **kwargs)[0]


def grouped_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention interface's function for ``NAME``: ``query`` ``(1, heads, W, d)``, ``key``/``value``
    ``(1, kv heads, W, d)`` of the flat row, ``attention_mask`` its ``GroupedLayout``; returns ``(1, W, heads, d)``."""
    layout: GroupedLayout = attention_mask
    kwargs = {k: v for k, v in kwargs.items() if k not in ("sliding_window", "position_ids")}
    q, k, v = query[0], key[0], value[0]

    def gather(states, index):  # (heads, W, d) -> (members, heads, width, d)
        return states[:, index].transpose(0, 1)

    prompt_k, prompt_v = gather(k, layout.prompt_index), gather(v, layout.prompt_index)
    args = (dropout, scaling, kwargs)
    outputs = [
        _inner_call(layout.inner, module, gather(q, layout.prompt_index), prompt_k, prompt_v, layout.prompt_allowed,
                    *args).flatten(0, 1)
    ]  # fmt: skip
    if layout.completion_index.numel():
        own_k, own_v = gather(k, layout.completion_index), gather(v, layout.completion_index)
        keys = torch.cat([prompt_k[layout.completion_group], own_k], dim=2)
        values = torch.cat([prompt_v[layout.completion_group], own_v], dim=2)
        query_c = gather(q, layout.completion_index)
        outputs.append(
            _inner_call(layout.inner, module, query_c, keys, values, layout.completion_allowed, *args).flatten(0, 1)
        )
    return torch.cat(outputs)[layout.source][None], None


AttentionInterface.register(NAME, grouped_attention_forward)


def text_config(hf_model):
    """The config the text model's attention layers read (Qwen-VL: ``model.language_model.config``)."""
    language_model = getattr(getattr(hf_model, "model", None), "language_model", None)
    return language_model.config if language_model is not None else hf_model.config.get_text_config()


def unsupported_reason(hf_model) -> str | None:
    """Why the text model's own attention cannot run grouped (read per sub-config, not from the top level), or None."""
    implementation = text_config(hf_model)._attn_implementation
    if implementation not in TEXT_IMPLEMENTATIONS:
        return (
            f"the text model's attention implementation (text_config._attn_implementation={implementation!r}) "
            f"is not one of {TEXT_IMPLEMENTATIONS}"
        )
    if getattr(hf_model, "is_activation_checkpointing", False):
        return "gradient checkpointing is on (its recomputation would run outside the grouped layout)"
    return None


@contextlib.contextmanager
def grouped_attention(hf_model, layout: GroupedLayout):
    """For the duration: the text model's layers run ``NAME`` with ``layout.inner`` their own implementation."""
    config = text_config(hf_model)
    own = config._attn_implementation
    layout.inner = own
    config._attn_implementation_internal = NAME  # the text config alone: the vision tower keeps its own
    try:
        yield
    finally:
        config._attn_implementation_internal = own
