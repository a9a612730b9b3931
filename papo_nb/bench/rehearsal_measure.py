"""What the rehearsal measures inside ``trainer.train()``, per part of the forecast (``forecast.PARTS``), and the time
of each phase; everything is attached to a built trainer from outside (a callback, module hooks, instance
attributes wrapping its methods) and none of it changes a number the trainer computes:
- weights, reference: the bytes of the model's and the reference model's parameters (each storage once);
- gradients: the trainable parameters' gradients at each optimizer step (``on_pre_optimizer_step``); optimizer: the
  optimizer's states after it (``on_optimizer_step``);
- activations: the tensors autograd saves during the loss call (``saved_tensors_hooks`` around ``compute_loss``),
  parameters and full-vocabulary tensors (last dimension the vocabulary) apart;
- logprob_forward: the full-vocabulary tensors alive at the loss call's backward: those it saved, plus the gradients
  of the model's output logits (fp32 under accelerate's ``convert_outputs_to_fp32``) and of the lm_head's bf16
  output (tensor hooks registered by forward hooks); masked_forward: per forward of the masked branch, the lm_head's
  output and the model's output logits (``papo_nb.bench.memory.VocabTensorTracker`` is not used: under its dispatch
  mode the CPU lm_head took minutes and 10 GB at the Qwen vocabulary);
- generation: torch's allocation peak during the model's ``generate`` (``papo_nb.bench.memory.allocation_peak``);
- round_tensors: the tensors of the round ``_generate_and_score_completions`` returns (pixels, ids, masks, log-probs).
Not measured: recompute (checkpointing's own saved-tensor hooks hide the recomputed layer's tensors from the outer
hooks, and the backward's allocation peak mixes them with the gradients), and the probe (neither file turns it on).
Phases timed: generation, masked_forward (in the round or in the loss call), round_logps (the rest of the round:
reference and old log-probs, prefix sharing's first-batch check, rewards), loss_forward, backward, optimizer_step.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from transformers import TrainerCallback

from papo_nb.bench.memory import allocation_peak


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
        self.lengths: dict[str, int] = {}  # the round's prompt tokens and patches per row, for the forecast

    def peak(self, part: str, value: float) -> None:
        self.parts[part] = max(self.parts[part], float(value))

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start


def wrap_method(owner, name: str, around):
    """``owner.name`` replaced on the instance by ``around(original, *args, **kwargs)``."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(functools.partial(around, original)))


class TrainerInstruments(TrainerCallback):
    """Attaches the measurements to ``trainer`` (``attach``); a callback for the optimizer step's parts."""

    def __init__(self, trainer, m: Measurements):
        self.trainer, self.m = trainer, m
        self.vocab_calls: list[int] | None = None  # bytes of each forward's vocabulary tensors, while a phase counts
        self.grad_bytes = 0
        self.phase_start = 0.0

    def attach(self) -> TrainerInstruments:
        trainer = self.trainer
        trainer.add_callback(self)
        model = trainer.model
        wrap_method(model, "generate", self.generate)
        wrap_method(trainer, "_generate_and_score_completions", self.round)
        wrap_method(trainer, "compute_loss", self.loss_call)
        wrap_method(trainer.accelerator, "backward", self.backward)
        branch = trainer.masked_branch
        wrap_method(branch, "compute", self.masked)
        wrap_method(branch, "rollout_entries", self.masked)
        model.get_output_embeddings().register_forward_hook(self.head_output)
        model.register_forward_hook(self.model_output)
        if trainer.ref_model is not None:
            self.m.peak("reference", storage_bytes(trainer.ref_model.parameters()))
        return self

    # ---- forward hooks: the full-vocabulary tensors of each forward ----
    def head_output(self, module, args, output):
        self.note_vocab(output)

    def model_output(self, module, args, output):
        logits = getattr(output, "logits", None)
        if logits is not None:
            self.note_vocab(logits)

    def note_vocab(self, tensor) -> None:
        if self.vocab_calls is not None:
            self.vocab_calls.append(storage_bytes([tensor]))
        if tensor.requires_grad:  # its gradient exists at the backward's start, beside what the forward saved
            tensor.register_hook(self.note_grad)

    def note_grad(self, grad) -> None:
        self.grad_bytes += storage_bytes([grad])

    # ---- wrapped methods ----
    def generate(self, original, *args, **kwargs):
        out = {}
        with self.m.timed("generation"):
            peak = allocation_peak(lambda: out.setdefault("ids", original(*args, **kwargs)))
        self.m.peak("generation", peak["peak_bytes"])
        return out["ids"]

    def round(self, original, *args, **kwargs):
        start, inner = time.perf_counter(), self.inner_seconds()
        batch = original(*args, **kwargs)
        # the round beyond generation and the masked branch: reference and old log-probs, rewards, advantages, and
        # prefix sharing's first-batch check
        self.m.seconds["round_logps"] += time.perf_counter() - start - (self.inner_seconds() - inner)
        self.m.peak("round_tensors", storage_bytes(nested_tensors(batch)))
        self.m.lengths = {
            "prompt_tokens": int(batch["prompt_ids"].shape[1]),
            "patches_per_row": int(batch["image_grid_thw"].prod(-1).max()),
        }
        return batch

    def inner_seconds(self) -> float:
        return self.m.seconds["generation"] + self.m.seconds["masked_forward"]

    def masked(self, original, *args, **kwargs):
        self.vocab_calls = []
        try:
            with self.m.timed("masked_forward"):
                return original(*args, **kwargs)
        finally:
            # per forward: the lm_head's bf16 output and the model's (fp32) output logits
            calls, self.vocab_calls = self.vocab_calls, None
            self.m.peak("masked_forward", max_pairs(calls))

    def loss_call(self, original, model, inputs, *args, **kwargs):
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}
        vocab: dict[int, int] = {}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in parameters:
                (vocab if t.dim() >= 2 and t.shape[-1] == self.m.vocab else saved)[key] = t.untyped_storage().nbytes()
            return t

        with self.m.timed("loss_forward"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = original(model, inputs, *args, **kwargs)
        self.m.peak("activations", sum(saved.values()))
        self.saved_vocab = sum(vocab.values())
        return loss

    def backward(self, original, *args, **kwargs):
        self.grad_bytes = 0
        with self.m.timed("backward"):
            result = original(*args, **kwargs)
        self.m.peak("logprob_forward", self.saved_vocab + self.grad_bytes)
        return result

    # ---- callback: the optimizer step ----
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainable = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.m.peak("gradients", storage_bytes(p.grad for p in trainable if p.grad is not None))
        self.phase_start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.m.seconds["optimizer_step"] += time.perf_counter() - self.phase_start
        self.m.peak("optimizer", storage_bytes(nested_tensors(list(self.trainer.optimizer.state.values()))))
        self.m.peak("weights", storage_bytes(self.trainer.model.parameters()))


def max_pairs(calls: list[int]) -> int:
    """The largest (lm_head output + model output logits) of one forward: the hooks record them in pairs."""
    return max((sum(calls[i : i + 2]) for i in range(0, len(calls), 2)), default=0)
