"""Training-curve figures for the collapse symptoms PAPO's authors report ("KL_prcp hacking")."""

from __future__ import annotations

from matplotlib.figure import Figure

# (metric key, label, unit) per panel; healthy vs collapse values are from the PAPO paper.
PANELS = [
    ([("reward", "mean reward")], "reward (0..2: accuracy + format)", "Reward (collapse: drops)"),
    (
        [("perception_loss", "perception loss = -KL_prcp")],
        "nats per token",
        "Perception loss (collapse: ~-0.05 -> ~-1.0)",
    ),
    (
        [("entropy", "entropy, original images"), ("masked_entropy", "entropy, masked images")],
        "nats per token",
        "Double entropy (collapse: both rise)",
    ),
    (
        [("clip_ratio/high_mean", "high clip ratio")],
        "fraction of tokens",
        "High clip ratio (healthy ~5e-4, collapse ~7e-3)",
    ),
]


def step_logs(log_history: list[dict]) -> list[dict]:
    """The per-optimizer-step entries of a Trainer's ``log_history`` (the final train summary has no reward)."""
    return [h for h in log_history if "reward" in h]


def plot_training_curves(step_logs: list[dict]):
    fig = Figure(figsize=(11, 7))
    axes = fig.subplots(2, 2)
    for ax, (series, unit, title) in zip(axes.flat, PANELS):
        for key, label in series:
            points = [(h["step"], h[key]) for h in step_logs if h.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        # Plain tick values: an offset ("+5.873" over the axis) hides the level a reviewer compares to the paper.
        ax.ticklabel_format(axis="y", useOffset=False)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged in this run", transform=ax.transAxes, ha="center", va="center", color="grey")
    fig.suptitle("PAPO-G training metrics")
    fig.tight_layout()
    return fig
