"""The probe's measurement of one batch: the gradients (parent, zero-gamma, each PAPO term, a roundoff sample), reduced
across ranks, and every number both tests decide on. The verdict is ``probe.GammaZeroProbe``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...prefix_sharing.fsdp import local_piece, sharded
from . import projection as probe_projection
from . import reduce as probe_reduce
from . import roundoff as probe_roundoff
from .blocks import Blocks, parameter_blocks
from .contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from .threshold import FALSE_ALARM_RATE

GRADIENT_NORMS = ("parent_grad_norm", "zero_gamma_grad_norm", "grad_diff_norm", "perception_grad_norm")


class ProbeFailure(RuntimeError):
    """The adapter failed the gamma-zero reduction or liveness check."""


def gradient_tolerance(
    parent_grad_norm: float,
    rel_tol: float = GAMMA_ZERO_GRADIENT_REL_TOL,
    abs_floor: float = GAMMA_ZERO_GRADIENT_ABS_FLOOR,
) -> float:
    return max(rel_tol * parent_grad_norm, abs_floor)


def _autocast_state() -> tuple[bool, str | None]:
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return True, str(torch.get_autocast_dtype(device)).replace("torch.", "")
    return False, None


def _precision(parent_loss: torch.Tensor) -> dict[str, Any]:
    """What the batch's numbers were computed in: the loss dtype, autocast, and the TRL release."""
    import trl

    autocast_enabled, autocast_dtype = _autocast_state()
    return dict(
        dtype=str(parent_loss.dtype).replace("torch.", ""),
        autocast_enabled=autocast_enabled,
        autocast_dtype=autocast_dtype,
        trl_version=trl.__version__,
    )


def _mean_perception_kl(trainer, terms) -> float:
    """The batch's perception KL per completion token, its sums reduced over every rank."""
    totals = trainer.accelerator.reduce(
        torch.stack([terms.kl_sum, terms.token_count]).detach().float(), reduction="sum"
    )
    return (totals[0] / totals[1].clamp(min=1.0)).item()


# Roundoff samples per stage. "repeat" (training) first takes 2 repeats of the parent gradient; only a batch that
# is not powered with them (a Student-t floor from 2 samples needs about 100 floors) takes 6 more, so a GPU run in
# fp32 (or the CPU, whose repeats are exact) pays what it paid before, and a bf16 GPU run gets a floor with 8 degrees
# of freedom. Each stage spends half of the false-alarm budget. "reordered" (calibration) takes its 8 at once.
ROUNDOFF_STAGES = {"repeat": (2, 8), "reordered": (probe_roundoff.REORDERED_SAMPLES,)}


@dataclass
class ProbeGradients:
    """Every gradient both tests need, reduced to the rank mean: g_parent, one g_zero per assembly, the difference
    each injected ``RECIPE_GAMMA`` leak makes (per term with graph, on the first assembly), the terms' gradients (None
    without graph), the roundoff samples, the squared magnitudes the tested sum rounds at, the blocks of the flat
    vectors, and whether the parameters are FSDP2 shards."""

    g_parent: torch.Tensor
    g_zeros: list[torch.Tensor]
    injected: dict[str, torch.Tensor]
    term_grads: dict[str, torch.Tensor | None]
    samples: list[torch.Tensor]
    magnitude: torch.Tensor
    blocks: Blocks
    shards: bool


def _rank_mean(trainer, vectors: list[torch.Tensor], shards: bool) -> list[torch.Tensor]:
    """DDP: all-reduce to the rank mean (FSDP's shards already hold it; one process has nothing to reduce)."""
    if trainer.accelerator.num_processes == 1 or shards or not vectors:
        return vectors
    return list(trainer.accelerator.reduce(torch.stack(vectors), reduction="mean"))


def probe_gradients(trainer, model, parent_loss, terms, assembles, inputs, roundoff, samples: int):
    """The ``ProbeGradients`` of one batch with ``samples`` roundoff samples, and a function that measures more
    repeats of the parent gradient (``"repeat"`` only: the graph is still held)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    shards = sharded(params)
    if shards:  # FSDP2: one backward per loss, FSDP reduce-scatters each to the rank mean (reduce.py)
        if roundoff != "repeat":
            raise ValueError(f"probe roundoff={roundoff!r} runs unsharded only; allowed under FSDP2: 'repeat'")

        def backward(tensors):
            return probe_reduce.shard_gradients(list(tensors), params)
    else:

        def backward(tensors):
            return [probe_roundoff.flat_grad(t, params) for t in tensors]

    blocks = parameter_blocks((n, local_piece(p).numel()) for n, p in named)
    term_grads = probe_projection.term_gradients(terms, backward)
    names = [n for n, g in term_grads.items() if g is not None]
    every = [*assembles, *[probe_projection.leak_assembly(assembles[0], n) for n in names]]
    if roundoff == "repeat":
        losses = [a(parent_loss, terms, 0.0, 0.0, 0.0) for a in every]
        g_parent, *rest = backward([parent_loss, *losses, *[parent_loss] * samples])
        g_zeros, repeats = rest[: len(every)], [g - g_parent for g in rest[len(every) :]]
        magnitude = g_parent * g_parent
    else:
        (g_parent,) = backward([parent_loss])
        g_zeros, repeats, magnitude = probe_roundoff.reordered_gradients(
            trainer, model, inputs, params, every, parent_loss, g_parent, samples
        )
    reduced = _rank_mean(trainer, [g_parent, *g_zeros, *repeats, magnitude, *[term_grads[n] for n in names]], shards)
    g_parent, rest = reduced[0], reduced[1:]
    g_zeros, repeats, rest = rest[: len(every)], rest[len(every) : len(every) + samples], rest[len(every) + samples :]
    magnitude, *reduced_terms = rest
    term_grads.update(zip(names, reduced_terms))

    def more_samples(n: int) -> list[torch.Tensor]:
        return [g - g_parent for g in _rank_mean(trainer, backward([parent_loss] * n), shards)]

    gradients = ProbeGradients(
        g_parent,
        g_zeros[: len(assembles)],
        {n: g - g_parent for n, g in zip(names, g_zeros[len(assembles) :])},
        term_grads,
        repeats,
        magnitude,
        blocks,
        shards,
    )
    return gradients, more_samples


def _leak_tests(gradients: ProbeGradients, tolerance: float, reduce_sums, rate: float):
    g = gradients
    return probe_projection.leak_tests(
        [z - g.g_parent for z in g.g_zeros],
        g.injected,
        g.g_parent,
        g.samples,
        g.magnitude,
        g.term_grads,
        tolerance,
        reduce_sums,
        g.blocks,
        rate,
    )


def staged_leak_tests(gradients: ProbeGradients, more_samples, stages, tolerance: float, reduce_sums):
    """The projection test at the first stage's samples; when that leaves the first assembly without a leak seen but
    unpowered (whole terms, or a block holding ``BLOCK_SHARE`` of a term), more samples and the test again (each
    stage at half the budget: together at most the budget)."""
    rate = FALSE_ALARM_RATE / len(stages)
    tests = _leak_tests(gradients, tolerance, reduce_sums, rate)
    for count in stages[1:]:
        first = tests.terms[0]
        seen = any(e.get("leak_seen") for e in first.values()) or probe_projection.block_leaks(tests.blocks[0])
        if seen or (probe_projection.powered(first) and probe_projection.blocks_powered(tests.blocks[0])):
            break
        gradients.samples += more_samples(count - len(gradients.samples))
        tests = _leak_tests(gradients, tolerance, reduce_sums, rate)
    return tests


def measure_gamma_zero_variants(
    trainer,
    model,
    parent_loss: torch.Tensor,
    terms,
    assembles: list[Callable],
    *,
    inputs: dict[str, Any] | None = None,
    roundoff: str = "repeat",
) -> list[dict[str, Any]]:
    """``measure_gamma_zero`` for several assemblies of the same batch, sharing the parent gradient, the terms'
    gradients and the roundoff sample (one number dict per assembly)."""
    _check_probe_request(model, roundoff, inputs)
    stages = ROUNDOFF_STAGES[roundoff]
    gradients, more_samples = probe_gradients(
        trainer, model, parent_loss, terms, assembles, inputs, roundoff, stages[0]
    )
    norm, reduce_sums = _reducers(bool(gradients.shards))
    g_parent, perception = gradients.g_parent, gradients.term_grads["perception_kl"]
    parent_norm, perception_norm = norm([g_parent, perception if perception is not None else 0 * g_parent])
    tolerance = gradient_tolerance(parent_norm)
    tests = staged_leak_tests(gradients, more_samples, stages, tolerance, reduce_sums)
    sample_norms = norm(gradients.samples)
    sample_norm = math.sqrt(sum(n * n for n in sample_norms) / len(sample_norms))  # root mean square
    gamma = float(trainer.current_gamma()) if hasattr(trainer, "current_gamma") else 0.0
    batch = dict(
        parent_grad_norm=parent_norm,
        tolerance=tolerance,
        perception_kl=_mean_perception_kl(trainer, terms),
        perception_grad_norm=perception_norm,
        leak_detection_power=perception_norm / tolerance,
        gamma=gamma,
        gamma_leak_detection_power=gamma * perception_norm / tolerance,
        roundoff_mode=roundoff,
        roundoff_samples=tests.samples,
        roundoff_norm=sample_norm,  # root mean square over the samples
        roundoff_relative=sample_norm / parent_norm if parent_norm > 0 else 0.0,
        detection_threshold=tests.threshold,
        tests=tests.tests,
        false_alarm_rate=FALSE_ALARM_RATE,
        **_precision(parent_loss),
    )
    return [
        _assembly_numbers(
            trainer, assemble(parent_loss, terms, 0.0, 0.0, 0.0), parent_loss, g_zero, g_parent, leaks, norm, batch
        )
        | {
            "block_leaks": blocks,
            "blocks_powered": probe_projection.blocks_powered(blocks),
            **probe_projection.block_summary(blocks),
        }
        for assemble, g_zero, leaks, blocks in zip(assembles, gradients.g_zeros, tests.terms, tests.blocks)
    ]


def _check_probe_request(model, roundoff: str, inputs) -> None:
    probe_roundoff.check_mode(roundoff)
    if roundoff == "reordered" and inputs is None:
        raise ValueError("probe roundoff='reordered' re-runs the batch in chunks: pass the batch as inputs=")
    if not any(p.requires_grad for p in model.parameters()):
        raise ProbeFailure(
            "the model has no trainable parameters: nothing to probe (was the adapter loaded with is_trainable=False?)"
        )


def _reducers(sharded: bool) -> tuple[Callable, Callable]:
    """``(norms, sums)`` over the gradient pieces: sharded, every rank holds disjoint pieces, so norms and dot
    products sum over the ranks (one all-reduce each)."""
    if sharded:
        return probe_reduce.global_norms, probe_reduce.global_sums
    return (lambda vs: [torch.linalg.vector_norm(v).item() for v in vs]), (lambda t: t)


def _zero_gamma_values(trainer, zero_gamma_loss, parent_loss, device) -> tuple[float, float, bool]:
    """``(parent loss, zero-gamma loss, bit equal)``, as rank means and equal on every rank."""
    parent_value, zero_value = parent_loss.item(), zero_gamma_loss.item()
    # In float64 so that a bf16 parent loss and its fp32 sum with the (fp32) PAPO terms compare by value, exactly.
    loss_bit_equal = bool(torch.equal(zero_gamma_loss.detach().double(), parent_loss.detach().double()))
    processes = trainer.accelerator.num_processes
    if processes > 1:  # the losses are rank means; bit equality must hold on every rank
        losses = trainer.accelerator.reduce(
            torch.tensor([parent_value, zero_value, float(not loss_bit_equal)], dtype=torch.float64, device=device),
            reduction="sum",
        )
        parent_value, zero_value = (losses[:2] / processes).tolist()
        loss_bit_equal = losses[2].item() == 0
    return parent_value, zero_value, loss_bit_equal


def _assembly_numbers(trainer, zero_gamma_loss, parent_loss, g_zero, g_parent, leaks, norm, batch) -> dict[str, Any]:
    """One assembly's numbers: its losses and difference, its term leaks, and the batch's shared ``batch``."""
    mean_parent, zero_value, loss_bit_equal = _zero_gamma_values(
        trainer, zero_gamma_loss, parent_loss, g_parent.device
    )
    parent_norm, tolerance = batch["parent_grad_norm"], batch["tolerance"]
    zero_norm, diff = norm([g_zero, g_zero - g_parent])
    tested = [e for e in leaks.values() if e["testable"]]
    numbers = {
        "parent_loss": mean_parent,
        "zero_gamma_loss": zero_value,
        "loss_bit_equal": loss_bit_equal,
        "parent_grad_norm": parent_norm,
        "zero_gamma_grad_norm": zero_norm,
        "grad_diff_norm": diff,
        "grad_diff_relative": diff / parent_norm if parent_norm > 0 else (0.0 if diff == 0 else math.inf),
        "tolerance": tolerance,
        "norm_statistic": diff / tolerance,
        **{k: batch[k] for k in ("perception_kl", "perception_grad_norm", "leak_detection_power", "gamma")},
        **{k: batch[k] for k in ("gamma_leak_detection_power", "roundoff_mode", "roundoff_norm", "roundoff_relative")},
        **{k: batch[k] for k in ("roundoff_samples", "detection_threshold", "tests", "false_alarm_rate")},
        "term_leaks": leaks,
        "projection_statistic": max((e["statistic"] for e in tested), default=None),
        "perception_detectable_coefficient": leaks["perception_kl"].get("detectable_coefficient"),
        "weakest_margin_at_recipe_gamma": min((e["margin_at_recipe_gamma"] for e in tested), default=None),
        "powered": probe_projection.powered(leaks),
    }
    return {**numbers, **{k: batch[k] for k in ("dtype", "autocast_enabled", "autocast_dtype", "trl_version")}}


def measure_gamma_zero(
    trainer,
    model,
    parent_loss: torch.Tensor,
    terms,
    assemble: Callable | None = None,
    *,
    inputs: dict[str, Any] | None = None,
    roundoff: str = "repeat",
) -> dict[str, Any]:
    """The reduction and liveness numbers for one batch (no verdict). ``assemble`` defaults to the trainer's;
    ``roundoff`` says where the roundoff sample comes from (``roundoff.py``; "reordered" needs ``inputs``)."""
    assemble = assemble or trainer.assemble_loss
    (numbers,) = measure_gamma_zero_variants(
        trainer, model, parent_loss, terms, [assemble], inputs=inputs, roundoff=roundoff
    )
    return numbers
