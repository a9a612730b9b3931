"""Grouped attention for packed prompt groups: each prompt's keys and values computed once, each completion attending
to its prompt and causally to itself, never to another completion or group, with no ``W x W`` tensor anywhere.

The packed forward (``packed_rows.py``) runs a chunk of groups as one flat row ``[p1; c11 ... c1g; p2; c21 ...]``
(batch 1, no padding). The text model's attention layers then receive, in place of a mask, a ``GroupedLayout``
(passed as ``attention_mask={"full_attention": layout}``, which Qwen-VL's text model hands to each layer as it is),
and the text config's attention implementation is switched to ``NAME`` for the forward (``grouped_attention``).
Per layer the function gathers the flat row's queries/keys/values into the layout's batched calls of the text
model's own attention (SDPA, or the model module's eager function with additive masks). A group of prompt length
``P`` and ``n`` completions (the longest ``R``) runs one of two forms, whichever computes fewer query-key pairs:

- stacked: one causal call of batch ``n`` over ``[prompt; completion k]`` (width ``P + R``), with no mask at all, so
  SDPA takes its causal kernel (which skips the blocks above the diagonal, on the CPU and on a GPU's flash kernel):
  ``n (P + R)^2 / 2`` pairs, the plain path's own count; the prompt's outputs are read from the first row;
- split: the prompt causal over itself (``P^2 / 2``), then the completions, batch ``n``, over ``[prompt; own]``
  with one ``(R, P + R)`` boolean mask (query ``i`` sees keys ``j <= P + i``): ``n R (P + R)`` pairs.

Split wins where the prompt is long against the completions (P 1100, R 256, G 8: 0.46 of stacked's pairs), stacked
where it is not (every ``P <= R``), so attention never computes more pairs than the plain path does on unpadded
rows. Padding inside a call lies after every real query of its row, so the causal pattern keeps it out and its
outputs are never read. Every step is a gather, a concatenation or the model's own attention call, so the backward
is autograd's (each prompt key receives the gradients of its group's completions). This follows the prefix/suffix
split of PrefixGrouper (arXiv 2506.05433; verl's ``use_prefix_grouper``), written here for Qwen-VL's attention
interface, with the stacked form added because a masked call cannot skip blocks.

Under gradient checkpointing the backward recomputes each checkpointed layer with the same keyword arguments (the
layout among them) after the forward, when the text config names the model's own implementation again: for the
packed forward each module's checkpoint function is wrapped (``CHECKPOINT_FUNCTIONS``) so that what it recomputes
runs under ``NAME`` too; a checkpointing it cannot follow is named by ``checkpointing_reason`` (the plain path runs).

``PAPOGConfig.grouped_attention_kernel`` may run the whole flat row as one FlexAttention call with the layout's
block mask in place of these calls (``flex_grouped.py``; by default on CUDA): ``grouped_attention`` chooses per
packed forward, ``grouped_attention_forward`` dispatches.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import flex_grouped
from .attention_cost import causal_pairs, grouped_forms
from .layout_mask import layout_through_mask_builder

NAME = "papo_grouped"  # the attention implementation registered for the packed forward
# The text model's own attention implementations the grouped path reproduces (SDPA's call, or the model's eager one).
TEXT_IMPLEMENTATIONS = ("sdpa", "eager")
# The attributes through which a module checkpoints its forward, each called as ``fn(function, *args, **kwargs)`` and
# running ``function`` again in the backward: transformers' layers (``GradientCheckpointingLayer``, set by
# ``activation_checkpointing_enable``) and torch's ``CheckpointWrapper`` (FSDP's activation checkpointing).
CHECKPOINT_FUNCTIONS = ("_gradient_checkpointing_func", "checkpoint_fn")
# torch's composable ``checkpoint(module)`` registers under this name: it recomputes through the module's forward
# hooks, which the grouped layout cannot follow.
COMPOSABLE_CHECKPOINT = "checkpoint"


@dataclass
class AttentionCall:
    """One batched call: queries at the flat positions ``query_index`` ``(b, L)`` over keys and values at
    ``key_index`` ``(b, S)``; ``allowed`` the ``(L, S)`` boolean mask, or None for a causal call (``L == S``)."""

    query_index: torch.Tensor
    key_index: torch.Tensor
    allowed: torch.Tensor | None

    @property
    def pairs(self) -> int:
        rows, queries = self.query_index.shape
        return rows * (causal_pairs(queries) if self.allowed is None else queries * self.key_index.shape[1])


@dataclass
class GroupedLayout:
    """The calls one forward's attention runs and where each flat position's output lies: ``source`` per flat
    position, its row in the calls' outputs flattened in order; ``groups`` the packed prompt groups; ``inner``: the
    text model's own implementation the calls run through (set by ``grouped_attention``); ``kernel_request``: the
    ``grouped_attention_kernel`` asked for, ``kernel`` what the forward runs (``flex_grouped.choose``), with each
    position's group and segment for FlexAttention's block mask (``flex_mask``, built once per forward)."""

    calls: list[AttentionCall]
    source: torch.Tensor
    groups: int
    inner: str = "sdpa"
    token_groups: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    kernel_request: str = "auto"
    kernel: str = flex_grouped.SDPA
    flex_mask: Any = None

    @property
    def pairs(self) -> int:
        """Query-key pairs the calls compute per head (a causal call's upper triangle skipped, padding included)."""
        return sum(call.pairs for call in self.calls)


def _group_calls(prompt: torch.Tensor, completions: list[torch.Tensor], source: torch.Tensor, offset: int):
    """The calls of one group (flat positions ``prompt`` and ``completions``), filling ``source``; returns
    ``(calls, offset after their outputs)``."""
    n_prompt, n = len(prompt), len(completions)

    def arange(length):
        return torch.arange(length, device=prompt.device)

    if n == 0:
        source[prompt] = offset + arange(n_prompt)
        return [AttentionCall(prompt[None], prompt[None], None)], offset + n_prompt
    width = max(len(c) for c in completions)
    # padding repeats each completion's last position: it lies after every real query of the row
    own = torch.stack([torch.cat([c, c[-1:].expand(width - len(c))]) for c in completions])
    keys = torch.cat([prompt.expand(n, -1), own], dim=1)
    forms = grouped_forms(n_prompt, width, n)
    if forms["stacked"] <= forms["split"]:
        source[prompt] = offset + arange(n_prompt)  # the first row's copy
        for k, c in enumerate(completions):
            source[c] = offset + k * (n_prompt + width) + n_prompt + arange(len(c))
        return [AttentionCall(keys, keys, None)], offset + n * (n_prompt + width)
    source[prompt] = offset + arange(n_prompt)
    offset += n_prompt
    for k, c in enumerate(completions):
        source[c] = offset + k * width + arange(len(c))
    allowed = torch.ones(width, n_prompt + width, dtype=torch.bool, device=prompt.device).tril(n_prompt)
    calls = [AttentionCall(prompt[None], prompt[None], None), AttentionCall(own, keys, allowed)]
    return calls, offset + n * width


def build_layout(token_groups: torch.Tensor, segments: torch.Tensor) -> GroupedLayout:
    """The layout of a flat row from each token's group (``token_groups``, ``(W,)``, 0..n-1 in row order) and segment
    (``segments``: 0 the group's prompt, k its k-th completion; each group's prompt non-empty and first)."""
    keys = token_groups * (int(segments.max()) + 1) + segments  # one key per (group, segment), in row order
    unique, inverse = torch.unique_consecutive(keys, return_inverse=True)
    members = [(inverse == i).nonzero().flatten() for i in range(len(unique))]
    source = torch.empty(len(token_groups), dtype=torch.long, device=token_groups.device)
    calls, offset, groups = [], 0, 0
    for i, positions in enumerate(members):
        if segments[positions[0]] != 0:
            continue
        completions = []
        for following in members[i + 1 :]:
            if segments[following[0]] == 0:
                break
            completions.append(following)
        group_calls, offset = _group_calls(positions, completions, source, offset)
        calls += group_calls
        groups += 1
    return GroupedLayout(calls, source, groups, token_groups=token_groups, segments=segments)


def _inner_call(inner: str, module, query, key, value, allowed, dropout, scaling, kwargs):
    """The text model's own attention on one batched call: SDPA causal or with the boolean mask, or the model
    module's eager function with the additive mask it expects."""
    if inner == "sdpa":
        mask = None if allowed is None else allowed[None, None]
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, is_causal=allowed is None, **kwargs
        )[0]
    if allowed is None:
        allowed = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
    additive = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
    additive = additive.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, additive, scaling=scaling, dropout=dropout, **kwargs)[0]


def grouped_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention interface's function for ``NAME``: ``query`` ``(1, heads, W, d)``, ``key``/``value``
    ``(1, kv heads, W, d)`` of the flat row, ``attention_mask`` its ``GroupedLayout``; returns ``(1, W, heads, d)``."""
    layout: GroupedLayout = attention_mask
    if layout.kernel == flex_grouped.FLEX:
        if layout.flex_mask is None:
            layout.flex_mask = flex_grouped.block_mask(layout.token_groups, layout.segments)
        return flex_grouped.attention(query, key, value, layout.flex_mask, scaling), None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("sliding_window", "position_ids")}
    q, k, v = query[0], key[0], value[0]

    def gather(states, index):  # (heads, W, d) -> (rows, heads, width, d)
        return states[:, index].transpose(0, 1)

    outputs = [
        _inner_call(layout.inner, module, gather(q, call.query_index), gather(k, call.key_index),
                    gather(v, call.key_index), call.allowed, dropout, scaling, kwargs).flatten(0, 1)
        for call in layout.calls
    ]  # fmt: skip
    return torch.cat(outputs)[layout.source][None], None


AttentionInterface.register(NAME, grouped_attention_forward)


def text_config(hf_model):
    """The config the text model's attention layers read (Qwen-VL: ``model.language_model.config``)."""
    language_model = getattr(getattr(hf_model, "model", None), "language_model", None)
    return language_model.config if language_model is not None else hf_model.config.get_text_config()


def unsupported_reason(hf_model) -> str | None:
    """Why the text model's own attention cannot run grouped (read per sub-config, not from the top level), or None.
    Gradient checkpointing is decided per forward (``checkpointing_reason``): ``Trainer.train`` turns it on later."""
    implementation = text_config(hf_model)._attn_implementation
    if implementation not in TEXT_IMPLEMENTATIONS:
        return (
            f"the text model's attention implementation (text_config._attn_implementation={implementation!r}) "
            f"is not one of {TEXT_IMPLEMENTATIONS}"
        )
    return None


def checkpointing_reason(hf_model) -> str | None:
    """Why a checkpointed module of ``hf_model`` would recompute outside the grouped layout (its recomputation
    reaching SDPA with a ``GroupedLayout`` for a mask), or None: read when the forward runs."""
    for name, module in hf_model.named_modules():
        if COMPOSABLE_CHECKPOINT in _composable_apis(module):
            return (
                f"module {name or type(module).__name__!r} is checkpointed by torch.distributed._composable."
                "checkpoint, whose recomputation calls the module's forward outside the grouped layout"
            )
        if getattr(module, "gradient_checkpointing", False) is True and not any(
            attribute in vars(module) for attribute in CHECKPOINT_FUNCTIONS
        ):
            return (
                f"module {name or type(module).__name__!r} has gradient_checkpointing=True without its own "
                f"checkpoint function (one of {CHECKPOINT_FUNCTIONS}) the grouped layout can follow"
            )
    return None


def _composable_apis(module) -> dict:
    """The torch composable APIs applied to ``module`` by name (``fully_shard``, ``checkpoint``...)."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed._composable.contract import _get_registry

    return _get_registry(module) or {}


def checkpointing_description(hf_model) -> str:
    """Whether the model checkpoints activations now, and how the grouped layout meets it (``checkpointing_reason``
    None)."""
    if not any(
        getattr(module, "gradient_checkpointing", False) is True or "checkpoint_fn" in vars(module)
        for module in hf_model.modules()
    ):
        return "gradient checkpointing off"
    return "gradient checkpointing on: each checkpointed layer recomputed inside the grouped layout"


@contextlib.contextmanager
def _implementation(config, name: str):
    """For the duration: ``config``'s attention implementation is ``name`` (the one it had restored after)."""
    own = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = own


def _recomputed_grouped(checkpoint_function, config):
    """``checkpoint_function`` (called as ``fn(function, *args, **kwargs)``) whose ``function`` runs under ``NAME``
    each time it runs: in the forward, and in the backward's recomputation, which comes after ``grouped_attention``
    has restored the text model's own implementation (reentrant or not: both recompute through ``function``)."""

    @functools.wraps(checkpoint_function)
    def checkpoint_grouped(function, *args, **kwargs):
        def grouped_function(*inner_args, **inner_kwargs):
            with _implementation(config, NAME):
                return function(*inner_args, **inner_kwargs)

        return checkpoint_function(grouped_function, *args, **kwargs)

    return checkpoint_grouped


@contextlib.contextmanager
def _checkpointing_through_layout(hf_model, config):
    """For the duration: each module's own checkpoint function (``CHECKPOINT_FUNCTIONS``) recomputes under ``NAME``;
    a vision block's too, which reads its own config and so runs as before."""
    replaced = [
        (module, attribute, vars(module)[attribute])
        for module in hf_model.modules()
        for attribute in CHECKPOINT_FUNCTIONS
        if callable(vars(module).get(attribute))
    ]
    for module, attribute, function in replaced:
        setattr(module, attribute, _recomputed_grouped(function, config))
    try:
        yield
    finally:
        for module, attribute, function in replaced:
            setattr(module, attribute, function)


@contextlib.contextmanager
def grouped_attention(hf_model, layout: GroupedLayout):
    """For the duration: the text model's layers run ``NAME`` with ``layout.inner`` their own implementation, and
    every checkpointed layer's recomputation does too, whenever the backward runs it; ``layout.kernel`` chosen for
    the whole forward (a recomputation runs what the forward ran)."""
    config = text_config(hf_model)
    layout.inner = config._attn_implementation
    dropout = getattr(config, "attention_dropout", 0.0) if hf_model.training else 0.0
    layout.kernel = flex_grouped.choose(
        layout.kernel_request, layout.source.device, torch.is_grad_enabled(), dropout, flex_grouped.head_dim_of(config)
    )
    # the text config alone: the vision tower keeps its own; a text model that builds its mask (Qwen3-VL) gets the
    # layout through its builder
    with (
        _implementation(config, NAME),
        _checkpointing_through_layout(hf_model, config),
        layout_through_mask_builder(hf_model, GroupedLayout),
    ):
        yield
