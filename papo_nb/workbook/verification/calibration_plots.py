"""Notebook 02's figures: the norm rule's picture, both tests side by side, and the projection test's power."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from papo_nb.papo.probe.contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from papo_nb.papo.probe.projection import POWER_MARGIN, RECIPE_GAMMA, TERM_NAMES

MARKERS = {"fp32": "o", "bf16": "s"}
TERM_COLOURS = dict(zip(TERM_NAMES, ("tab:blue", "tab:orange", "tab:green")))


def zero_floor(values) -> float:
    """Where exact zeros are drawn on a log axis: a decade below the smallest positive value shown."""
    positive = [v for v in values if v > 0]
    return 10 ** (np.floor(np.log10(min(positive))) - 1) if positive else 1e-12


def plot_calibration(points: list):
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
            series = (
                ([d if d > 0 else floor for d in diffs], m, "roundoff ||g0 - g||", {}),
                ([p.perception_grad_norm for p in sel], "^", "leak: perception grad", {"facecolors": "none"}),
                ([p.injected_leak_diff for p in sel], "x", "leak: injected", {}),
            )
            for values, marker, name, style in series:
                size = 50 if marker == m else 60
                ax.scatter(x, values, color=c, marker=marker, s=size, label=f"{name}, {phase}, {precision}", **style)
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


def _labels(points) -> list[str]:
    return [f"p{p.phase[-1]} {p.precision} b{p.batch}" for p in points]


def plot_both_tests(points):
    """Both tests on the same batches, in leak-coefficient units (a leak of ``c * T`` adds ``c * grad T``). Left, the
    spec's norm rule: the roundoff it sees (``||g_zero - g_parent|| / ||grad T||``) and the smallest leak it detects
    (``tolerance / ||grad T||``). Right, the projection test: the roundoff's coefficient ``|c|``, its noise floor and
    the smallest leak it detects (the detection threshold times the floor). Both against the recipe's gamma, 0.02."""
    fig = Figure(figsize=(15, 6))
    left, right = fig.subplots(1, 2, sharey=True)
    x = np.arange(len(points))
    values = []
    for name in TERM_NAMES:
        sel = [(i, p.terms[name], p) for i, p in enumerate(points) if p.terms.get(name, {}).get("testable")]
        if not sel:
            continue
        i = [s[0] for s in sel]
        colour = TERM_COLOURS[name]
        seen = [p.grad_diff_norm / e["grad_norm"] for _, e, p in sel]
        norm_detect = [e["norm_rule_detectable_coefficient"] for _, e, _ in sel]
        coefficient = [abs(e["coefficient"]) for _, e, _ in sel]
        floor = [e["noise_floor"] for _, e, _ in sel]
        detect = [e["detectable_coefficient"] for _, e, _ in sel]
        values += seen + norm_detect + coefficient + floor + detect
        left.scatter(i, seen, color=colour, marker="o", s=30, label=f"roundoff ||g0 - g|| / ||grad T||, {name}")
        left.scatter(
            i, norm_detect, color=colour, marker="v", s=50, label=f"detectable: tolerance / ||grad T||, {name}"
        )
        right.scatter(i, coefficient, color=colour, marker="o", s=30, label=f"roundoff |c|, {name}")
        right.scatter(i, floor, color=colour, marker="_", s=120, label=f"noise floor, {name}")
        right.scatter(i, detect, color=colour, marker="v", s=50, label=f"detectable: threshold x floor, {name}")
    floor_line = zero_floor(values + [RECIPE_GAMMA])
    for ax, title in (
        (left, "spec norm rule: ||g0 - g|| <= max(REL_TOL ||g||, ABS_FLOOR)"),
        (right, "projection test: leak coefficient per PAPO term"),
    ):
        for collection in ax.collections:  # exact zeros cannot sit on a log axis: drawn on the floor line
            offsets = collection.get_offsets()
            offsets[:, 1] = np.where(offsets[:, 1] > 0, offsets[:, 1], floor_line)
            collection.set_offsets(offsets)
        ax.axhline(RECIPE_GAMMA, color="k", lw=2, label=f"recipe gamma {RECIPE_GAMMA}: detectable must lie below")
        ax.axhline(floor_line, color="grey", ls=":", lw=1.5, label=f"exact zero (drawn at {floor_line:.0e})")
        ax.set_yscale("log")
        ax.set_xticks(x, _labels(points), fontsize=6, rotation=90)
        ax.set_xlabel("batch (phase 1/2, precision, batch index)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    left.set_ylabel("leak coefficient c (a leak of c x term; dimensionless)")
    fig.suptitle(
        "Gamma-zero probe, both tests side by side: what each sees of roundoff and the smallest leak it detects"
    )
    fig.tight_layout()
    return fig


def plot_power(points):
    """The projection test's power per batch and term: a value-neutral ``RECIPE_GAMMA`` leak, injected, in noise
    floors (log), with the ``POWER_MARGIN`` line; untestable terms are named under their batch."""
    fig = Figure(figsize=(12, 4.5))
    ax = fig.subplots()
    width = 0.8 / len(TERM_NAMES)
    for k, name in enumerate(TERM_NAMES):
        xs, heights, colours = [], [], []
        for i, p in enumerate(points):
            e = p.terms.get(name, {})
            if not e.get("testable"):
                ax.text(i + (k - 1) * width, 1.0, "n/t", fontsize=5, ha="center", rotation=90)
                continue
            ratio = e["injected_leak_over_floor"]
            xs.append(i + (k - 1) * width)
            heights.append(ratio if ratio > 0 and math.isfinite(ratio) else 1.0)
            colours.append(TERM_COLOURS[name] if ratio >= POWER_MARGIN else "tab:red")
        ax.bar(xs, heights, width=width, color=colours, label=f"{name} (red: under the margin)")
    ax.axhline(POWER_MARGIN, color="k", lw=1.5, label=f"{POWER_MARGIN:g} noise floors: powered")
    ax.set_yscale("log")
    ax.set_xticks(range(len(points)), _labels(points), fontsize=6, rotation=90)
    ax.set_xlabel("batch (phase 1/2, precision, batch index); n/t: term not testable on the batch")
    ax.set_ylabel(f"power: injected {RECIPE_GAMMA} leak / noise floor")
    ax.set_title(f"Projection test power: a {RECIPE_GAMMA} x term leak measured in noise floors, per batch and term")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_false_alarms(evaluations: list[dict]):
    """Histogram per regime of each clean evaluation's largest statistic against its threshold (whole-term and
    block fits; over 1 is a false alarm), beside the statistic of the old rule (6 floors with 2 repeats)."""
    fig = Figure(figsize=(12, 5))
    axes = np.atleast_1d(fig.subplots(1, len({e["label"] for e in evaluations}), sharey=True))
    values = [max(e["projection_statistic"], e["block_statistic"]) for e in evaluations]
    values += [e["old_rule_floors"] / 6 for e in evaluations]
    low = zero_floor(values)
    bins = np.logspace(np.log10(low), np.log10(max(max(values), 2.0)) + 0.1, 40)
    for ax, label in zip(axes, sorted({e["label"] for e in evaluations})):
        sel = [e for e in evaluations if e["label"] == label]
        new = [max(low, e["projection_statistic"], e["block_statistic"]) for e in sel]
        old = [max(low, e["old_rule_floors"] / 6) for e in sel]
        ax.hist(old, bins=bins, alpha=0.4, color="tab:red", label="old rule: |c| / (6 floors), 2 repeats")
        ax.hist(new, bins=bins, alpha=0.7, color="tab:blue", label="probe: statistic / Student-t threshold")
        ax.axvline(1.0, color="k", lw=1.5, label="threshold: a false alarm beyond")
        alarms = sum(v > 1 for v in new)
        ax.set(xscale="log", yscale="log", xlabel="statistic / threshold", title=f"{label}: {alarms}/{len(sel)}")
    axes[0].set_ylabel("clean evaluations")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Emulated GPU regime (synthetic roundoff on real gradients): clean evaluations")
    return fig
