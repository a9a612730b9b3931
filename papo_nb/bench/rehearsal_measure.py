"""What the rehearsal (``rehearsal``, ``rehearsal_step``) measures on the CPU, per part of the forecast
(``forecast.PARTS``), and the time of each phase:
- weights, gradients, optimizer, reference: the bytes of the tensors themselves (each storage once);
- activations: the tensors autograd saves during the loss forward (``saved_tensors_hooks``), the full-vocabulary
  ones (last dimension the vocabulary) left to logprob_forward;
- logprob_forward: the full-vocabulary tensors alive together at the backward's start: those the loss forward saved
  for the backward, the fp32 logits' gradient and its bf16 cast (tensor hooks); masked_forward: the bf16 logits and
  their fp32 copy of the no-grad forward (``papo_nb.bench.memory.VocabTensorTracker`` is not used: under its
  dispatch mode the CPU lm_head took minutes and 10 GB at the Qwen vocabulary);
- generation: torch's allocation peak during ``model.generate`` (``papo_nb.bench.memory.allocation_peak``);
- round_tensors: the round's tensors (pixel values, ids, masks).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from contextlib import contextmanager

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (a view or a tied weight counts once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def nested_tensors(value):
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from nested_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from nested_tensors(v)


class Measurements:
    """Peaks per part (max over the calls seen) and seconds per phase (summed)."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.parts: dict[str, float] = defaultdict(float)
        self.seconds: dict[str, float] = defaultdict(float)

    def peak(self, part: str, value: float) -> None:
        self.parts[part] = max(self.parts[part], float(value))

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def parameter_storages(self, *models) -> set[int]:
        return {p.untyped_storage().data_ptr() for m in models if m is not None for p in m.parameters()}

    @contextmanager
    def saved_activations(self, exclude: set[int], part: str = "activations"):
        """Records the bytes autograd saves inside the block as ``part``, full-vocabulary tensors apart."""
        saved: dict[int, int] = {}
        vocab: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in exclude:
                (vocab if t.dim() >= 2 and t.shape[-1] == self.vocab else saved)[key] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield vocab
        if os.environ.get("PAPO_NB_REHEARSAL_DEBUG"):
            print(part, sorted(saved.values(), reverse=True)[:12], flush=True)
        self.peak(part, sum(saved.values()))
