"""The probe's blocks: named parameter groups whose piece of ``g_zero - g_parent`` is tested on its own.

A leak that reaches only part of the weights (one layer, the vision merger, the LM head) adds ``c * grad T`` there
and nothing elsewhere; the fit over a term's whole gradient sees it as ``f * c``, with ``f`` the block's share of the
term's squared norm, so a 0.02 leak in a 1% block looks like 2e-4. Fitted within the block it is 0.02 again, against
the block's own (larger) floor. A block is the module that owns a parameter, with PEFT's wrappers removed: both
factors of one LoRA layer form one block (``...layers.3.self_attn.q_proj``), a ``modules_to_save`` copy is its
module.

The flat gradient vectors concatenate the parameters in ``model.parameters()`` order (``roundoff.flat_grad``; on
FSDP2 shards each rank's local pieces in the same order), so a block is a set of contiguous segments of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_PEFT_PARTS = re.compile(r"\.(lora_[AB]|lora_embedding_[AB]|modules_to_save|original_module)\.[^.]+|\.base_layer")
_LEAF = re.compile(r"\.(weight|bias|lora_magnitude_vector\.[^.]+)$")
_PEFT_PREFIX = "base_model.model."


def block_name(parameter_name: str) -> str:
    """The named parameter group of a parameter: its owning module, PEFT's adapter wrappers removed."""
    name = parameter_name.removeprefix(_PEFT_PREFIX)
    return _LEAF.sub("", _PEFT_PARTS.sub("", name)) or name


@dataclass(frozen=True)
class Blocks:
    """``names`` in first-seen order and ``segments`` ``(start, stop, block index)`` of the flat vectors."""

    names: tuple[str, ...]
    segments: tuple[tuple[int, int, int], ...]

    @property
    def size(self) -> int:
        return self.segments[-1][1] if self.segments else 0

    def segment_index(self) -> torch.Tensor:
        return torch.tensor([b for _, _, b in self.segments], dtype=torch.long)


def whole(size: int) -> Blocks:
    """One block of everything: the whole-gradient fit alone."""
    return Blocks(("all",), ((0, size, 0),))


def parameter_blocks(named_sizes: Iterable[tuple[str, int]]) -> Blocks:
    """The blocks of parameters given as ``(name, number of elements in the flat vector)``, in flat order;
    consecutive parameters of one block share a segment."""
    names: dict[str, int] = {}
    segments: list[list[int]] = []
    start = 0
    for name, size in named_sizes:
        block = names.setdefault(block_name(name), len(names))
        if segments and segments[-1][2] == block and segments[-1][1] == start:
            segments[-1][1] += size
        else:
            segments.append([start, start + size, block])
        start += size
    return Blocks(tuple(names), tuple(tuple(s) for s in segments))
