"""Figures of the method study: learning curves per arm with seed bands, held-out accuracy per arm, the sweep."""

from __future__ import annotations

import math
from statistics import mean

from matplotlib.figure import Figure

from papo_nb.workbook.study.arms import ARM_COLOURS, Study, StudyRun
from papo_nb.workbook.study.stats import mean_ci

# (metric, panel title); the symptom each should show on collapse is the paper's.
CURVES = (
    ("rewards/accuracy_reward/mean", "accuracy reward (collapse: drops)"),
    ("perception_kl", "perception KL, nats/token (collapse: ~0.05 -> ~1)"),
    ("entropy", "entropy, original images (collapse: rises)"),
    ("masked_entropy", "entropy, masked images (collapse: rises)"),
    ("clip_ratio/high_mean", "high clip ratio (collapse: ~7e-3)"),
)
COLOURS = ARM_COLOURS  # one colour per arm, as the runs carry in MLflow


def _label(run: StudyRun) -> str:
    return f"{run.arm} (gamma {run.gamma:g})"


def _band(runs: list[StudyRun], key: str):
    """Steps, mean, min and max over the runs' seeds (steps every run logged)."""
    per_run = [{int(h["step"]): h[key] for h in r.step_logs if key in h} for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    values = [[p[s] for p in per_run] for s in steps]
    return steps, [mean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def plot_learning_curves(study: Study) -> Figure:
    """One panel per collapse symptom; per arm the mean over seeds and a band from the lowest to the highest seed."""
    fig = Figure(figsize=(15, 7.5), layout="constrained")
    axes = fig.subplots(2, 3).flat
    for ax, (key, title) in zip(axes, CURVES):
        for arm, by_seed in study.by_arm().items():
            runs = list(by_seed.values())
            steps, centre, low, high = _band(runs, key)
            if not steps:
                continue
            ax.plot(steps, centre, color=COLOURS.get(arm), label=f"{_label(runs[0])}, {len(runs)} seeds")
            ax.fill_between(steps, low, high, color=COLOURS.get(arm), alpha=0.2)
            for run in runs:
                if run.collapse["step"] is not None:  # a collapse the step logs saw (held-out ones have no step)
                    ax.axvline(run.collapse["step"], color=COLOURS.get(arm), linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    sweep_ax = list(fig.axes)[-1]
    if study.sweep:
        plot_sweep(study, sweep_ax)
    else:  # no sweep or search ran here (a given collapse gamma): no panel, rather than an empty one
        sweep_ax.remove()
    fig.suptitle("Training per arm: mean over seeds, band = min..max over seeds, dotted = collapse detector fired")
    return fig


def plot_sweep(study: Study, ax) -> None:
    """Perception KL per step of the sweep, one line per gamma (mean over seeds, band = min..max), flagged runs
    counted in the label."""
    by_gamma: dict[float, list[StudyRun]] = {}
    for run in study.sweep:
        by_gamma.setdefault(run.gamma, []).append(run)
    for gamma, runs in sorted(by_gamma.items()):
        steps, centre, low, high = _band(runs, "perception_kl")
        if not steps:
            continue
        flagged = sum(bool(r.collapse["collapsed"]) for r in runs)
        (line,) = ax.plot(steps, centre, label=f"gamma {gamma:g} ({flagged}/{len(runs)} collapsed)")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_title(f"sweep ({len({r.seed for r in study.sweep})} seeds): perception KL", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _same_scores(scores: dict, kind: str, split: str, other: str) -> bool:
    """Every run scored ``split`` exactly as ``other`` (all items are vision items, say): one panel shows both."""
    return all(
        v.get(f"{kind}/{c}/{split}") == v.get(f"{kind}/{c}/{other}")
        for runs in scores.values()
        for v in runs.values()
        for c in ("original", "masked")
    )


def plot_accuracy(study: Study, kind: str = "avg_at_k", chance: float | None = None) -> Figure:
    """Held-out accuracy per arm and split, original vs masked images, with 95% CI over seeds; ``chance``, if given,
    is drawn on the vision-dependent panel, where a guesser's accuracy is known, and the warm start's score (step 0,
    calibrated design) on every panel it was measured for. A split identical to another on every run (all items when
    every item is a vision item) gets no panel of its own: the other's title says so."""
    scores = study.scores()
    arms = list(scores)
    splits = [
        s
        for s in ("all", "vision", "text")
        if any(f"{kind}/original/{s}" in v for r in scores.values() for v in r.values())
    ]
    merged = "all" in splits and "vision" in splits and _same_scores(scores, kind, "all", "vision")
    splits = [s for s in splits if not (merged and s == "all")]
    fig = Figure(figsize=(max(4.5, 1.0 + 0.9 * len(arms)) * len(splits), 4.4), layout="constrained")
    axes = fig.subplots(1, len(splits), squeeze=False)[0]
    width = 0.38
    for ax, split in zip(axes, splits):
        for offset, condition in ((-width / 2, "original"), (width / 2, "masked")):
            centres, halves = [], []
            for arm in arms:
                values = [v[f"{kind}/{condition}/{split}"] for v in scores[arm].values()]
                centre, half = mean_ci(values)
                centres.append(centre)
                halves.append(0.0 if math.isnan(half) else half)
            label, alpha = f"{condition}, mean over seeds (bar: 95% CI)", 1.0 if condition == "original" else 0.5
            ax.bar([i + offset for i in range(len(arms))], centres, width, yerr=halves, capsize=3, label=label,
                   alpha=alpha)  # fmt: skip
            start = study.start_scores.get(f"{kind}/{condition}/{split}")
            if start is not None:
                ax.axhline(start, color="tab:green", linestyle="--" if condition == "original" else "-.",
                           linewidth=1.2, label=f"warm start (step 0), {condition}: {start:.3f}")  # fmt: skip
        if chance is not None and split == "vision":
            ax.axhline(chance, color="black", linestyle=":", linewidth=1, label=f"chance ({chance:.2f})")
        ax.set_xticks(range(len(arms)), arms, fontsize=8, rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"{kind} accuracy (share of held-out items)")
        items = "vision items (every held-out item)" if merged and split == "vision" else f"{split} items"
        ax.set_title(f"{kind} accuracy, {items}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    return fig
