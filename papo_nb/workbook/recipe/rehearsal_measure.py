"""What the rehearsal (``rehearsal``) measures of a real PAPO-G trainer on the CPU, per part of the forecast
(``forecast.PARTS``), and the time of each phase:
- weights, gradients, optimizer, reference: the bytes of the tensors themselves (each storage once);
- activations: the tensors autograd saves during the loss call (``saved_tensors_hooks``), the full-vocabulary ones
  (last dimension the vocabulary) left to logprob_forward;
- logprob_forward and masked_forward: the peak bytes of live full-vocabulary tensors during a training step
  (forward and backward) and during the masked branch (``papo_nb.bench.memory.VocabTensorTracker``);
- generation: torch's allocation peak during ``model.generate`` (``papo_nb.bench.memory.allocation_peak``);
- round_tensors: the tensors of the round TRL buffers (``_buffered_inputs``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from papo_nb.bench.memory import VocabTensorTracker, allocation_peak


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
    def saved_activations(self, exclude: set[int]):
        """Records the bytes autograd saves inside the block, full-vocabulary tensors apart."""
        saved: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in exclude and not (t.dim() >= 2 and t.shape[-1] == self.vocab):
                saved[key] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak("activations", sum(saved.values()))

    @contextmanager
    def vocab_peak(self, part: str, exclude: set[int], full_rows: int):
        tracker = VocabTensorTracker(self.vocab, full_rows, exclude=exclude)
        with tracker:
            yield
        self.peak(part, tracker.peak_bytes)


def instrument(trainer, measurements: Measurements) -> None:
    """Wraps the trainer's phases (its training step, loss call, masked branch, the policy's ``generate`` and the
    optimizer step) with the measurements; the trainer's own code runs unchanged inside."""
    from transformers import TrainerCallback

    m = measurements
    params = m.parameter_storages(trainer.model, getattr(trainer, "ref_model", None))
    rows = trainer.args.per_device_train_batch_size

    compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward
    tracker = {}

    def measured_compute_loss(*args, **kwargs):
        # One tracker per micro-step, entered for the loss forward and again for its backward: the full-vocabulary
        # tensors the forward keeps for the backward stay counted while they live.
        tracker["now"] = VocabTensorTracker(m.vocab, rows, exclude=params)
        with m.timed("loss_forward"), m.saved_activations(params), tracker["now"]:
            return compute_loss(*args, **kwargs)

    def measured_backward(loss, **kwargs):
        with m.timed("backward"), tracker["now"]:
            result = backward(loss, **kwargs)
        m.peak("logprob_forward", tracker["now"].peak_bytes)
        return result

    trainer.compute_loss, trainer.accelerator.backward = measured_compute_loss, measured_backward
    branch = trainer.masked_branch
    for name in ("rollout_entries", "compute"):
        original = getattr(branch, name)

        def measured_branch(*args, _original=original, **kwargs):
            with m.timed("masked_branch"), m.vocab_peak("masked_forward", params, rows):
                return _original(*args, **kwargs)

        setattr(branch, name, measured_branch)
    policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    generate = policy.generate

    def measured_generate(*args, **kwargs):
        result = {}
        with m.timed("generation"):
            peak = allocation_peak(lambda: result.setdefault("out", generate(*args, **kwargs)))
        m.peak("generation", peak["peak_bytes"])
        return result["out"]

    policy.generate = measured_generate

    class StateBytes(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            m.peak("gradients", storage_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None))
            m.peak("round_tensors", storage_bytes(nested_tensors(trainer._buffered_inputs)))
            self.started = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            m.seconds["optimizer_step"] += time.perf_counter() - self.started
            m.peak("optimizer", storage_bytes(nested_tensors(list(trainer.optimizer.state.values()))))

    trainer.add_callback(StateBytes())


def state_bytes(trainer, measurements: Measurements) -> None:
    """Weights (the policy's parameters, frozen ones included) and the reference model's, after training."""
    measurements.peak("weights", storage_bytes(trainer.model.parameters()))
    ref = getattr(trainer, "ref_model", None)
    measurements.peak("reference", storage_bytes(ref.parameters()) if ref is not None else 0)
    measurements.peak("probe", 0)
