"""Closing statements generated from the same numbers as their tables (issue 61): a run's summary line and its
held-out table are one set of numbers, each saying which mean it is (03: over items, with the score before
training; 05: over benchmarks); 05 says when the checkpoint scores as the base model on every benchmark."""

from __future__ import annotations

import math
import re

from mlflow import MlflowClient
from mlflow.entities import Metric

from papo_nb.infra.tracking import ensure_experiment
from papo_nb.workbook.evaluation.benchmarks import mlflow_metrics
from papo_nb.workbook.evaluation.policies import beside, beside_statement
from papo_nb.workbook.evaluation.report import headline
from papo_nb.workbook.results.page import BASE_BESIDE_TAG, run_report

KEYS = ("avg_at_k", "avg_at_k_masked", "gap_avg_at_k", "greedy", "greedy_masked", "gap_greedy")


def summarised(text: float, vision: float, masked_vision: float) -> list[dict]:
    """``benchmarks.summarise``'s shape: two benchmarks, their groups and the overall mean over benchmarks."""

    def row(name, group, score, masked):
        return {"name": name, "group": group, **dict(zip(KEYS, (score, masked, score - masked) * 2))}

    rows = [
        row("testbed_text", "general", text, text),
        row("testbed_vision", "vision_dependent", vision, masked_vision),
    ]
    rows += [row("general", "summary", text, text), row("vision_dependent", "summary", vision, masked_vision)]
    overall = ((text + vision) / 2, (text + masked_vision) / 2)
    return rows + [row("overall", "summary", *overall)]


def report_of(store: str, name: str, metrics: dict, tags: dict | None = None) -> str:
    client = MlflowClient(store)
    run_id = client.create_run(ensure_experiment(store), run_name=name, tags=tags or {}).info.run_id
    client.log_batch(run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
    client.set_terminated(run_id, "FINISHED")
    return run_report(run_id, client)


def summary_and_first_row(report: str) -> tuple[tuple[str, str], list[str]]:
    summary = re.search(
        r"held-out \*\*([\d.]+|not measured)\*\* original / \*\*([\d.]+|not measured)\*\* masked", report
    )
    table = report.split("### Held-out accuracy", 1)[1].splitlines()
    first = next(line for line in table if line.startswith("| ") and not line.startswith(("| split", "| ---")))
    return summary.groups(), [cell.strip() for cell in first.strip("|").split("|")]


def test_notebook_05s_summary_line_and_table_agree_and_say_the_mean_is_over_benchmarks(mlflow_store):
    """Fails on 1f60324: the line said "0.823 original / 0.677 masked" over a table whose masked cell read "not
    measured" (the table read 03's keys, the line 05's)."""
    metrics = mlflow_metrics(summarised(1.0, 0.646, 0.354))
    report = report_of(mlflow_store, "05_evaluation", metrics)
    (original, masked), row = summary_and_first_row(report)
    assert (original, masked) == (row[1], row[2]) == ("0.823", "0.677"), (report, row)
    assert "not measured" not in report
    assert "(greedy, mean over 2 benchmarks)" in report and row[0] == "overall (mean over 2 benchmarks)"
    assert metrics["eval/overall/benchmarks"] == 2.0


def test_notebook_03s_line_says_the_mean_is_over_items_and_gives_the_score_before_training(mlflow_store):
    metrics = {"eval/accuracy_original": 0.8333, "eval/accuracy_masked": 0.7083, "eval/items": 48.0}
    metrics |= {"eval_before/accuracy_original": 0.8125, "eval_before/accuracy_masked": 0.6875}
    report = report_of(mlflow_store, "03_training_run", metrics)
    (original, masked), row = summary_and_first_row(report)
    assert (original, masked) == (row[1], row[2]) == ("0.833", "0.708")
    assert "(greedy, mean over 48 items; before training 0.812 / 0.688)" in report
    assert row[0] == "all items" and row[4:] == ["48", "0.812", "0.688"], row
    assert "before training: original | masked |" in report


def test_the_base_model_sentence_says_when_the_checkpoint_scores_as_the_base_everywhere(mlflow_store):
    """Issue 61: 05's table showed the checkpoint equal to the base on every benchmark (probabilities moved about
    1e-4) without saying so. The sentence comes from the table's rows, and the results page carries it."""
    base = summarised(0.99, 0.62, 0.35)
    same = beside(base, base)
    statement = beside_statement(same)
    assert statement.startswith("The checkpoint scores exactly as the base model on every benchmark (5 rows")
    moved = summarised(0.99, 0.65, 0.35)
    rows = beside(moved, base)
    changed = [row for row in rows if round(row["change"], 3) != 0]
    assert beside_statement(rows) == (
        f"The checkpoint differs from the base model on {len(changed)} of 5 rows; the largest change is +0.030 on "
        "testbed_vision."
    )
    report = report_of(mlflow_store, "05_evaluation", mlflow_metrics(base), {BASE_BESIDE_TAG: statement})
    assert f"**Against the base model**: {statement}" in report


def test_05s_printed_headline_names_its_mean():
    line = headline(summarised(1.0, 0.646, 0.354), 4)
    assert line.endswith("greedy 0.823 original, 0.677 masked: each a mean over 2 benchmarks (the paper's average), "
                         "not over items")  # fmt: skip
    assert not math.isnan(float(line.split()[2]))
