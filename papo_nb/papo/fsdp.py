"""FSDP2 (``torch.distributed.fsdp.fully_shard``) parameters: whether a model's are shards, and this rank's piece.

Used by the masked branch (a sharded vision tower needs images on every rank) and by the probe (gradients of shards).
"""

from __future__ import annotations

import torch


def sharded(params: list[torch.Tensor]) -> bool:
    """Whether any trainable parameter is a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def local_piece(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p
