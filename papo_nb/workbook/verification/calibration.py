"""Probe calibration: do the spec's gamma-zero tolerances separate backward roundoff from real perception leaks?

For each phase (fresh adapter, trained policy), precision and batch it measures the parent gradient norm,
the gamma-zero gradient difference (roundoff; must sit under the tolerance) and two leak magnitudes (must sit
over it): the perception gradient norm, which is what a leaking adapter adds, and the difference an injected
leak actually produces through the probe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure

from papo_nb.papo.contract import (
    GAMMA_ZERO_GRADIENT_ABS_FLOOR,
    GAMMA_ZERO_GRADIENT_REL_TOL,
    PAPO_PROBE_MAX_DEGENERATE_BATCHES,
)
from papo_nb.papo.probe import measure_gamma_zero, probe_batches
from papo_nb.workbook.verification.batches import rollout_batch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class CalibrationPoint:
    phase: str
    precision: str
    batch: int
    parent_grad_norm: float
    grad_diff_norm: float  # ||g_zero - g_parent||: roundoff
    tolerance: float
    perception_grad_norm: float  # what a leak of the perception term would add
    injected_leak_diff: float  # ||g_zero - g_parent|| measured with a leaking assembly
    perception_kl: float
    loss_bit_equal: bool
    # perception gradient / tolerance: < 1 means a leak that size would pass unseen (computed when not given)
    leak_detection_power: float | None = None

    def __post_init__(self):
        if self.leak_detection_power is None:
            self.leak_detection_power = self.perception_grad_norm / self.tolerance

    def to_dict(self):
        return asdict(self)


def leaking_assembly(trainer, scale: float):
    """The trainer's own assembly plus a value-neutral leak: ``scale * (kl - kl.detach())`` is 0.0 in value."""

    def assemble(parent_loss, terms, gamma, eta1, eta2):
        leak = scale * (terms.perception_kl - terms.perception_kl.detach())
        return trainer.assemble_loss(parent_loss, terms, gamma, eta1, eta2) + leak

    return assemble


def calibrate_phase(
    trainer,
    dataset,
    phase: str,
    precisions,
    n_batches: int,
    *,
    leak_scale: float = 1.0,
    n_prompts: int = 2,
    seed: int = 0,
) -> list[CalibrationPoint]:
    """Measure ``n_batches`` fresh rollout batches under each precision (autocast on the model's device)."""
    model = trainer.model
    device_type = next(model.parameters()).device.type
    points = []
    for b in range(n_batches):
        start = (b * n_prompts) % max(len(dataset) - n_prompts + 1, 1)
        batch = rollout_batch(trainer, dataset, n_prompts, start=start, seed=seed + b)
        for precision in precisions:
            dtype = PRECISIONS[precision]
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                parent, terms = trainer.papo_loss_parts(model, batch)
                clean = measure_gamma_zero(trainer, model, parent, terms)
                leaky = measure_gamma_zero(
                    trainer, model, parent, terms, assemble=leaking_assembly(trainer, leak_scale)
                )
            points.append(
                CalibrationPoint(
                    phase,
                    precision,
                    b,
                    clean["parent_grad_norm"],
                    clean["grad_diff_norm"],
                    clean["tolerance"],
                    clean["perception_grad_norm"],
                    leaky["grad_diff_norm"],
                    clean["perception_kl"],
                    clean["loss_bit_equal"],
                    clean["leak_detection_power"],
                )
            )
    return points


def probe_rollouts(
    trainer,
    dataset,
    *,
    n_prompts: int = 2,
    seed: int = 0,
    autocast_dtype: torch.dtype | None = None,
    raise_on_failure: bool = False,
):
    """The gamma-zero probe over fresh rollout batches (drawn as ``calibrate_phase`` draws them, the first one being
    notebook 01's single batch) until it reaches a verdict: an image-invariant or underpowered batch makes it look at
    the next, up to ``trainer.args.probe_max_degenerate_batches`` of each."""
    bound = getattr(trainer.args, "probe_max_degenerate_batches", PAPO_PROBE_MAX_DEGENERATE_BATCHES)

    def batches():
        for b in range(2 * bound):
            start = (b * n_prompts) % max(len(dataset) - n_prompts + 1, 1)
            yield rollout_batch(trainer, dataset, n_prompts, start=start, seed=seed + b)

    return probe_batches(
        trainer,
        batches(),
        autocast_dtype=autocast_dtype,
        max_degenerate_batches=bound,
        raise_on_failure=raise_on_failure,
    )


def separation_margins(points: list[CalibrationPoint]) -> dict:
    """Largest roundoff as a fraction of its tolerance, smallest leak as a multiple of its tolerance, verdict."""
    roundoff = [p.grad_diff_norm / p.tolerance for p in points]
    leaks = [v / p.tolerance for p in points for v in (p.perception_grad_norm, p.injected_leak_diff)]
    worst_roundoff, weakest_leak = max(roundoff), min(leaks)
    separated = worst_roundoff <= 1.0 < weakest_leak and all(p.loss_bit_equal for p in points)
    return {
        "max_roundoff_fraction_of_tolerance": worst_roundoff,
        "min_leak_multiple_of_tolerance": weakest_leak,
        "points": len(points),
        "all_losses_bit_equal": all(p.loss_bit_equal for p in points),
        "separated": separated,
        "verdict": (
            f"{'SEPARATED' if separated else 'NOT SEPARATED'}: worst roundoff is {worst_roundoff:.3g} of tolerance, "
            f"weakest leak is {weakest_leak:.3g}x tolerance (REL_TOL={GAMMA_ZERO_GRADIENT_REL_TOL}, "
            f"ABS_FLOOR={GAMMA_ZERO_GRADIENT_ABS_FLOOR})"
        ),
    }


def zero_floor(values) -> float:
    """Where exact zeros are drawn on a log axis: a decade below the smallest positive value shown."""
    positive = [v for v in values if v > 0]
    return 10 ** (np.floor(np.log10(min(positive))) - 1) if positive else 1e-12


def plot_calibration(points: list[CalibrationPoint]):
    """Log-log: gamma-zero difference and leak magnitudes against the parent gradient norm, with the boundary."""
    fig = Figure(figsize=(12, 6))  # no pyplot: no global figure state, no backend choice forced on the caller
    ax = fig.subplots()
    x_all = [p.parent_grad_norm for p in points]
    y_all = (
        [p.grad_diff_norm for p in points]
        + [p.perception_grad_norm for p in points]
        + [p.injected_leak_diff for p in points]
    )
    floor = zero_floor(y_all + [GAMMA_ZERO_GRADIENT_ABS_FLOOR])
    phases = sorted({p.phase for p in points})
    colours = dict(zip(phases, matplotlib.colormaps["tab10"].colors))
    markers = {"fp32": "o", "bf16": "s"}
    for phase in phases:
        for precision in sorted({p.precision for p in points}):
            sel = [p for p in points if p.phase == phase and p.precision == precision]
            if not sel:
                continue
            x = [p.parent_grad_norm for p in sel]
            diffs = [p.grad_diff_norm for p in sel]
            c, m = colours[phase], markers.get(precision, "o")
            ax.scatter(
                x,
                [d if d > 0 else floor for d in diffs],
                color=c,
                marker=m,
                s=50,
                label=f"roundoff ||g0 - g||, {phase}, {precision}",
            )
            ax.scatter(
                x,
                [p.perception_grad_norm for p in sel],
                color=c,
                marker="^",
                s=60,
                facecolors="none",
                label=f"leak: perception grad, {phase}, {precision}",
            )
            ax.scatter(
                x,
                [p.injected_leak_diff for p in sel],
                color=c,
                marker="x",
                s=60,
                label=f"leak: injected, {phase}, {precision}",
            )
    xs = np.logspace(np.log10(min(x_all) / 3), np.log10(max(x_all) * 3), 200)
    ax.plot(
        xs,
        np.maximum(GAMMA_ZERO_GRADIENT_REL_TOL * xs, GAMMA_ZERO_GRADIENT_ABS_FLOOR),
        "k-",
        lw=2,
        label=f"tolerance boundary max({GAMMA_ZERO_GRADIENT_REL_TOL} x, {GAMMA_ZERO_GRADIENT_ABS_FLOOR:g})",
    )
    ax.axhline(floor, color="grey", ls=":", lw=1.5, label=f"exact zero (drawn at {floor:.0e})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parent gradient norm ||g_parent|| (L2, loss units per parameter)")
    ax.set_ylabel("gradient difference / leak magnitude (L2, same units)")
    ax.set_title("Gamma-zero probe calibration: roundoff below the boundary, leaks above")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def weakest_power(points: list[CalibrationPoint]) -> dict:
    """The point with the smallest leak-detection power, and a sentence saying whether every point is powered."""
    weakest = min(points, key=lambda p: p.leak_detection_power)
    underpowered = [p for p in points if p.leak_detection_power < 1.0]
    where = f"{weakest.phase}, {weakest.precision}, batch {weakest.batch}"
    return {
        "min_leak_detection_power": weakest.leak_detection_power,
        "weakest_point": where,
        "underpowered_points": len(underpowered),
        "statement": (
            f"weakest leak-detection power {weakest.leak_detection_power:.3g} ({where}); "
            + (
                f"{len(underpowered)} of {len(points)} points are UNDERPOWERED (< 1): there a leak as large as the "
                "perception gradient would pass the gamma-zero check unseen"
                if underpowered
                else f"all {len(points)} points are powered (>= 1): a leak as large as the perception gradient shows"
            )
        ),
    }


def plot_power(points: list[CalibrationPoint]):
    """Leak-detection power of every calibration point (log scale), with the power-1 line and the weakest marked."""
    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    labels = [f"{p.phase}\n{p.precision} b{p.batch}" for p in points]
    powers = [p.leak_detection_power for p in points]
    colours = ["tab:red" if v < 1.0 else "tab:blue" for v in powers]
    ax.bar(range(len(points)), powers, color=colours)
    ax.axhline(1.0, color="k", lw=1.5, label="power 1: a leak the size of the perception gradient just shows")
    weakest = int(np.argmin(powers))
    ax.annotate(
        f"weakest {powers[weakest]:.3g}",
        (weakest, powers[weakest]),
        textcoords="offset points",
        xytext=(0, 6),
        ha="center",
        fontsize=8,
    )
    ax.set_yscale("log")
    ax.set_xticks(range(len(points)), labels, fontsize=7)
    ax.set_ylabel("leak-detection power = ||grad perception|| / tolerance")
    ax.set_title("Gamma-zero probe power per calibration point (red: underpowered, < 1)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
