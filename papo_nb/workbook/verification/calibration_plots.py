"""Notebook 02's figures: the norm rule's picture, both tests side by side, and the projection test's power."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from papo_nb.papo.probe.contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from papo_nb.papo.probe.projection import POWER_MARGIN, RECIPE_GAMMA, TERM_NAMES

MARKERS = {"fp32": "o", "bf16": "s"}
TERM_COLOURS = dict(zip(TERM_NAMES, ("tab:blue", "tab:orange", "tab:green")))


def zero_floor(values) -> float:
    """Where exact zeros are drawn on a log axis: a decade below the smallest positive value shown."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return 10 ** (np.floor(np.log10(min(positive))) - 1) if positive else 1e-12


def on_floor(values, floor: float) -> list[float]:
    """``values`` with every exact zero moved to ``floor``, where a log axis can show it."""
    return [v if v > 0 else floor for v in values]


def plot_calibration(points: list):
    """Log-log: gamma-zero difference and leak magnitudes against the parent gradient norm, with the boundary over
    the whole range. Exact zeros cannot sit on a log axis: a zero difference is drawn on a dotted floor line and a
    batch with a zero parent gradient (every group agreed: nothing to learn) on a dashed floor column, each line
    labelled with where it is drawn and how many points it carries."""
    fig = Figure(figsize=(12, 6))  # no pyplot: no global figure state, no backend choice forced on the caller
    ax = fig.subplots()
    x_floor = zero_floor([p.parent_grad_norm for p in points])
    magnitudes = ("grad_diff_norm", "perception_grad_norm", "injected_leak_diff")
    y_all = [getattr(p, name) for p in points for name in magnitudes]
    floor = zero_floor(y_all + [GAMMA_ZERO_GRADIENT_ABS_FLOOR])
    phases = sorted({p.phase for p in points})
    colours = dict(zip(phases, matplotlib.colormaps["tab10"].colors))
    for phase in phases:
        for precision in sorted({p.precision for p in points}):
            sel = [p for p in points if p.phase == phase and p.precision == precision]
            if not sel:
                continue
            x = on_floor([p.parent_grad_norm for p in sel], x_floor)
            c, m = colours[phase], MARKERS.get(precision, "o")
            series = (
                ("grad_diff_norm", m, "roundoff ||g0 - g||", {}),
                ("perception_grad_norm", "^", "leak: perception grad", {"facecolors": "none"}),
                ("injected_leak_diff", "x", "leak: injected", {}),
            )
            for key, marker, name, style in series:
                values = on_floor([getattr(p, key) for p in sel], floor)
                size = 50 if marker == m else 60
                ax.scatter(x, values, color=c, marker=marker, s=size, label=f"{name}, {phase}, {precision}", **style)
    xs = np.logspace(np.log10(x_floor) - 0.5, np.log10(max(p.parent_grad_norm for p in points) or x_floor) + 0.5, 200)
    ax.plot(
        xs,
        np.maximum(GAMMA_ZERO_GRADIENT_REL_TOL * xs, GAMMA_ZERO_GRADIENT_ABS_FLOOR),
        "k-",
        lw=2,
        label=f"tolerance boundary max({GAMMA_ZERO_GRADIENT_REL_TOL} x, {GAMMA_ZERO_GRADIENT_ABS_FLOOR:g})",
    )
    zeros = sum(getattr(p, name) <= 0 for p in points for name in magnitudes)
    ax.axhline(floor, color="grey", ls=":", lw=1.5, label=f"exact zero (drawn at {floor:.0e}): {zeros} points")
    flat = sum(p.parent_grad_norm <= 0 for p in points)
    if flat:
        ax.axvline(
            x_floor, color="grey", ls="--", lw=1.5,
            label=f"zero parent gradient (drawn at {x_floor:.0e}): {flat} of {len(points)} batches",
        )  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parent gradient norm ||g_parent|| (L2, loss units per parameter)")
    ax.set_ylabel("gradient difference / leak magnitude (L2, same units)")
    ax.set_title(f"Gamma-zero probe calibration, {len(points)} batches: roundoff below the boundary, leaks above")
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
    floors (log), with the ``POWER_MARGIN`` line. One colour per term; a bar the probe would defer (under the margin,
    or a noise floor of exactly 0, where the ratio has no value) is hatched, the latter drawn at 1 on a labelled line;
    an untestable term is named under its batch (n/t)."""
    fig = Figure(figsize=(12, 4.5))
    ax = fig.subplots()
    width = 0.8 / len(TERM_NAMES)
    handles, no_floor = [], 0
    for k, name in enumerate(TERM_NAMES):
        tested = 0
        for i, p in enumerate(points):
            e, x = p.terms.get(name, {}), i + (k - (len(TERM_NAMES) - 1) / 2) * width
            if not e.get("testable"):
                ax.text(x, 1.0, "n/t", fontsize=5, ha="center", rotation=90)
                continue
            ratio, tested = e["injected_leak_over_floor"], tested + 1
            measured = ratio > 0 and math.isfinite(ratio)
            no_floor += not measured
            powered = e.get("powered", measured and ratio >= POWER_MARGIN)
            edge, hatch = (TERM_COLOURS[name], None) if powered else ("tab:red", "xx")
            ax.bar(x, ratio if measured else 1.0, width=width, color=TERM_COLOURS[name], hatch=hatch, edgecolor=edge)
        untested = "" if tested else ": not testable on any batch"
        handles.append(Patch(color=TERM_COLOURS[name], label=f"{name}, {tested} of {len(points)} batches{untested}"))
    handles.append(Patch(facecolor="white", edgecolor="tab:red", hatch="xx", label="not powered: the probe defers it"))
    handles.append(ax.axhline(POWER_MARGIN, color="k", lw=1.5, label=f"{POWER_MARGIN:g} noise floors: powered"))
    handles.append(
        ax.axhline(
            1.0, color="grey", ls=":", lw=1, label=f"noise floor exactly 0 (no ratio; drawn at 1): {no_floor} bars"
        )
    )
    ax.set_yscale("log")
    ax.set_xticks(range(len(points)), _labels(points), fontsize=6, rotation=90)
    ax.set_xlabel("batch (phase 1/2, precision, batch index); n/t: term not testable on the batch")
    ax.set_ylabel(f"power: injected {RECIPE_GAMMA} leak / noise floor")
    ax.set_title(f"Projection test power: a {RECIPE_GAMMA} x term leak measured in noise floors, per batch and term")
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, which="both", axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_false_alarms(evaluations: list[dict]):
    """Histogram per regime of each clean evaluation's largest statistic against its threshold (whole-term and
    block fits; over 1 is a false alarm), beside the statistic of the old rule (6 floors with 2 repeats). A statistic
    of exactly 0 is counted in the lowest bin, which a dotted line labels."""
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
        zeros = sum(v <= low for v in new + old)
        ax.axvline(low, color="grey", ls=":", lw=1, label=f"statistic exactly 0 (drawn at {low:.0e}): {zeros}")
        alarms, old_alarms = sum(v > 1 for v in new), sum(v > 1 for v in old)
        ax.set(xscale="log", yscale="log", xlabel="statistic / threshold (over 1: a false alarm)")
        ax.set_title(
            f"{label}: {alarms} probe false alarms in {len(sel)} clean evaluations (old rule: {old_alarms})",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("clean evaluations")
    fig.suptitle("Emulated GPU regime (synthetic roundoff on real gradients): clean evaluations")
    return fig
