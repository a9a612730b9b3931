"""The masked branch once per generation round (``masked_branch="rollout"``), as the official code computes it.

The official trainer computes the masked log-probs once per rollout batch, right after ``old_log_probs`` and before
the update loop, under no-grad with the rollout-time policy
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/trainer/ray_trainer.py#L759-L769,
https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L193-L231). Here the trainer's
``_generate_and_score_completions`` calls the parent's and hands its batch to ``masked_branch_entries``, which adds
the masked per-token log-probs (and, for the full-vocabulary estimator, the masked entropies) under
``MASKED_LOGPS_KEY`` / ``MASKED_ENTROPIES_KEY``. TRL then shuffles, splits and buffers them with the rest of the round,
as it does ``old_per_token_logps`` (https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L1572-L1579).

Before that shuffle a process holds each prompt's G rollouts side by side (TRL's RepeatSampler order), so the shared
prompt prefix serves all G completions of a prompt with one prefill, and the masked pixels are built once per
distinct prompt. The round is processed in chunks of whole prompts of at most ``per_device_train_batch_size`` rows
(at least one prompt's G), the bound TRL uses for ``old_per_token_logps``; under several processes the chunks are
fixed row ranges, so every rank runs the same number of forwards (a forward is a collective under FSDP).

A batch remembers which trainer stored its branch (``OWNER_KEY``, a 0-d tensor that the split and the shuffle pass
through): another trainer, with other masks or another forward, computes its own.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch

from . import masking, shared_prefix
from .contract import VLM_FORWARD_KEYWORDS

MASKED_LOGPS_KEY = "papo_masked_logps"
MASKED_ENTROPIES_KEY = "papo_masked_entropies"
OWNER_KEY = "papo_masked_owner"


def logp_call_arguments(inputs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``(input_ids, attention_mask, logits_to_keep)`` and the VLM keywords for ``_get_per_token_logps_and_entropies``
    on a ``_compute_loss`` batch, built as the parent builds them."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return (input_ids, attention_mask, inputs["completion_ids"].size(1)), {
        key: inputs.get(key) for key in VLM_FORWARD_KEYWORDS
    }


@dataclass
class BranchClock:
    """Where the masked branch's time goes: wall and process CPU seconds, and how many passes ran."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    calls: int = 0

    @contextlib.contextmanager
    def timing(self):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - wall
            self.cpu_seconds += time.process_time() - cpu
            self.calls += 1


def new_owner_tag() -> int:
    """A random 62-bit tag naming one trainer's stored branches."""
    return secrets.randbits(62)


def stored_branch(trainer, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(masked logps, masked entropies or None)`` stored with ``inputs`` by ``trainer``'s rollout pass, or None."""
    owner = inputs.get(OWNER_KEY)
    if owner is None or int(owner) != trainer.masked_branch_owner or MASKED_LOGPS_KEY not in inputs:
        return None
    logps = inputs[MASKED_LOGPS_KEY]
    if logps.shape != inputs["completion_ids"].shape:
        raise RuntimeError(
            f"the stored masked log-probs have shape {tuple(logps.shape)}, the batch's completions "
            f"{tuple(inputs['completion_ids'].shape)}: the round was split or padded after the masked branch ran"
        )
    return logps, inputs.get(MASKED_ENTROPIES_KEY)


def in_buffered_round(trainer, inputs: dict[str, Any]) -> bool:
    """Whether ``inputs`` is one of the device batches TRL buffered for the current round (inside ``train()``)."""
    buffered = getattr(trainer, "_buffered_inputs", None) or []
    return any(inputs is batch for batch in buffered)


def _chunks(trainer, groups: list[list[int]], n_rows: int) -> list[list[list[int]]]:
    """Chunks of the round, each a list of groups (rows of one prompt): whole prompts of at most ``limit`` rows on
    one process; fixed row ranges (a prompt cut at a boundary is prefilled in both) under several."""
    limit = max(trainer.args.per_device_train_batch_size, max(len(g) for g in groups))
    if trainer.accelerator.num_processes == 1:
        chunks, current = [], []
        for group in groups:
            if current and sum(map(len, current)) + len(group) > limit:
                chunks.append(current)
                current = []
            current.append(group)
        return chunks + ([current] if current else [])
    limit = trainer.args.per_device_train_batch_size
    group_of = {row: g for g, rows in enumerate(groups) for row in rows}
    chunks = []
    for start in range(0, n_rows, limit):
        by_group: dict[int, list[int]] = {}
        for row in range(start, min(start + limit, n_rows)):
            by_group.setdefault(group_of[row], []).append(row)
        chunks.append(list(by_group.values()))
    return chunks


def _shared(trainer, batch: dict[str, Any], compute_entropy: bool):
    """The shared-prefix form: per chunk, each distinct prompt masked once and prefilled once. Returns
    ``(logps, entropies, completions, prefills)``."""
    n = len(batch["prompt_ids"])
    groups = shared_prefix.prompt_groups(batch, batch.get("pixel_values"))
    logps = entropies = None
    prefills = 0
    for chunk in _chunks(trainer, groups, n):
        rows = [row for group in chunk for row in group]
        sub = shared_prefix.select_rows(batch, rows)
        position = {row: k for k, row in enumerate(rows)}
        local_groups = [[position[row] for row in group] for group in chunk]
        group_pixels = None
        if sub.get("pixel_values") is not None:
            firsts = shared_prefix.select_rows(sub, [g[0] for g in local_groups])
            masked = trainer.masked_pixel_values(firsts)
            ranges = masking.sample_row_ranges(firsts["image_grid_thw"], firsts["num_images"])
            group_pixels = [masked[a:b] for a, b in ranges]
        chunk_logps, chunk_entropies = shared_prefix.shared_prefix_logps(
            trainer.model,
            sub,
            None,
            temperature=trainer.temperature,
            compute_entropy=compute_entropy,
            groups=local_groups,
            max_chunk_rows=len(rows),
            group_pixel_values=group_pixels,
        )
        if logps is None:
            logps = chunk_logps.new_empty((n, chunk_logps.shape[1]))
            entropies = logps.new_empty(logps.shape) if compute_entropy else None
        index = torch.tensor(rows, device=logps.device)
        logps[index] = chunk_logps
        if compute_entropy:
            entropies[index] = chunk_entropies
        prefills += len(chunk)
    return logps, entropies, n, prefills


def _full(trainer, batch: dict[str, Any], compute_entropy: bool):
    """The full form: the whole round masked (one draw per prompt), one forward per completion, in the parent's
    own chunks of ``per_device_train_batch_size`` rows."""
    positional, vlm_kwargs = logp_call_arguments(batch)
    vlm_kwargs["pixel_values"] = trainer.masked_pixel_values(batch)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model,
        *positional,
        batch_size=trainer.args.per_device_train_batch_size,
        compute_entropy=compute_entropy,
        **vlm_kwargs,
    )
    return logps, entropies


@torch.no_grad()
def masked_branch_entries(trainer, batch: dict[str, Any]) -> dict[str, Any]:
    """What the rollout pass adds to the parent's generation batch: the masked branch of every completion with an
    image, and the owner tag; nothing for a round without images (its perception term is 0, no forward needed)."""
    has_images = batch.get("pixel_values") is not None
    # Every rank calls it (one all-reduce); it refuses a round with images on some ranks only under FSDP, whose
    # vision all-gathers would not pair. Under DDP this pass calls the unwrapped model, so a text-only rank owes
    # the others no forward.
    trainer._images_on_any_rank(has_images)
    if not has_images:
        return {}
    with trainer.masked_branch_clock.timing():
        compute_entropy = trainer.args.entropy_estimator == "full"
        plan = trainer.masked_forward_plan
        if plan.shared and batch.get("image_grid_thw") is not None:
            logps, entropies, completions, prefills = _shared(trainer, batch, compute_entropy)
            shared_prefix.record(trainer, True, plan.reason + ", once per generation round", completions / prefills)
        else:
            logps, entropies = _full(trainer, batch, compute_entropy)
            shared_prefix.record(trainer, False, plan.reason, None)
    entries = {MASKED_LOGPS_KEY: logps, OWNER_KEY: torch.tensor(trainer.masked_branch_owner)}
    if entropies is not None:
        entries[MASKED_ENTROPIES_KEY] = entropies
    return entries
