"""The results page of every run (issue 45), read back from a real MLflow SQLite store; the learning-signal flag; the
HTML copy of an executed notebook; a masked branch that did not run logs no number."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import nbformat
import torch
from accelerate import Accelerator
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import Metric

from papo_nb.infra.tracking import ensure_experiment
from papo_nb.papo.perception_metrics import MASKED_BRANCH_METRICS, log_perception_metrics
from papo_nb.workbook.config.evidence_names import STUDY_TABLE_MD
from papo_nb.workbook.results.page import NOTE_TAG, publish_notebook_page, publish_workbook_page
from papo_nb.workbook.results.probe_record import log_probe_evidence
from papo_nb.workbook.results.readable import write_html_copy
from papo_nb.workbook.results.signal import ZERO_STD_FLAG, signal_health


def child_run(client, experiment_id, parent_id, name, metrics, tags=(), zero_std=()):
    run = client.create_run(experiment_id, run_name=name, tags={"mlflow.parentRunId": parent_id, **dict(tags)})
    run_id = run.info.run_id
    client.log_batch(run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
    for step, share in enumerate(zero_std, start=1):
        client.log_metric(run_id, "frac_reward_zero_std", share, step=step)
    client.set_terminated(run_id, "FINISHED")  # as the runner leaves it before writing the page
    return run_id


def test_notebook_and_workbook_pages_carry_verdict_probe_heldout_and_roll_up(mlflow_store, tmp_path):
    client = MlflowClient(mlflow_store)
    experiment_id = ensure_experiment(mlflow_store)
    parent_id = client.create_run(experiment_id, run_name="workbook-x").info.run_id
    contract = child_run(
        client, experiment_id, parent_id, "01_contract_verification",
        {"verdict/passed": 1.0, "probe/passed": 1.0, "probe/leak_detection_power": 37.5},
        tags={"papo_nb.verdict": "PASS: upstream SHA verified, live TRL contract holds, gamma-zero probe passed"},
    )  # fmt: skip
    heldout = {"eval/accuracy_original": 0.8333, "eval/accuracy_masked": 0.7083, "eval/items": 48.0}
    heldout |= {"eval/accuracy_original/vision": 0.75, "eval/accuracy_masked/vision": 0.5625}
    training = child_run(
        client, experiment_id, parent_id, "03_training_run",
        {**heldout, "probe_final/passed": 1.0, "probe_final/leak_detection_power": 12.25},
        tags={"papo_nb.probe_status": "passed"}, zero_std=(1.0, 0.5, 0.0, 0.5, 1.0, 1.0),
    )  # fmt: skip
    figure = Figure()
    figure.subplots().plot([1, 2, 3])
    client.log_figure(training, figure, "figures/training_curves.png")
    client.log_text(training, "{}", "completions.json")
    study = child_run(client, experiment_id, parent_id, "04_method_study", {"study/headline/grpo": 0.734})
    client.log_text(
        study, "| metric | grpo | papo_g |\n| --- | --- | --- |\n| avg@k | 0.734 | 0.750 |\n", STUDY_TABLE_MD
    )

    pages = [publish_notebook_page(client, run_id) for run_id in (contract, training, study)]
    study_page = client.get_run(study).data.tags[NOTE_TAG]
    assert "| grpo | 0.734 |" in study_page and "| avg@k | 0.734 | 0.750 |" in study_page  # the arms, compared
    page = client.get_run(training).data.tags[NOTE_TAG]
    assert page.startswith(
        "**03_training_run finished** · probe **passed** (power 12.2) · held-out **0.833** original / **0.708** masked"
        " (greedy, mean over 48 items) · learning signal **WEAK** (67% of groups without reward spread)"
    )
    assert "Gamma-zero probe**: passed" in page and "12.2" in page
    assert "| all items | 0.833 | 0.708 | 0.125 | 48 |" in page and "| vision-dependent | 0.750 | 0.562 |" in page
    assert "WEAK: 67% of the groups had zero reward spread" in page and "step(s) 1, 5, 6" in page
    assert f"get-artifact?path=figures%2Ftraining_curves.png&run_uuid={training}" in page  # the curves, inline
    assert "[completions.json](" in page
    assert client.get_run(training).data.metrics["signal/zero_std_share"] == 4 / 6

    logged = publish_workbook_page(client, parent_id, pages)
    parent = client.get_run(parent_id).data
    assert logged == {key: parent.metrics[key] for key in logged}
    assert parent.metrics["headline/contract_passed"] == 1.0 and parent.metrics["headline/probe_passed"] == 1.0
    assert parent.metrics["headline/probe_power"] == 37.5  # the first notebook's probe (01) speaks for the workbook
    assert (
        parent.metrics["headline/heldout_original"] == 0.8333 and parent.metrics["headline/heldout_masked"] == 0.7083
    )
    assert parent.metrics["headline/zero_std_share"] == 4 / 6
    assert parent.tags["papo_nb.verdict"].startswith("PASS") and parent.tags["papo_nb.probe_status"] == "passed"
    workbook_page = parent.tags[NOTE_TAG]
    assert workbook_page.startswith("**3 notebooks finished** · contract **PASS** · probe **passed** (power 37.5)")
    assert "Contract verdict**: PASS" in workbook_page and "| all items | 0.833 | 0.708 |" in workbook_page
    assert f"#/experiments/{experiment_id}/runs/{training}" in workbook_page


def test_a_run_that_trained_nothing_has_no_signal_line_and_unmeasured_reads_as_such(mlflow_store):
    client = MlflowClient(mlflow_store)
    experiment_id = ensure_experiment(mlflow_store)
    parent_id = client.create_run(experiment_id, run_name="workbook-y").info.run_id
    run_id = child_run(client, experiment_id, parent_id, "03_training_run", {"eval/accuracy_original": 0.5})
    assert signal_health(client, run_id) is None
    record, headlines = publish_notebook_page(client, run_id)
    page = client.get_run(run_id).data.tags[NOTE_TAG]
    assert "Learning signal" not in page and "| all items | 0.500 | not measured | not measured |" in page
    assert headlines == {"headline/heldout_original": 0.5}


def test_the_signal_flag_sits_above_its_threshold(mlflow_store):
    client = MlflowClient(mlflow_store)
    experiment_id = ensure_experiment(mlflow_store)
    parent_id = client.create_run(experiment_id, run_name="workbook-z").info.run_id
    at = child_run(client, experiment_id, parent_id, "a", {}, zero_std=(ZERO_STD_FLAG,) * 2)
    above = child_run(client, experiment_id, parent_id, "b", {}, zero_std=(ZERO_STD_FLAG, ZERO_STD_FLAG + 0.25))
    assert not signal_health(client, at)["flagged"] and signal_health(client, above)["flagged"]
    assert (
        signal_health(client, at)["dead_steps"] == []
        and "every step carried signal" in signal_health(client, at)["message"]
    )


def test_the_html_copy_shows_outputs_and_a_failed_cells_traceback(tmp_path):
    book = nbformat.v4.new_notebook()
    ok = nbformat.v4.new_code_cell("print('held-out 0.83')")
    ok.outputs = [nbformat.v4.new_output("stream", name="stdout", text="held-out accuracy 0.83\n")]
    failed = nbformat.v4.new_code_cell("raise RuntimeError('boom')")
    failed.outputs = [
        nbformat.v4.new_output(
            "error", ename="RuntimeError", evalue="boom", traceback=["RuntimeError: boom at cell 2"]
        )
    ]
    book.cells = [ok, failed]
    path = tmp_path / "03_training_run.ipynb"
    nbformat.write(book, path)
    html = write_html_copy(path).read_text()
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert "held-out accuracy 0.83" in html and "boom at cell 2" in html


def test_a_skipped_masked_branch_logs_none_of_its_terms():
    """A term that was not computed is not logged: with the masked branch skipped the KL would read exactly 0 and the
    masked entropy the original one (issue 45). Measured, every term is there."""
    accelerator = Accelerator(cpu=True)
    sums, tokens = torch.tensor([0.0, 3.0, 3.0]), torch.tensor(6.0)
    logged = {}
    for measured in (True, False):
        metrics = defaultdict(list)
        log_perception_metrics(
            metrics, accelerator, sums, tokens, torch.tensor(0.5), gamma=0.0, discount=1.0, eta=(0.0, 0.0),
            masked_measured=measured,
        )  # fmt: skip
        logged[measured] = metrics
    assert set(MASKED_BRANCH_METRICS) <= set(logged[True])
    assert not set(MASKED_BRANCH_METRICS) & set(logged[False])
    assert logged[False]["original_entropy"] == [0.5] and math.isclose(logged[False]["papo/parent_loss"][0], 0.5)


def test_the_probe_logs_its_blocks_to_json_and_a_figure_and_only_headlines_as_metrics(mlflow_store):
    from papo_nb.infra.tracking import attach_run

    entry = {"testable": True, "statistic": 0.4, "share": 0.5, "coefficient": 1e-4, "detectable_coefficient": 2e-3}
    blocks = {f"layers.{i}.q_proj": {"perception_kl": entry, "masked_entropy": {"testable": False}} for i in range(40)}
    evidence = {
        "status": "passed", "passed": True, "leak_detection_power": 7.5, "norm_statistic": 0.1, "tolerance": 1e-3,
        "term_leaks": {"perception_kl": entry}, "block_leaks": blocks, "message": "ok", "block_statistic": 0.4,
    }  # fmt: skip
    run, _ = attach_run(mlflow_store, "", run_name="probe", tags={})
    logged = log_probe_evidence(evidence, prefix="probe_final")
    client = MlflowClient(mlflow_store)
    data = client.get_run(run.info.run_id).data
    assert (
        logged
        == data.metrics
        == {
            "probe_final/passed": 1.0,
            "probe_final/leak_detection_power": 7.5,
            "probe_final/tolerance": 1e-3,
            "probe_final/norm_statistic": 0.1,
            "probe_final/block_statistic": 0.4,
        }
    )
    stored = client.download_artifacts(run.info.run_id, "evidence/probe.json")
    assert len(json.loads(Path(stored).read_text())["block_leaks"]) == 40
    assert [a.path for a in client.list_artifacts(run.info.run_id, "figures")] == ["figures/probe.png"]


def test_the_closing_cell_states_what_the_run_logged_without_figures_or_links(mlflow_store):
    """Every notebook ends on ``run_report``: its verdicts and numbers read back from the store (issue 54)."""
    from papo_nb.workbook.results.page import run_report

    client = MlflowClient(mlflow_store)
    experiment_id = ensure_experiment(mlflow_store)
    parent_id = client.create_run(experiment_id, run_name="workbook-y").info.run_id
    metrics = {"eval/accuracy_original": 0.8333, "eval/accuracy_masked": 0.7083, "probe_final/passed": 1.0}
    run_id = child_run(client, experiment_id, parent_id, "03_training_run", metrics)
    client.log_text(run_id, "x", "figures/training_curves.png")
    report = run_report(run_id, client)
    assert report.startswith("**What 03_training_run showed** · probe **passed**")
    assert "held-out **0.833** original / **0.708** masked" in report
    assert "| all items | 0.833 | 0.708 | 0.125 |" in report
    assert "training_curves" not in report and "](" not in report  # the notebook shows its own figures
