"""The gamma-zero reduction probe: run-time proof that the PAPO-G adapter is wired correctly.

Reduction half. ``zero_gamma_loss = trainer.assemble_loss(parent_loss, terms, 0, 0, 0)`` must equal the
parent loss bit for bit, and its gradient must equal the parent's up to roundoff. Two tests look at the difference
``d = g_zero - g_parent``; a batch fails if either sees a leak:

- the spec's norm rule (its constants are requirements): PASS iff ||d|| <= max(REL_TOL * ||g_parent||, ABS_FLOOR);
- the projection test (``projection.py``): the coefficient of each PAPO term's gradient in ``d`` (perception KL,
  both entropies), over the whole gradient and within each named parameter group (``blocks.py``), against a noise
  floor taken from measured roundoff samples (``roundoff.py``), at a threshold that keeps the whole probe's
  false-alarm rate at most ``FALSE_ALARM_RATE`` = 1e-3 per evaluation (``threshold.py``).

Both losses have the same value, so this compares two backward passes over graphs of different shape: it catches an
adapter whose zero-gamma path still lets a term's gradient through (a leak), which a value comparison cannot see.

Liveness half. ``perception_kl > 0`` and ``||grad perception_kl|| > 0``: the masked forward really
reaches the logits. A batch whose log-probs do not move under masking (mean KL exactly 0) is legitimate
but shows nothing, so the probe defers on it without paying for gradients; after
``max_degenerate_batches`` such batches in a row it fails. A batch without images is not counted.

Power. The norm rule sees a leak of ``c * T`` only when ``c * ||grad T||`` exceeds the tolerance: on a trained policy
(parent gradient 10-20x the perception gradient) that is c of order 1, so it is reported
(``leak_detection_power = ||grad perception_kl|| / tolerance``) but does not decide power. A batch is powered when the
projection test detects a leak coefficient of at most the recipe's gamma (0.02) for every testable term, checked by
injecting such a leak on the batch (it must measure at least ``POWER_MARGIN`` = 20 noise floors). A batch
below that is not a pass: the probe defers it (counted apart from image-invariant batches) and looks at the next;
after ``max_degenerate_batches`` such batches it ends with status ``"underpowered"`` (neither passed nor failed: the
run goes on, and the notebook verdict and an MLflow tag warn).

Several processes. Every input to a decision is reduced across ranks first (finiteness, images, KL sums, and
the gradients, all-reduced to DDP's mean: the gradient the optimizer applies), so every rank defers,
passes or fails together and no rank is left waiting in a collective. One process reduces nothing. Under FSDP2
(sharded parameters) the gradients come from the shards, and norms and dot products are sums over the ranks
(reduce.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..contract import PAPO_ADAPTER_VERSION, PAPO_PROBE_MAX_DEGENERATE_BATCHES
from . import projection as probe_projection
from . import roundoff as probe_roundoff
from .contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from .measure import GRADIENT_NORMS, ProbeFailure, measure_gamma_zero
from .projection import POWER_MARGIN, RECIPE_GAMMA
from .threshold import FALSE_ALARM_RATE

PASS_RULE = (
    "||g_zero - g_parent|| <= max(REL_TOL * ||g_parent||, ABS_FLOOR) and, per PAPO term and per (block, term), "
    "|leak coefficient| <= threshold x its roundoff noise floor, the threshold the Student-t quantile for the "
    f"floor's roundoff samples at a false-alarm rate of {FALSE_ALARM_RATE:g} per evaluation over all those tests"
)


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
    norm_statistic: float | None = None  # ||g_zero - g_parent|| / tolerance; > 1 fails
    perception_kl: float | None = None
    perception_grad_norm: float | None = None
    leak_detection_power: float | None = None  # norm rule: ||grad perception term|| / tolerance
    gamma: float | None = None  # the run's gamma_t when measured
    gamma_leak_detection_power: float | None = None  # gamma_t * power: for a leak of the gamma-weighted term
    roundoff_mode: str = "repeat"  # where the roundoff sample came from (roundoff.py)
    roundoff_samples: int | None = None  # how many: the degrees of freedom of the noise floor
    roundoff_norm: float | None = None  # ||roundoff sample||
    roundoff_relative: float | None = None  # ||roundoff sample|| / ||g_parent||
    term_leaks: dict | None = None  # per PAPO term: coefficient, noise floor, detectable coefficients (or untestable)
    projection_statistic: float | None = None  # max over testable terms of |coefficient| / detectable; > 1 fails
    perception_detectable_coefficient: float | None = None  # smallest perception leak the projection test sees
    weakest_margin_at_recipe_gamma: float | None = None  # min over testable terms of 0.02 / detectable
    recipe_gamma: float = RECIPE_GAMMA
    detection_threshold: float | None = None  # in noise floors, shared by every test (threshold.py)
    tests: int | None = None  # whole-term and (block, term) tests the false-alarm budget is divided over
    false_alarm_rate: float = FALSE_ALARM_RATE  # per evaluation, all tests together (at most)
    block_leaks: dict | None = None  # per block, per term: share of the squared norm, coefficient, floor, detectable
    blocks_powered: bool | None = None  # every block holding >= 1% of a term's squared norm sees a 0.02 leak
    block_statistic: float | None = None  # max over tested (block, term) of |coefficient| / detectable; > 1 fails
    weakest_block: str | None = None  # the (term, block) with the largest detectable coefficient
    weakest_block_detectable: float | None = None  # its detectable coefficient
    weakest_block_share: float | None = None  # its share of the term's squared gradient norm
    powered: bool | None = None
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


def leak_problems(numbers: dict[str, Any]) -> list[str]:
    """What fails a measured batch: a zero-gamma loss that is not the parent's, a leak seen by the norm rule or the
    projection test, or no liveness (perception KL or its gradient not above 0)."""
    problems = []
    if not numbers["loss_bit_equal"]:
        problems.append(f"zero-gamma loss {numbers['zero_gamma_loss']!r} != parent loss {numbers['parent_loss']!r}")
    if numbers["grad_diff_norm"] > numbers["tolerance"]:
        problems.append(
            "perception gradient leaks through the gamma=0 path: "
            f"||g_zero - g_parent|| = {numbers['grad_diff_norm']:.3e} > tolerance {numbers['tolerance']:.3e} "
            "(the spec's norm rule)"
        )
    threshold = numbers["detection_threshold"]
    for name, e in numbers["term_leaks"].items():
        if e["testable"] and e["leak_seen"]:
            problems.append(
                f"{name} leaks through the gamma=0 path: its gradient is in g_zero - g_parent with coefficient "
                f"{e['coefficient']:.3e}, beyond {threshold:.3g} x its roundoff noise floor "
                f"{e['noise_floor']:.2e} (projection test)"
            )
    for block, leaks in (numbers.get("block_leaks") or {}).items():
        for name, e in leaks.items():
            if e["testable"] and e["leak_seen"]:
                problems.append(
                    f"{name} leaks through the gamma=0 path in block {block} ({e['share']:.2%} of its squared "
                    f"gradient norm): coefficient {e['coefficient']:.3e} there, beyond {threshold:.3g} x the "
                    f"block's noise floor {e['noise_floor']:.2e} (block test)"
                )
    if not numbers["perception_kl"] > 0:
        problems.append(f"perception KL is {numbers['perception_kl']!r}, not > 0")
    if not numbers["perception_grad_norm"] > 0:
        problems.append(
            "the perception term has zero gradient: the masked branch does not reach the trainable weights"
        )
    return problems


class GammaZeroProbe:
    """Stateful probe: defers on image-invariant batches, then gives one verdict and stops running."""

    def __init__(self, max_degenerate_batches: int = PAPO_PROBE_MAX_DEGENERATE_BATCHES, roundoff: str = "repeat"):
        probe_roundoff.check_mode(roundoff)
        self.max_degenerate_batches = max_degenerate_batches
        self.roundoff = roundoff
        self.pending = True
        self.degenerate_batches = 0
        self.underpowered_batches = 0
        self.batches_without_images = 0
        self.evaluations = 0  # batches looked at (observe calls); benchmarks count probe work with it
        self.measurements = 0  # batches whose gradients were measured (the expensive part)
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
        inputs: dict[str, Any] | None = None,
    ) -> ProbeEvidence:
        """Look at one batch; returns the evidence (pending, passed or underpowered) or raises ProbeFailure.
        ``inputs`` (the batch) is needed only with ``roundoff="reordered"``."""
        self.evaluations += 1
        deferred = self._screen(trainer, parent_loss, terms, step)
        if deferred is not None:
            return deferred
        self.measurements += 1
        numbers = measure_gamma_zero(
            trainer, model, parent_loss, terms, assemble, inputs=inputs, roundoff=self.roundoff
        )
        if not all(math.isfinite(numbers[k]) for k in GRADIENT_NORMS + ("roundoff_norm",)):
            return self._record("failed", f"probe: non-finite gradient norms {numbers}", step, **numbers)
        problems = leak_problems(numbers)
        if problems:
            return self._record("failed", "probe failed: " + "; ".join(problems), step, **numbers)
        return self._verdict(numbers, step)

    def _screen(self, trainer, parent_loss: torch.Tensor, terms, step: int | None) -> ProbeEvidence | None:
        """The checks before any gradient: finite loss pieces, images, a perception KL above 0. Their evidence when
        the batch stops here (failed or deferred), else None (measure it)."""
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
        if flags[1].item() == 0:
            self.batches_without_images += 1
            return self._record(
                "pending", "probe deferred: batch has no images, so zero perception KL is correct", step
            )
        if flags[2].item() == 0.0:
            return self._image_invariant(step)
        return None

    def _image_invariant(self, step: int | None) -> ProbeEvidence:
        """A batch whose log-probs do not move under masking: deferred, or failed after the bound in a row."""
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

    def _verdict(self, numbers: dict[str, Any], step: int | None) -> ProbeEvidence:
        """A measured batch without a leak: passed when powered, else deferred (underpowered after the bound)."""
        leaks = numbers["term_leaks"]
        if not numbers["powered"]:
            self.underpowered_batches += 1
            weak = (
                f"a value-neutral leak of {RECIPE_GAMMA} x some term, injected on this batch, measures under "
                f"{POWER_MARGIN:g} noise floors ({probe_projection.describe(leaks)}): a leak at the recipe's gamma "
                "could pass unseen"
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
                f"{numbers['tolerance']:.3e}; perception KL {numbers['perception_kl']:.3e}; "
                f"{probe_projection.describe(leaks)}; weakest margin at gamma {RECIPE_GAMMA}: "
                f"{numbers['weakest_margin_at_recipe_gamma']:.3g}x; threshold {numbers['detection_threshold']:.3g} "
                f"floors ({numbers['roundoff_samples']} roundoff samples, {numbers['tests']} tests)"
                + (
                    f"; weakest block: {numbers['weakest_block']}, "
                    f"detectable {numbers['weakest_block_detectable']:.2e}"
                    if numbers.get("weakest_block")
                    else ""
                )
            ),
            step,
            **numbers,
        )

    def metrics(self) -> dict[str, float]:
        """Numeric evidence for the trainer's metrics (and so MLflow)."""
        if self.evidence is None:
            return {}
        numbers = {
            k: float(v)
            for k, v in self.evidence.to_dict().items()
            if isinstance(v, (int, float)) and k not in ("rel_tol", "abs_floor", "recipe_gamma", "false_alarm_rate")
        }
        # Per-block fits stay in the evidence (evidence/probe.json): as one-value metrics they were hundreds of charts.
        return {**numbers, **probe_projection.flat_metrics(self.evidence.term_leaks or {})}


def probe_batches(
    trainer,
    batches: Iterable[dict[str, Any]],
    *,
    model=None,
    autocast_dtype: torch.dtype | None = None,
    max_degenerate_batches: int = PAPO_PROBE_MAX_DEGENERATE_BATCHES,
    raise_on_failure: bool = True,
    roundoff: str = "repeat",
    assemble: Callable | None = None,
) -> ProbeEvidence:
    """Feed prepared batches (``_compute_loss`` inputs) to one probe, optionally under autocast, until it reaches a
    verdict ("passed", "failed" or "underpowered") or the batches run out (then its last evidence, "pending").

    With ``raise_on_failure=False`` a failed verdict is returned (``status="failed"``) instead of raised.
    ``roundoff="reordered"`` is the calibration mode (``roundoff.py``); ``assemble`` replaces the trainer's.
    """
    model = model or trainer.model
    device_type = next(model.parameters()).device.type
    probe = GammaZeroProbe(max_degenerate_batches, roundoff=roundoff)
    for inputs in batches:
        with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            parent_loss, terms = trainer.papo_loss_parts(model, inputs)
            try:
                probe.observe(trainer, model, parent_loss, terms, assemble=assemble, inputs=inputs)
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
