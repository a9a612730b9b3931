"""The study's numbers as tables for reading: ``summary_rows`` pivoted per metric, and GitHub-markdown tables."""

from __future__ import annotations

import math

NO_ITEMS = "no items"

TABLE_METRICS = (
    "avg_at_k/original/all",
    "avg_at_k/original/vision",
    "avg_at_k/original/text",
    "avg_at_k/masked/vision",
    "avg_at_k/gap/vision",
    "greedy/original/all",
    "greedy/original/vision",
    "greedy/original/text",
    "greedy/gap/vision",
)


def _pm(centre: float, half: float) -> str:
    if not math.isfinite(centre):
        return NO_ITEMS
    return f"{centre:.3f}" if math.isnan(half) else f"{centre:.3f} ± {half:.3f}"


def _p(p_value: float, seeds: int) -> str:
    if math.isfinite(p_value):
        return f"p={p_value:.2g}"
    return "p: needs 2+ seeds" if seeds < 2 else "p: none, every seed gave the same difference"


def comparison_table(rows: list[dict], control: str) -> list[dict]:
    """``summary_rows`` pivoted for reading: one row per metric, ``mean ± 95% CI`` per arm, and per other arm its
    paired difference against ``control`` with the paired t-test's p-value."""
    table: dict[str, dict] = {}
    for row in rows:
        line = table.setdefault(row["metric"], {"metric": row["metric"]})
        line[row["arm"]] = _pm(row["mean"], row["ci95"])
        if row["arm"] != control:
            diff = _pm(row[f"diff_vs_{control}"], row[f"diff_ci95_vs_{control}"])
            p_value = row[f"p_value_vs_{control}"]
            line[f"{row['arm']} - {control}"] = diff if diff == NO_ITEMS else f"{diff} ({_p(p_value, row['seeds'])})"
    return list(table.values())


def markdown_table(rows: list[dict]) -> str:
    """A GitHub-markdown table of dict rows (the keys of the first row are the columns)."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def cell(value) -> str:
    """A float to 4 significant digits; NaN (nothing to compute it from: no items, or a key the runs did not log)
    reads as words, never as a number."""
    if isinstance(value, float):
        return "not recorded" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def records_markdown(rows: list[dict]) -> str:
    """``markdown_table`` with floats to 4 significant digits."""
    return markdown_table([{key: cell(value) for key, value in row.items()} for row in rows])
