"""The masked branch once per generation round (``masked_branch="rollout"``), as the official code computes it.

The official trainer computes the masked log-probs once per rollout batch, right after ``old_log_probs`` and before
the update loop, under no-grad with the rollout-time policy
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/trainer/ray_trainer.py#L759-L769,
https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L193-L231). Here the trainer's
``_generate_and_score_completions`` calls the parent's and hands its batch to ``MaskedBranch.rollout_entries``
(``masked_branch.py``), which computes the round with ``shared_round`` or ``full_round`` below and adds
the masked per-token log-probs (and, for the full-vocabulary estimator, the masked entropies) under
``MASKED_LOGPS_KEY`` / ``MASKED_ENTROPIES_KEY``. TRL then shuffles, splits and buffers them with the rest of the round,
as it does ``old_per_token_logps`` (https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L1572-L1579).

Before that shuffle a process holds each prompt's G rollouts side by side (TRL's RepeatSampler order), so the shared
prompt prefix serves all G completions of a prompt with one prefill, and the masked pixels are built once per
distinct prompt. The round is processed in chunks of whole prompts of at most ``per_device_train_batch_size`` rows
(at least one prompt's G), the bound TRL uses for ``old_per_token_logps``; under several processes the chunks are
fixed row ranges, so every rank runs the same number of forwards (a forward is a collective under FSDP).

A batch remembers which trainer's round it belongs to (``OWNER_KEY``, a 0-d tensor that the split and the shuffle
pass through, set on every round, text-only ones too): another trainer, with other masks or another forward,
computes its own, and a batch of this trainer's round with images but no branch is refused (a copy of the batch
keeps the tag). Each row also carries a check of its tokens (``ROW_CHECK_KEY``: a hash of its prompt and completion
ids, ``row_checks``), verified where the branch is consumed: a release of TRL that permuted only the keys it knows
would otherwise misalign the stored rows without a word.
"""

from __future__ import annotations

from typing import Any

import torch

from ..prefix_sharing.common import whole_group_chunks
from ..prefix_sharing.image_rows import sample_row_ranges
from . import prefill
from .logp_inputs import logp_call_arguments

MASKED_LOGPS_KEY = "papo_masked_logps"
MASKED_ENTROPIES_KEY = "papo_masked_entropies"
OWNER_KEY = "papo_masked_owner"
ROW_CHECK_KEY = "papo_masked_row_check"
# Fixed odd multipliers of the row hash, one per token position (int64 arithmetic wraps; the same on every device).
_HASH_SEED = 0x9E3779B9


def row_checks(batch: dict[str, Any]) -> torch.Tensor:
    """One int64 per row: a hash of its prompt and completion ids (padding included), where the ids live."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1).long()
    generator = torch.Generator().manual_seed(_HASH_SEED)
    weights = torch.randint(-(2**62), 2**62, (ids.shape[1],), generator=generator, dtype=torch.long) | 1
    return (ids * weights.to(ids.device)).sum(dim=1)


def chunks(groups: list[list[int]], n_rows: int, rows_per_device: int, processes: int) -> list[list[list[int]]]:
    """Chunks of the round, each a list of groups (rows of one prompt): whole prompts of at most
    ``rows_per_device`` rows (at least one prompt) on one process; fixed row ranges (a prompt cut at a boundary is
    prefilled in both) under several."""
    if processes == 1:
        return whole_group_chunks(groups, max(rows_per_device, max(len(g) for g in groups)))
    group_of = {row: g for g, rows in enumerate(groups) for row in rows}
    out = []
    for start in range(0, n_rows, rows_per_device):
        by_group: dict[int, list[int]] = {}
        for row in range(start, min(start + rows_per_device, n_rows)):
            by_group.setdefault(group_of[row], []).append(row)
        out.append(list(by_group.values()))
    return out


def _group_pixels(sub: dict[str, Any], local_groups: list[list[int]], mask_pixels) -> list[torch.Tensor] | None:
    """Each group's masked pixel rows, the masks drawn on the group's first row only (one draw per prompt)."""
    if sub.get("pixel_values") is None:
        return None
    firsts = prefill.select_rows(sub, [g[0] for g in local_groups])
    masked = mask_pixels(firsts)
    ranges = sample_row_ranges(firsts["image_grid_thw"], firsts["num_images"])
    return [masked[a:b] for a, b in ranges]


def shared_round(
    model, batch: dict[str, Any], mask_pixels, temperature: float, compute_entropy: bool, rows: int, processes: int
):
    """The shared-prefix form: per chunk, each distinct prompt masked once and prefilled once. Returns
    ``(logps, entropies, completions, prefills)``."""
    n = len(batch["prompt_ids"])
    groups = prefill.prompt_groups(batch, batch.get("pixel_values"))
    logps = entropies = None
    prefills = 0
    for chunk in chunks(groups, n, rows, processes):
        chunk_rows = [row for group in chunk for row in group]
        sub = prefill.select_rows(batch, chunk_rows)
        position = {row: k for k, row in enumerate(chunk_rows)}
        local_groups = [[position[row] for row in group] for group in chunk]
        chunk_logps, chunk_entropies = prefill.shared_prefix_logps(
            model,
            sub,
            None,
            temperature=temperature,
            compute_entropy=compute_entropy,
            groups=local_groups,
            max_chunk_rows=len(chunk_rows),
            group_pixel_values=_group_pixels(sub, local_groups, mask_pixels),
        )
        if logps is None:
            logps = chunk_logps.new_empty((n, chunk_logps.shape[1]))
            entropies = logps.new_empty(logps.shape) if compute_entropy else None
        index = torch.tensor(chunk_rows, device=logps.device)
        logps[index] = chunk_logps
        if compute_entropy:
            entropies[index] = chunk_entropies
        prefills += len(chunk)
    return logps, entropies, n, prefills


def full_round(model, batch: dict[str, Any], mask_pixels, logps_of, compute_entropy: bool, rows: int):
    """The full form: the whole round masked (one draw per prompt), one forward per completion, in the parent's
    own chunks of ``rows`` (``per_device_train_batch_size``) rows; ``logps_of`` is the parent's log-prob method."""
    positional, vlm_kwargs = logp_call_arguments(batch)
    vlm_kwargs["pixel_values"] = mask_pixels(batch)
    logps, entropies, _ = logps_of(
        False, model, *positional, batch_size=rows, compute_entropy=compute_entropy, **vlm_kwargs
    )
    return logps, entropies
