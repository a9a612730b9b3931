"""The probe's gradients and norms on FSDP2-sharded parameters (``torch.distributed.fsdp.fully_shard``).

Under FSDP2 a trainable parameter is a ``DTensor`` shard; the forward runs on an all-gathered copy that is not in
the autograd graph of the shard, so ``torch.autograd.grad(loss, shards)`` sees no path (it would return None, i.e.
zeros: a silent pass). The gradient reaches the shard only through FSDP's own backward hooks, which reduce-scatter
it into ``shard.grad`` as the mean over ranks: the gradient the optimizer applies, the same mean that the DDP path
of the probe all-reduces. So here each loss gets its own ``backward(retain_graph=True)``, this rank keeps its local
pieces (``grad.to_local()``), a norm is the square root of the sum over ranks of the local sums of squares, and a dot
product (the probe's projection test) the sum over ranks of the local dot products. Every rank ends with the same
numbers and so takes the same verdict.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...prefix_sharing.fsdp import local_piece


def shard_gradients(losses: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """For each loss, this rank's flat float64 piece of the rank-mean gradient (FSDP's reduce-scatter), one backward
    per loss. The parameters' ``.grad`` (a gradient being accumulated) is restored afterwards.

    Every rank must call this with the same number of losses: each backward is a collective."""
    saved = [p.grad for p in params]
    pieces = []
    try:
        for loss in losses:
            for p in params:
                p.grad = None
            if loss.requires_grad:  # a loss without graph on every rank: no backward, so no collective either
                loss.backward(retain_graph=True)
            pieces.append(
                torch.cat(
                    [
                        (torch.zeros_like(local_piece(p)) if p.grad is None else local_piece(p.grad))
                        .reshape(-1)
                        .double()
                        for p in params
                    ]
                )
            )
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return pieces


def global_norms(vectors: list[torch.Tensor]) -> list[float]:
    """The 2-norm of each vector whose disjoint pieces lie on the ranks: local sums of squares, all-reduced (sum),
    then the square root. One all-reduce for all of them."""
    squares = torch.stack([torch.sum(v * v) for v in vectors])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    return squares.sqrt().tolist()


def global_sums(local_sums: torch.Tensor) -> torch.Tensor:
    """Sums over parameters whose disjoint pieces lie on the ranks (dot products, Gram matrices): the local sums,
    all-reduced (sum) in one collective; a copy, the input is left as it was."""
    total = local_sums.clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total
