"""The gamma-zero reduction probe: run-time proof that the PAPO-G adapter is wired correctly.

Reduction half. ``zero_gamma_loss = trainer.assemble_loss(parent_loss, terms, 0, 0, 0)`` must equal the
parent loss bit for bit, and its gradient must equal the parent's up to roundoff:

    PASS iff ||g_zero - g_parent|| <= max(REL_TOL * ||g_parent||, ABS_FLOOR)

Both losses have the same value, so this compares two backward passes over graphs of different shape:
it catches an adapter whose zero-gamma path still lets perception gradient through (a leak), which a
value comparison cannot see.

Liveness half. ``perception_kl > 0`` and ``||grad perception_kl|| > 0``: the masked forward really
reaches the logits. A batch whose log-probs do not move under masking (mean KL exactly 0) is legitimate
but shows nothing, so the probe defers on it without paying for gradients; after
``max_degenerate_batches`` such batches in a row it fails. A batch without images is not counted.

Power. A leak adds about ``||grad perception_kl||`` to the gradient difference, so the check can only see a leak
when ``leak_detection_power = ||grad perception_kl|| / tolerance`` is at least 1. A batch below that is not a pass:
the probe defers it (counted apart from image-invariant batches) and looks at the next; after
``max_degenerate_batches`` such batches it ends with status ``"underpowered"`` (neither passed nor failed: the run
goes on, and the notebook verdict and an MLflow tag warn).

Several processes. Every input to a decision is reduced across ranks first (finiteness, images, KL sums, and
the three gradients, all-reduced to DDP's mean: the gradient the optimizer applies), so every rank defers,
passes or fails together and no rank is left waiting in a collective. One process reduces nothing. Under FSDP2
(sharded parameters) the gradients come from the shards and the norms are summed across ranks (probe_reduce.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import probe_reduce
from .contract import (
    GAMMA_ZERO_GRADIENT_ABS_FLOOR,
    GAMMA_ZERO_GRADIENT_REL_TOL,
    PAPO_ADAPTER_VERSION,
    PAPO_PROBE_MAX_DEGENERATE_BATCHES,
)

PASS_RULE = "||g_zero - g_parent|| <= max(REL_TOL * ||g_parent||, ABS_FLOOR)"

# Process-wide counts of probe work, so a run (or a benchmark) can prove how much probe code ran.
PROBE_CALLS = {"observe": 0, "measure": 0}


class ProbeFailure(RuntimeError):
    """The adapter failed the gamma-zero reduction or liveness check."""


def gradient_tolerance(
    parent_grad_norm: float,
    rel_tol: float = GAMMA_ZERO_GRADIENT_REL_TOL,
    abs_floor: float = GAMMA_ZERO_GRADIENT_ABS_FLOOR,
) -> float:
    return max(rel_tol * parent_grad_norm, abs_floor)


@dataclass
class ProbeEvidence:
    """Every number behind one probe verdict; ``to_dict()`` is JSON-ready."""

    status: str  # "passed", "failed", "pending" or "underpowered"
    message: str
    rule: str = PASS_RULE
    step: int | None = None
    parent_loss: float | None = None
    zero_gamma_loss: float | None = None
    loss_bit_equal: bool | None = None
    parent_grad_norm: float | None = None
    zero_gamma_grad_norm: float | None = None
    grad_diff_norm: float | None = None
    grad_diff_relative: float | None = None
    tolerance: float | None = None
    rel_tol: float = GAMMA_ZERO_GRADIENT_REL_TOL
    abs_floor: float = GAMMA_ZERO_GRADIENT_ABS_FLOOR
    perception_kl: float | None = None
    perception_grad_norm: float | None = None
    separation_ratio: float | None = None  # the same number as leak_detection_power (older name)
    leak_detection_power: float | None = None  # ||grad perception term|| / tolerance; < 1: a leak could hide
    gamma: float | None = None  # the run's gamma_t when measured
    gamma_leak_detection_power: float | None = None  # gamma_t * power: for a leak of the gamma-weighted term
    degenerate_batches_skipped: int = 0
    underpowered_batches_skipped: int = 0
    batches_without_images: int = 0
    dtype: str | None = None
    autocast_enabled: bool | None = None
    autocast_dtype: str | None = None
    trl_version: str | None = None
    adapter_version: str = PAPO_ADAPTER_VERSION

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def underpowered(self) -> bool:
        return self.status == "underpowered"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "underpowered": self.underpowered}


def _flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    if not loss.requires_grad:
        return torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double() for g, p in zip(grads, params)])


def _autocast_state() -> tuple[bool, str | None]:
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return True, str(torch.get_autocast_dtype(device)).replace("torch.", "")
    return False, None


def measure_gamma_zero(
    trainer, model, parent_loss: torch.Tensor, terms, assemble: Callable | None = None
) -> dict[str, Any]:
    """The reduction and liveness numbers for one batch (no verdict). ``assemble`` defaults to the trainer's."""
    import trl

    PROBE_CALLS["measure"] += 1
    assemble = assemble or trainer.assemble_loss
    zero_gamma_loss = assemble(parent_loss, terms, 0.0, 0.0, 0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ProbeFailure(
            "the model has no trainable parameters: nothing to probe (was the adapter loaded with is_trainable=False?)"
        )
    shards = probe_reduce.sharded(params)
    if shards:  # FSDP2: one backward per loss, FSDP reduce-scatters each to the rank mean (probe_reduce.py)
        g_parent, g_zero, g_perception = probe_reduce.shard_gradients(
            [parent_loss, zero_gamma_loss, terms.perception_kl], params
        )
    else:
        g_parent = _flat_grad(parent_loss, params)
        g_zero = _flat_grad(zero_gamma_loss, params)
        g_perception = _flat_grad(terms.perception_kl, params)
    parent_value, zero_value = parent_loss.item(), zero_gamma_loss.item()
    # In float64 so that a bf16 parent loss and its fp32 sum with the (fp32) PAPO terms compare by value, exactly.
    loss_bit_equal = bool(torch.equal(zero_gamma_loss.detach().double(), parent_loss.detach().double()))
    processes = trainer.accelerator.num_processes
    if processes > 1:
        # Several processes: the gradient the optimizer applies is DDP's mean of the per-rank gradients, so the
        # norms and the verdict are those of the all-reduced (mean) gradients, identical on every rank; the losses
        # are rank means, and bit equality must hold on every rank. One process: nothing is reduced.
        if not shards:  # FSDP's shards already hold the rank mean
            g_parent, g_zero, g_perception = trainer.accelerator.reduce(
                torch.stack([g_parent, g_zero, g_perception]), reduction="mean"
            )
        losses = trainer.accelerator.reduce(
            torch.tensor(
                [parent_value, zero_value, float(not loss_bit_equal)], dtype=torch.float64, device=g_parent.device
            ),
            reduction="sum",
        )
        parent_value, zero_value = (losses[:2] / processes).tolist()
        loss_bit_equal = losses[2].item() == 0
    # Sharded: every rank holds disjoint pieces, so each norm sums squares over the ranks (one all-reduce).
    norm = probe_reduce.global_norms if shards else lambda vs: [torch.linalg.vector_norm(v).item() for v in vs]
    parent_norm, zero_norm, diff, perception_norm = norm([g_parent, g_zero, g_zero - g_parent, g_perception])
    tolerance = gradient_tolerance(parent_norm)
    kl_totals = trainer.accelerator.reduce(
        torch.stack([terms.kl_sum, terms.token_count]).detach().float(), reduction="sum"
    )
    autocast_enabled, autocast_dtype = _autocast_state()
    gamma = float(trainer.current_gamma()) if hasattr(trainer, "current_gamma") else 0.0
    return dict(
        parent_loss=parent_value,
        zero_gamma_loss=zero_value,
        loss_bit_equal=loss_bit_equal,
        parent_grad_norm=parent_norm,
        zero_gamma_grad_norm=zero_norm,
        grad_diff_norm=diff,
        grad_diff_relative=diff / parent_norm if parent_norm > 0 else (0.0 if diff == 0 else math.inf),
        tolerance=tolerance,
        perception_kl=(kl_totals[0] / kl_totals[1].clamp(min=1.0)).item(),
        perception_grad_norm=perception_norm,
        separation_ratio=perception_norm / tolerance,
        leak_detection_power=perception_norm / tolerance,
        gamma=gamma,
        gamma_leak_detection_power=gamma * perception_norm / tolerance,
        dtype=str(parent_loss.dtype).replace("torch.", ""),
        autocast_enabled=autocast_enabled,
        autocast_dtype=autocast_dtype,
        trl_version=trl.__version__,
    )


class GammaZeroProbe:
    """Stateful probe: defers on image-invariant batches, then gives one verdict and stops running."""

    def __init__(self, max_degenerate_batches: int = PAPO_PROBE_MAX_DEGENERATE_BATCHES):
        self.max_degenerate_batches = max_degenerate_batches
        self.pending = True
        self.degenerate_batches = 0
        self.underpowered_batches = 0
        self.batches_without_images = 0
        self.evaluations = 0  # batches looked at; benchmarks count probe work with it
        self.evidence: ProbeEvidence | None = None

    def _record(self, status: str, message: str, step: int | None, **numbers) -> ProbeEvidence:
        self.evidence = ProbeEvidence(
            status,
            message,
            step=step,
            degenerate_batches_skipped=self.degenerate_batches,
            underpowered_batches_skipped=self.underpowered_batches,
            batches_without_images=self.batches_without_images,
            **numbers,
        )
        self.pending = status == "pending"
        if status == "failed":
            raise ProbeFailure(message)
        return self.evidence

    def observe(
        self,
        trainer,
        model,
        parent_loss: torch.Tensor,
        terms,
        step: int | None = None,
        assemble: Callable | None = None,
    ) -> ProbeEvidence:
        """Look at one batch; returns the evidence (pending or passed) or raises ProbeFailure."""
        self.evaluations += 1
        PROBE_CALLS["observe"] += 1
        values = torch.stack(
            [
                parent_loss.detach().float(),
                terms.perception_kl.detach().float(),
                terms.original_entropy.detach().float(),
                terms.masked_entropy.detach().float(),
            ]
        )
        finite = bool(torch.isfinite(values).all())
        # Same decision on every rank: finiteness, image presence and KL are reduced before any verdict or deferral,
        # so no rank raises, defers or stops probing while another waits in a collective.
        flags = torch.stack(
            [
                torch.tensor(float(not finite)),
                torch.tensor(float(terms.has_images)),
                terms.kl_sum.detach().float().cpu(),
                terms.token_count.detach().float().cpu(),
            ]
        ).to(parent_loss.device)
        flags = trainer.accelerator.reduce(flags, reduction="sum")
        if flags[0].item() > 0:
            ranks = trainer.accelerator.num_processes
            where = f" on {int(flags[0].item())} of {ranks} ranks; this rank's" if ranks > 1 else ""
            return self._record(
                "failed", f"probe: non-finite loss pieces{where} (parent, kl, H, H_masked) = {values.tolist()}", step
            )
        flags = flags[1:]
        if flags[0].item() == 0:
            self.batches_without_images += 1
            return self._record(
                "pending", "probe deferred: batch has no images, so zero perception KL is correct", step
            )
        if flags[1].item() == 0.0:
            self.degenerate_batches += 1
            if self.degenerate_batches >= self.max_degenerate_batches:
                return self._record(
                    "failed",
                    (
                        f"probe: {self.degenerate_batches} consecutive image-invariant batches (perception KL "
                        "exactly 0). The masked forward never changes the completion log-probs. Likely causes: the "
                        "mask does not reach pixel_values (wrong layout, e.g. 2-D Qwen tensors treated as 4-D), the "
                        "masked pixel_values are not passed to the forward, the vision tower output is ignored or "
                        "zeroed, or every probe batch is answerable without the image."
                    ),
                    step,
                )
            return self._record(
                "pending",
                f"probe deferred: image-invariant batch {self.degenerate_batches}/{self.max_degenerate_batches}",
                step,
            )
        numbers = measure_gamma_zero(trainer, model, parent_loss, terms, assemble)
        if not all(
            math.isfinite(numbers[k])
            for k in ("parent_grad_norm", "zero_gamma_grad_norm", "grad_diff_norm", "perception_grad_norm")
        ):
            return self._record("failed", f"probe: non-finite gradient norms {numbers}", step, **numbers)
        problems = []
        if not numbers["loss_bit_equal"]:
            problems.append(
                f"zero-gamma loss {numbers['zero_gamma_loss']!r} != parent loss {numbers['parent_loss']!r}"
            )
        if numbers["grad_diff_norm"] > numbers["tolerance"]:
            problems.append(
                "perception gradient leaks through the gamma=0 path: "
                f"||g_zero - g_parent|| = {numbers['grad_diff_norm']:.3e} > tolerance {numbers['tolerance']:.3e} "
                f"({PASS_RULE})"
            )
        if not numbers["perception_kl"] > 0:
            problems.append(f"perception KL is {numbers['perception_kl']!r}, not > 0")
        if not numbers["perception_grad_norm"] > 0:
            problems.append(
                "the perception term has zero gradient: the masked branch does not reach the trainable weights"
            )
        if problems:
            return self._record("failed", "probe failed: " + "; ".join(problems), step, **numbers)
        power = numbers["leak_detection_power"]
        if power < 1.0:
            self.underpowered_batches += 1
            weak = (
                f"leak-detection power {power:.3g} < 1: the perception gradient "
                f"({numbers['perception_grad_norm']:.3e}) is below the tolerance ({numbers['tolerance']:.3e}), "
                "so a leak that large would pass unseen"
            )
            if self.underpowered_batches >= self.max_degenerate_batches:
                message = f"probe UNDERPOWERED after {self.underpowered_batches} batches, none powered; last: {weak}"
                return self._record("underpowered", message, step, **numbers)
            message = f"probe deferred: underpowered batch {self.underpowered_batches}/{self.max_degenerate_batches}"
            return self._record("pending", f"{message}; {weak}", step, **numbers)
        return self._record(
            "passed",
            (
                f"probe passed: ||g_zero - g_parent|| = {numbers['grad_diff_norm']:.3e} <= "
                f"{numbers['tolerance']:.3e}; perception KL {numbers['perception_kl']:.3e}, "
                f"leak-detection power {power:.3g}"
            ),
            step,
            **numbers,
        )

    def metrics(self) -> dict[str, float]:
        """Numeric evidence for the trainer's metrics (and so MLflow)."""
        if self.evidence is None:
            return {}
        return {
            k: float(v)
            for k, v in self.evidence.to_dict().items()
            if isinstance(v, (int, float)) and k not in ("rel_tol", "abs_floor")
        }


def probe_batches(
    trainer,
    batches: Iterable[dict[str, Any]],
    *,
    model=None,
    autocast_dtype: torch.dtype | None = None,
    max_degenerate_batches: int = PAPO_PROBE_MAX_DEGENERATE_BATCHES,
    raise_on_failure: bool = True,
) -> ProbeEvidence:
    """Feed prepared batches (``_compute_loss`` inputs) to one probe, optionally under autocast, until it reaches a
    verdict ("passed", "failed" or "underpowered") or the batches run out (then its last evidence, "pending").

    With ``raise_on_failure=False`` a failed verdict is returned (``status="failed"``) instead of raised.
    """
    model = model or trainer.model
    device_type = next(model.parameters()).device.type
    probe = GammaZeroProbe(max_degenerate_batches)
    for inputs in batches:
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            parent_loss, terms = trainer.papo_loss_parts(model, inputs)
            try:
                probe.observe(trainer, model, parent_loss, terms)
            except ProbeFailure:
                if raise_on_failure:
                    raise
        if not probe.pending:
            break
    if probe.evidence is None:
        raise ValueError("probe_batches got no batch")
    return probe.evidence


def probe_batch(trainer, inputs, **options) -> ProbeEvidence:
    """The probe on one prepared batch (see ``probe_batches`` for the options); an underpowered or image-invariant
    batch gives a "pending" verdict, which is not a pass."""
    return probe_batches(trainer, [inputs], **options)
