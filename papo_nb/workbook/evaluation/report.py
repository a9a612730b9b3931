"""Notebook 05's tables and figure, from ``benchmarks.benchmark_rows`` and ``benchmarks.summarise``: what each
benchmark holds, the scores (``no items`` where a benchmark had none), the headline and original-versus-masked bars."""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.figure import Figure

from papo_nb.workbook.evaluation.benchmarks import SCORE_KEYS, benchmark_count

NO_ITEMS = "no items"


def data_table(suites: dict[str, tuple]) -> pd.DataFrame:
    """One row per benchmark: its group and the filter report (rows kept, dropped as too long, ...)."""
    return pd.DataFrame({name: {"group": group, **report} for name, (_, group, report) in suites.items()}).T


def data_metrics(suites: dict[str, tuple]) -> dict[str, float]:
    """``data/<benchmark>/<count>`` for every number of every filter report."""
    return {
        f"data/{name}/{key}": float(value)
        for name, (_, _, report) in suites.items()
        for key, value in report.items()
        if isinstance(value, int | float)
    }


def scores_table(table: list[dict]) -> pd.DataFrame:
    """``summarise``'s rows for reading: scores to 3 decimals, NaN (a benchmark or group without items) as
    ``no items``."""
    frame = pd.DataFrame(table).set_index("name")
    for key in SCORE_KEYS:
        frame[key] = [NO_ITEMS if not math.isfinite(v) else round(float(v), 3) for v in frame[key]]
    return frame


def headline(table: list[dict], samples: int) -> str:
    """One line: overall avg@k and its masked-image counterpart, or that nothing was scored."""
    overall = next((row for row in table if row["name"] == "overall"), None)
    if overall is None or not math.isfinite(overall["avg_at_k"]):
        return f"overall avg@{samples}: {NO_ITEMS}"
    return (
        f"overall avg@{samples} {overall['avg_at_k']:.3f} with the original images, {overall['avg_at_k_masked']:.3f} "
        f"masked (gap {overall['gap_avg_at_k']:+.3f}); greedy {overall['greedy']:.3f} original, "
        f"{overall['greedy_masked']:.3f} masked: each a mean over {benchmark_count(table)} benchmarks (the paper's "
        "average), not over items"
    )


def plot_original_vs_masked(table: list[dict], samples: int) -> Figure:
    """avg@k and greedy accuracy per benchmark, group and overall, original images beside masked; a row without
    items is labelled so instead of drawn as an empty bar."""
    names = [row["name"] for row in table]
    fig = Figure(figsize=(max(8, 1.6 * len(names)), 3.6), layout="constrained")
    for ax, (kind, label) in zip(fig.subplots(1, 2), (("avg_at_k", f"avg@{samples}"), ("greedy", "greedy"))):
        width = 0.38
        for offset, (key, legend) in enumerate(((kind, "original"), (f"{kind}_masked", "masked"))):
            values = [row[key] if math.isfinite(row[key]) else 0.0 for row in table]
            positions = [i + (offset - 0.5) * width for i in range(len(names))]
            ax.bar(positions, values, width, label=legend)
        for i, row in enumerate(table):
            if not math.isfinite(row[kind]):
                ax.text(i, 0.02, NO_ITEMS, ha="center", rotation=90, fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.set_ylabel(label)
        ax.set_title(f"{label}: original and masked images")
    # beside the last panel, never over a bar (the overall pair is the rightmost, where a legend inside would sit)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
