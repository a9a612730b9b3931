"""The masked branch with a shared prompt prefix: vision and prompt key/values once per prompt, not per completion.

The G rollouts of a prompt share its tokens and, with masks drawn per prompt (``mask_sharing="prompt"``), its masked
image. Under no-grad (``masked_branch_grad=False``, the default) the masked forward then needs the vision tower and
the prompt's key/values once per prompt: each distinct prompt of the device batch is prefilled once with its masked
image (``use_cache=True``); its cache is copied to its completions, which run against it; the last prefill logit
predicts the first completion token. Completion log-probs and entropies are those of TRL 1.9.1's
``_get_per_token_logps_and_entropies``
(https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L1435-L1545: logits / temperature,
``selective_log_softmax``, ``entropy_from_logits``), to float rounding.

Positions are exact: Qwen's multimodal rotary positions of the *whole* prompt + completion sequence are taken from
``get_rope_index`` (what the full forward computes, Qwen2VLModel.compute_3d_position_ids) and sliced per forward;
positions built from the stored ``rope_deltas`` ignore left padding
(measured on the tiny Qwen2-VL: off by the pad count).

Rows are grouped by prompt *and* mask: in the loss call the masking hands over the groups it drew masks by
(``mask_state.MaskedImages``: a prompt's rows under per-prompt masks, every row alone under per-completion masks), and
a group's first row's masked pixels serve the group, so the path is exact whatever the masks are; found here
(``prompt_groups``: prompt tokens, grid and pixel rows) where no masking ran. Completions
run one chunk of whole groups at a time (at most as many rows as the largest group), so the expanded cache and the
vocabulary-sized logits exist for one chunk only: the peak stays below the full forward's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from ..prefix_sharing import trl_seams
from ..prefix_sharing.common import core_model, rope_positions, whole_group_chunks
from ..prefix_sharing.common import model_unsupported_reason as unsupported_reason
from ..prefix_sharing.image_rows import sample_row_ranges
from ..prefix_sharing.prompt_identity import group_samples

METRIC = "papo/masked_forward_shared"  # 1 when the shared-prefix path ran for the batch, 0 for the full forward
SHARE_METRIC = "papo/masked_forward_share"  # completions per prefilled prompt (shared path only)


@dataclass
class Plan:
    """The static part of the choice, made once per trainer: ``shared`` unless a reason says otherwise."""

    shared: bool
    reason: str


def plan(args, model) -> Plan:
    """Decide from the config and the model: ``args.masked_forward`` ``"full"``, ``"shared_prefix"`` (refused with a
    ValueError where it cannot run) or ``"auto"`` (shared where it applies, else full with the reason)."""
    choice = args.masked_forward
    if choice == "full":
        return Plan(False, "masked_forward='full'")
    # 1.14+'s log-probs are not logits / temperature
    reason = trl_seams.prefill_reason() or unsupported_reason(model) or config_reason(args)
    if reason is not None and choice == "shared_prefix":
        raise ValueError(
            f"PAPOGConfig.masked_forward='shared_prefix' cannot run: {reason}; allowed here: 'auto' or 'full'"
        )
    return Plan(reason is None, reason or f"masked_forward={choice!r}")


def config_reason(args) -> str | None:
    """Why the config alone keeps the masked branch off the shared prefix, or None (``plan``'s config part: the
    memory forecast reads it from the params before any model exists). ``"auto"`` also leaves it where no two
    completions share a masked image; ``"shared_prefix"`` is not refused for that."""
    if args.masked_forward == "full":
        return "masked_forward='full'"
    if args.masked_branch_grad:
        return "masked_branch_grad=True: the shared prefix is a no-grad path"
    if args.masked_forward == "auto" and args.mask_sharing != "prompt":
        return f"mask_sharing={args.mask_sharing!r}: no two completions share a masked image"
    return None


def prompt_groups(inputs: dict[str, Any], pixel_values: torch.Tensor | None) -> list[list[int]]:
    """Rows of the batch that are the same prompt with the same (masked) images, in order of first appearance: the
    prompt identity of the masks (``prompt_identity.group_samples``), on ``pixel_values``."""
    return group_samples(inputs, pixel_values)


def select_rows(inputs: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The batch of ``rows`` only, for the layouts this path supports (flattened pixel rows with ``image_grid_thw``
    and ``num_images``): every per-row tensor and list, each row's pixel rows and grids; the rest as it is."""
    n = len(inputs["prompt_ids"])
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == n and key != "pixel_values":
            out[key] = value[rows]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    grid, num_images = inputs.get("image_grid_thw"), inputs.get("num_images")
    if inputs.get("pixel_values") is not None and grid is not None:
        ranges = sample_row_ranges(grid, num_images)
        offsets = torch.tensor([0, *num_images]).cumsum(0).tolist()
        out["pixel_values"] = torch.cat([inputs["pixel_values"][ranges[i][0] : ranges[i][1]] for i in rows])
        out["image_grid_thw"] = torch.cat([grid[offsets[i] : offsets[i + 1]] for i in rows])
    return out


def _cache_keyword(hf_model) -> str:
    """``cache`` from transformers 5.x's rename, ``past_key_values`` before it."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


@torch.no_grad()
def shared_prefix_logps(
    model,
    inputs: dict[str, Any],
    pixel_values: torch.Tensor | None,
    *,
    temperature: float,
    compute_entropy: bool,
    groups: list[list[int]] | None = None,
    max_chunk_rows: int | None = None,
    group_pixel_values: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logps, entropies)`` of the completions of ``inputs`` (a ``_compute_loss`` batch) with ``pixel_values`` in
    place of its own, each ``(B, C)``, computed with one prefill per distinct prompt (``groups``; found if None).

    ``model`` is what the trainer calls (possibly wrapped); ``max_chunk_rows`` bounds the completion rows per
    forward (default: the largest group). ``group_pixel_values`` (one tensor per group: its first row's pixel rows)
    replaces ``pixel_values`` where only the groups' images were built (the rollout-time branch masks each
    distinct prompt once); ``groups`` must then be given."""
    grid, num_images, mm_types = (
        inputs.get("image_grid_thw"),
        inputs.get("num_images"),
        inputs.get("mm_token_type_ids"),
    )
    if group_pixel_values is not None and groups is None:
        raise ValueError("shared_prefix_logps: group_pixel_values needs the groups it was built for")
    groups = groups if groups is not None else prompt_groups(inputs, pixel_values)
    has_images = pixel_values is not None or group_pixel_values is not None
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)

    # The shared helpers first (model, positions, chunks), then the rows' images, then this module's forwards.
    hf_model = core_model(model)
    positions = rope_positions(hf_model, input_ids, attention_mask, mm_types, grid if has_images else None)
    chunks = whole_group_chunks(groups, max_chunk_rows or max(map(len, groups)))
    ranges = sample_row_ranges(grid, num_images) if has_images and group_pixel_values is None else None
    firsts = [g[0] for g in groups]
    if ranges is not None:
        group_pixel_values = [pixel_values[ranges[i][0] : ranges[i][1]] for i in firsts]
    cache_key = _cache_keyword(hf_model)
    first_logits, prefix_kv = _prefill(model, inputs, positions, firsts, group_pixel_values, cache_key)
    return _completions(
        model,
        inputs,
        positions,
        groups,
        chunks,
        first_logits,
        prefix_kv,
        temperature=temperature,
        compute_entropy=compute_entropy,
        cache_key=cache_key,
    )


def _prefill(model, inputs, positions, firsts, group_pixel_values, cache_key):
    """One prefill per distinct prompt (its first row ``firsts``), with its (masked) image ``group_pixel_values``
    (None: text only): the logit of its last token, ``(U, 1, V)``, and the prompts' key/values per layer."""
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    mm_types, n_prompt = inputs.get("mm_token_type_ids"), prompt_ids.shape[1]
    prefill = dict(
        input_ids=prompt_ids[firsts],
        attention_mask=prompt_mask[firsts],
        position_ids=positions[:, firsts, :n_prompt],
        use_cache=True,
        logits_to_keep=1,
    )
    if mm_types is not None:
        prefill["mm_token_type_ids"] = mm_types[firsts, :n_prompt]
    if group_pixel_values is not None:
        grid, num_images = inputs.get("image_grid_thw"), inputs.get("num_images")
        image_offsets = torch.tensor([0, *num_images]).cumsum(0).tolist()
        prefill["pixel_values"] = torch.cat(group_pixel_values)
        prefill["image_grid_thw"] = torch.cat([grid[image_offsets[i] : image_offsets[i + 1]] for i in firsts])
    cache = DynamicCache()
    prefill[cache_key] = cache
    first_logits = model(**prefill).logits[:, -1:, :]  # (U, 1, V): predicts each prompt's first completion token
    if cache.get_seq_length() != n_prompt:
        raise RuntimeError(
            f"the prefill left {cache.get_seq_length()} of {n_prompt} prompt positions in the key/value cache"
        )
    return first_logits, [(layer.keys, layer.values) for layer in cache.layers]


def _completions(
    model, inputs, positions, groups, chunks, first_logits, prefix_kv, *, temperature, compute_entropy, cache_key
):
    """The completions of whole groups, chunk by chunk (``chunks``: ``whole_group_chunks`` of ``groups``), against
    a copy of their prompts' key/values: ``(logps, entropies or None)``, each ``(B, C)``.

    A chunk's vocabulary-sized logits exist once: the first token's come from the prefill's last logit, the others
    from the completion forward, each scored where it is (never concatenated), divided by the temperature in place
    and reduced a row at a time, so no second full-vocabulary copy is made."""
    completion_ids, n_prompt = inputs["completion_ids"], inputs["prompt_ids"].shape[1]
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    group_of = torch.empty(len(completion_ids), dtype=torch.long)
    for g, rows in enumerate(groups):
        group_of[rows] = g
    logps = torch.empty(completion_ids.shape, dtype=first_logits.dtype, device=first_logits.device)
    entropies = torch.empty_like(logps) if compute_entropy else None
    for rows in (sum(chunk, []) for chunk in chunks):
        index = torch.tensor(rows, device=completion_ids.device)
        source = group_of[rows].to(first_logits.device)
        first = first_logits.index_select(0, source)  # (k, 1, V), a copy: dividing it leaves the prefill's logits
        _score(first, completion_ids[index, :1], temperature, logps, entropies, index, 0)
        del first
        if completion_ids.shape[1] > 1:
            chunk_cache = DynamicCache()
            for layer_idx, (keys, values) in enumerate(prefix_kv):
                chunk_cache.update(keys.index_select(0, source), values.index_select(0, source), layer_idx)
            logits = model(
                input_ids=completion_ids[index, :-1],
                attention_mask=attention_mask[index, :-1],
                position_ids=positions[:, index, n_prompt:-1],
                use_cache=True,
                **{cache_key: chunk_cache},
            ).logits  # (k, C - 1, V), predicting completion tokens 1 .. C - 1
            del chunk_cache
            _score(logits, completion_ids[index, 1:], temperature, logps, entropies, index, 1)
            del logits
    return logps, entropies


def _score(logits, targets, temperature, logps, entropies, index, start):
    """TRL's log-probs (and entropies) of ``targets`` under ``logits / temperature`` into ``logps[index, start:]``:
    ``logits`` is divided in place (it is the caller's to spend) and reduced one completion row at a time."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    end = start + logits.shape[1]
    logits.div_(temperature)
    logps[index, start:end] = selective_log_softmax(logits, targets).to(logps.dtype)
    if entropies is not None:  # one completion's positions per chunk: TRL's default of 128 rows may be the chunk
        entropies[index, start:end] = entropy_from_logits(logits, chunk_size=logits.shape[1]).to(entropies.dtype)
