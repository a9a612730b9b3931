"""The gamma-zero probe's evidence as a reviewer reads it: every number in ``evidence/probe.json``, a figure of the
per-term and per-block leak tests (``figures/probe.png``), and a handful of headline metrics. Logged as metrics,
the per-term and per-block fits were some 290 one-value charts that buried a run's training curves.
"""

from __future__ import annotations

import json
import math
import warnings

import mlflow
from matplotlib.figure import Figure

from papo_nb.workbook.config.evidence_names import PROBE

# The probe numbers a run's metrics keep (as ``<prefix>/<name>``): the verdict, its power, the norm rule's numbers and
# each test's statistic.
PROBE_HEADLINES = (
    "passed",
    "underpowered",
    "powered",
    "leak_detection_power",
    "loss_bit_equal",
    "grad_diff_norm",
    "tolerance",
    "perception_grad_norm",
    "norm_statistic",
    "projection_statistic",
    "block_statistic",
    "weakest_margin_at_recipe_gamma",
    "perception_kl",
    "same_on_all_ranks",
)


def probe_headlines(evidence: dict, prefix: str) -> dict[str, float]:
    """``<prefix>/<name>`` for each of ``PROBE_HEADLINES`` the evidence holds as a finite number or bool."""
    out = {}
    for name in PROBE_HEADLINES:
        value = evidence.get(name)
        if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[f"{prefix}/{name}"] = float(value)
    return out


def plot_probe(evidence: dict) -> Figure | None:
    """One panel per tested term: each block's leak statistic (its fitted coefficient over the smallest it can
    detect; above 1 a leak is seen) with the term's whole-gradient statistic as a line; None without block fits."""
    blocks = evidence.get("block_leaks") or {}
    terms = sorted({term for leaks in blocks.values() for term, e in leaks.items() if e.get("testable")})
    if not terms:
        return None
    fig = Figure(figsize=(10, 2.6 * len(terms)), layout="constrained")
    for ax, term in zip(fig.subplots(len(terms), 1, squeeze=False)[:, 0], terms):
        names = [block for block, leaks in blocks.items() if leaks.get(term, {}).get("testable")]
        values = [abs(blocks[block][term]["statistic"]) for block in names]
        ax.bar(range(len(names)), values, color="#1f77b4")
        ax.axhline(1.0, color="#d62728", linestyle="--", label="leak seen above 1")
        whole = (evidence.get("term_leaks") or {}).get(term, {})
        if whole.get("testable"):
            ax.axhline(abs(whole["statistic"]), color="#2ca02c", label="whole gradient")
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=6)
        ax.set_ylabel("|coefficient| / detectable")
        ax.set_title(f"{term}: gamma-zero leak test per parameter block ({evidence.get('status')})")
        ax.legend(fontsize=7, loc="upper right")
    return fig


def log_probe_evidence(evidence: dict, prefix: str, tracker=None) -> dict[str, float]:
    """Log the probe's evidence to the active run: the whole of it as ``evidence/probe.json``, its figure as
    ``figures/probe.png`` and ``probe_headlines`` as metrics (returned), through ``tracker`` (the ``mlflow`` module by
    default; a training run's spool, which journals the JSON and the metrics but draws no figure)."""
    tracker = tracker or mlflow
    plain = json.loads(json.dumps(evidence, default=str))  # tensors or dtypes, if any, as text
    tracker.log_dict(plain, PROBE)
    figure = plot_probe(plain)
    if figure is not None:
        try:
            tracker.log_figure(figure, "figures/probe.png")
        except Exception as exc:  # noqa: BLE001 - a figure drawn from the JSON must not end a run that logged the JSON
            warnings.warn(f"figures/probe.png not logged ({exc}); evidence/probe.json has its numbers", stacklevel=2)
    metrics = probe_headlines(plain, prefix)
    if metrics:
        tracker.log_metrics(metrics)
    return metrics
