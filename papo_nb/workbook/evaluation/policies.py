"""Notebook 05's scores of a policy, and where they go in MLflow.

Each policy's scores are logged at the policy's training step (the checkpoint's ``checkpoint-<step>``, 0 for the
  base model): with ``eval_base_beside`` both land on notebook 05's run under the same keys, the run's own value is
  the trained one (the larger step), and the models list shows each model's scores in the same columns. Every
  benchmark's scores carry that benchmark as their dataset. Which checkpoint is scored: ``checkpoint_source``.
"""

from __future__ import annotations

import math

import mlflow

from papo_nb.workbook.evaluation import benchmarks, eval_review
from papo_nb.workbook.results.page import BASE_BESIDE_TAG


def log_scores(params, table: list[dict], suites: dict, step: int) -> dict[str, float]:
    """``benchmarks.mlflow_metrics(table)`` into the active run and model at ``step``: each benchmark's own keys with
    that benchmark as their dataset, the group and overall means without one. Returns what was logged."""
    metrics = benchmarks.mlflow_metrics(table)
    for name, (rows, _, _) in suites.items():
        own = {k: v for k, v in metrics.items() if k.startswith(f"eval/{name}/")}
        if own:
            mlflow.log_metrics(own, step=step, dataset=eval_review.benchmark_input(params, name, rows))
    pooled = {k: v for k, v in metrics.items() if not any(k.startswith(f"eval/{n}/") for n in suites)}
    mlflow.log_metrics(pooled, step=step)
    return metrics


def score_policy(params, model, processor, suites: dict, *, review: bool = True) -> tuple[dict, list[dict]]:
    """(per benchmark scores, ``summarise``'s table) of ``model`` on ``suites`` with the notebook's protocol;
    ``review`` also logs each benchmark's held-out completions table."""
    per_benchmark = {
        name: benchmarks.evaluate_benchmark(
            model,
            processor,
            rows,
            samples=params.eval_samples,
            max_new_tokens=params.max_completion_length,
            mask_ratio=params.mask_ratio,
            seed=params.seed,
            review=review,
        )  # fmt: skip
        for name, (rows, _, _) in suites.items()
    }
    return per_benchmark, benchmarks.summarise(per_benchmark, {n: group for n, (_, group, _) in suites.items()})


def score_base_beside(params, suites: dict) -> list[dict]:
    """The base model on the same benchmarks, seeds and masks, its scores logged at step 0 on its own logged model
    (no completions table: that is the checkpoint's); ``summarise``'s table."""
    model, processor, _ = benchmarks.load_eval_policy(params, base=True)
    _, table = score_policy(params, model, processor, suites, review=False)
    log_scores(params, table, suites, step=0)
    return table


def compare_with_base(params, table: list[dict], suites: dict) -> tuple[list[dict], str]:
    """The base model scored beside the checkpoint (``score_base_beside``): ``beside``'s rows and
    ``beside_statement``'s sentence, which is tagged on the run so its results page says it too."""
    rows = beside(table, score_base_beside(params, suites))
    statement = beside_statement(rows)
    mlflow.set_tag(BASE_BESIDE_TAG, statement)
    return rows, statement


def beside(trained: list[dict], base: list[dict], key: str = "avg_at_k") -> list[dict]:
    """Rows ``name, base, trained, change`` of ``key`` (NaN where a benchmark had no items)."""
    base_by_name = {row["name"]: row[key] for row in base}
    rows = []
    for row in trained:
        before = base_by_name.get(row["name"], math.nan)
        rows.append({"name": row["name"], "base": before, "trained": row[key], "change": row[key] - before})
    return rows


def beside_statement(rows: list[dict], decimals: int = 3) -> str:
    """What ``beside``'s rows say, in one sentence from the same numbers: that the checkpoint scores as the base
    model on every benchmark (each change rounds to 0 at the table's ``decimals``), or where it moved most."""
    changes = [(row["name"], row["change"]) for row in rows if math.isfinite(row["change"])]
    if not changes:
        return "No benchmark had items: nothing to compare with the base model."
    moved = [(name, change) for name, change in changes if round(change, decimals) != 0]
    if not moved:
        largest = max(abs(change) for _, change in changes)
        return (
            f"The checkpoint scores exactly as the base model on every benchmark ({len(changes)} rows, largest change "
            f"{largest:.1e}): training did not move these scores."
        )
    name, change = max(moved, key=lambda item: abs(item[1]))
    return (
        f"The checkpoint differs from the base model on {len(moved)} of {len(changes)} rows; the largest change is "
        f"{change:+.{decimals}f} on {name}."
    )
