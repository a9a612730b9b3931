"""Prefix sharing with several processes: each rank packs the whole prompt groups it holds, and where a rank's
share of a round cannot hold whole groups, or the model's forwards must pair across ranks, the plain path runs.

Why a rank holds whole groups (TRL 1.9.1, read in ``GRPOTrainer``): ``RepeatSampler`` yields each prompt index
``num_generations`` (G) times in a row, ``generation_batch_size / G`` prompts a round; the dataloader cuts that
stream into batches of ``per_device_train_batch_size * steps_per_generation`` rows and accelerate hands process
``r`` every ``r``-th one (``BatchSamplerShard``; an iterable dataset's dispatcher slices the same contiguous rows),
so where ``per_device_train_batch_size`` is a multiple of G each rank's round is whole groups. The advantages are
computed on the gathered round, group by group, then sliced back to the rank's rows (``process_slice`` in
``_generate_and_score_completions``): sharing does not change them. TRL then shuffles each rank's round row by row
and cuts it into ``steps_per_generation`` micro-batches (``_prepare_inputs``), which splits groups; sharing shuffles
it by whole blocks (``prefix_sharing.shuffle_whole_blocks``, the same draw), so each micro-batch of a multiple of G
rows holds whole groups on every rank.

Where it cannot: ``accelerator_config.split_batches=True`` cuts each dataloader batch across the processes (a
rank's share is no longer a run of whole groups), so the plain path runs. A sharded model (FSDP2's ``fully_shard``,
DeepSpeed ZeRO-3) all-gathers its parameters in every forward, so every rank must call the model equally often: the
packed path's calls per log-prob call are its chunks of whole groups, which differ between ranks where a prompt
occurs twice in a rank's round, and a rank's call may take the plain path for a reason of its own. So under a sharded
model the ranks agree on every call (``agreed_reason``: one all-reduce) and pack only where all of them pack in as
many chunks, and ``"auto"``'s first-batch check passes only where it passes on every rank (``all_ranks``). DDP needs
no such agreement: the loss's gradient forward, the one call through its wrapper (which broadcasts buffers), is one
model call on every rank packed or plain (TRL passes it no ``batch_size``: one chunk).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .fsdp import partitioning


def several_processes_reason(args, processes: int) -> str | None:
    """Why a run of ``processes`` with ``args`` (None: not known yet) cannot pack each rank's whole groups, or None."""
    if processes <= 1 or args is None:
        return None
    accelerator_config = getattr(args, "accelerator_config", None)
    if getattr(accelerator_config, "split_batches", False):
        return (
            f"accelerator_config.split_batches=True with {processes} processes: each device batch is split across "
            "the processes, so a rank's rows are not whole prompt groups"
        )
    return None


def paired_device(model, processes: int) -> torch.device | None:
    """Where ``model``'s forwards pair across ``processes`` ranks (its parameters partitioned by FSDP2 or ZeRO-3, so
    each forward all-gathers them): the device of the ranks' agreement (``agreed_reason``), else None."""
    if processes <= 1:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return params[0].device if partitioning(params) is not None else None


def agreed_reason(device: torch.device | None, reason: str | None, batches: list | None) -> str | None:
    """One log-prob call's reason for the plain path agreed by every rank (``device`` from ``paired_device``; None:
    this rank's ``reason`` as it is): the packed path runs only where every rank packs the call in as many chunks
    (``batches``: this rank's packed batches, None where it has a ``reason``), so every rank calls the model as often.
    A collective: every rank calls it for every log-prob call."""
    if device is None:
        return reason
    chunks = len(batches or ())
    votes = torch.tensor([int(reason is not None), chunks, -chunks], dtype=torch.long, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    plain_elsewhere, most, fewest = votes[0].item(), votes[1].item(), -votes[2].item()
    if reason is not None:
        return reason
    if plain_elsewhere:
        return "another rank runs this call's plain forward (a sharded model's forwards pair across the ranks)"
    if most != fewest:
        return (
            f"the ranks would pack this call in {fewest} to {most} chunks (a prompt twice in a rank's round): a "
            "sharded model's forwards pair across the ranks"
        )
    return None


def all_ranks(device: torch.device | None, passed: bool) -> bool:
    """Whether ``passed`` holds on every rank (``device`` from ``paired_device``; None: this rank's alone)."""
    if device is None:
        return passed
    vote = torch.tensor([int(not passed)], dtype=torch.long, device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return vote.item() == 0


def described(processes: int) -> str:
    """What the forward plan says of the ranks (``processes`` > 1) where the packed path runs."""
    return f"; {processes} processes, each rank packing the whole prompt groups it holds"
