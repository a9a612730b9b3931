"""Sharded parameters: FSDP2 (``torch.distributed.fsdp.fully_shard``) DTensors and DeepSpeed ZeRO-3 partitions.

Used by the masked branch (a sharded vision tower needs images on every rank) and by the probe (gradients of shards).
"""

from __future__ import annotations

import torch

# What DeepSpeed's ``zero.Init`` sets on every parameter it partitions (``_convert_to_deepspeed_param`` in
# deepspeed/runtime/zero/partition_parameters.py): an id and a status, the full tensor gathered only in a forward.
ZERO3_PARAMETER_ATTRIBUTES = ("ds_id", "ds_status")


def sharded(params: list[torch.Tensor]) -> bool:
    """Whether any trainable parameter is a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def partitioning(params: list[torch.Tensor]) -> str | None:
    """``"FSDP"`` or ``"DeepSpeed ZeRO-3"`` when a forward of these parameters all-gathers them (every rank must run
    the same modules), else None."""
    if sharded(params):
        return "FSDP"
    if any(all(hasattr(p, name) for name in ZERO3_PARAMETER_ATTRIBUTES) for p in params):
        return "DeepSpeed ZeRO-3"
    return None


def local_piece(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p
