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
rank's share is no longer a run of whole groups), and a sharded model (FSDP2's ``fully_shard``, DeepSpeed ZeRO-3)
all-gathers its parameters in every forward, so every rank must call the model equally often: the packed path's
calls per log-prob call are its chunks of whole groups, which differ between ranks where a prompt occurs twice in a
rank's round (or one rank's call takes the plain path), so a sharded model runs the plain path. DDP needs no such
pairing of calls beyond what it has: the loss's gradient forward, the one call through its wrapper (which broadcasts
buffers), is one model call on every rank packed or plain (TRL passes it no ``batch_size``: one chunk).
"""

from __future__ import annotations

from ..fsdp import partitioning


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


def sharded_model_reason(model, processes: int) -> str | None:
    """Why ``model`` as it is now cannot take the packed path across ``processes`` (its parameters partitioned, so
    every rank's forwards must pair), or None."""
    if processes <= 1:
        return None
    partitioned_by = partitioning([p for p in model.parameters() if p.requires_grad])
    if partitioned_by is None:
        return None
    return (
        f"the model is sharded by {partitioned_by} over {processes} processes: each forward all-gathers its "
        "parameters, so every rank must call the model equally often, and the packed path's calls follow each "
        "rank's own prompt groups"
    )


def described(processes: int) -> str:
    """What the forward plan says of the ranks where the packed path runs."""
    if processes <= 1:
        return ""
    return f"; {processes} processes, each rank packing the whole prompt groups it holds"
