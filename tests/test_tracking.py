"""papo_nb.infra.tracking against a real MLflow SQLite store in tmp_path."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import mlflow  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import papo_nb  # noqa: E402
from papo_nb.infra.tracking import (  # noqa: E402
    EXPERIMENT_NAME,
    absolute_tracking_uri,
    attach_notebook_run,
    attach_run,
    default_tracking_uri,
    log_evidence,
    log_figure,
    search_workbook_runs,
    standard_tags,
    tracking_client,
)
from papo_nb.papo.contract import PAPO_ADAPTER_VERSION  # noqa: E402


def test_default_uri_is_absolute(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project = Path(papo_nb.__file__).resolve().parents[1]
    assert default_tracking_uri() == f"sqlite:///{project / 'mlflow.db'}"
    assert default_tracking_uri().startswith("sqlite:////")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///rel/x.db")
    assert default_tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'rel' / 'x.db'}"
    assert absolute_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_interactive_attach_then_evidence_figure_tags(tmp_path, mlflow_store):
    run = attach_notebook_run("", "")  # as in JupyterLab: no runner, default (here: env) store
    assert mlflow.active_run().info.run_id == run.info.run_id
    assert attach_notebook_run(mlflow_store, run.info.run_id).info.run_id == run.info.run_id  # re-running the cell
    experiment = MlflowClient(mlflow_store).get_experiment(run.info.experiment_id)
    assert experiment.name == EXPERIMENT_NAME
    assert experiment.artifact_location == (tmp_path / "mlartifacts" / EXPERIMENT_NAME).as_uri()

    evidence = {
        "loss": np.float32(0.5),
        "passed": np.bool_(True),
        "steps": torch.tensor(4),
        "gap": {"fp32": 1e-7, "bf16": float("inf"), "nan": float("nan")},
        "per_step": [1.0, float("nan")],
        "name": "probe",
    }
    logged = log_evidence("probe", evidence, prefix="calib")
    assert logged == {"calib/loss": 0.5, "calib/passed": 1.0, "calib/steps": 4.0, "calib/gap/fp32": 1e-7}
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert log_figure(fig, "loss_curve") == "figures/loss_curve.png"
    plt.close(fig)
    tags = standard_tags(upstream_sha_verified=False, phase="phase2", precision="bf16")
    mlflow.end_run()

    client = MlflowClient(mlflow_store)
    finished = client.get_run(run.info.run_id)
    assert finished.data.metrics == {**logged}
    assert finished.data.tags["papo_nb.interactive"] == "true"
    assert tags == {
        "papo_nb.adapter_version": PAPO_ADAPTER_VERSION,
        "papo_nb.trl_version": trl.__version__,
        "papo_nb.upstream_sha_verified": "no",
        "papo_nb.phase": "phase2",
        "papo_nb.precision": "bf16",
    }
    assert all(finished.data.tags[k] == v for k, v in tags.items())
    saved = json.loads(
        Path(client.download_artifacts(run.info.run_id, "evidence/probe.json", str(tmp_path))).read_text()
    )
    assert saved["gap"] == {"fp32": 1e-7, "bf16": "inf", "nan": "nan"} and saved["per_step"] == [1.0, "nan"]
    assert saved["steps"] == 4 and saved["passed"] is True and math.isclose(saved["loss"], 0.5)
    png = tmp_path / "mlartifacts" / EXPERIMENT_NAME / run.info.run_id / "artifacts" / "figures" / "loss_curve.png"
    assert png.read_bytes()[:4] == b"\x89PNG"  # artifacts land next to the database

    frame = search_workbook_runs(mlflow_store, filter_string="tags.`papo_nb.phase` = 'phase2'")
    assert list(frame["run_id"]) == [run.info.run_id]
    assert frame["metrics.calib/gap/fp32"].iloc[0] == 1e-7


RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mlflow import MlflowClient
    from papo_nb.infra.tracking import ensure_experiment
    uri, barrier, n, me = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    (barrier / me).touch()  # everyone imported: go together
    while len(list(barrier.iterdir())) < n:
        time.sleep(0.005)
    experiment_id = ensure_experiment(uri)
    client = MlflowClient(uri)
    run = client.create_run(experiment_id, run_name=me)
    client.set_terminated(run.info.run_id)
    print(experiment_id)
    """
)


@pytest.mark.slow
def test_fresh_store_opened_by_three_processes_at_once(tmp_path):
    # Unguarded, MLflow's schema creation fails here with "duplicate column name" (or the experiment
    # with "already exists") in all but one process.
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, uri, str(barrier), "3", f"p{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    for proc, (_out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    assert len({out.strip() for out, _ in results}) == 1  # one experiment
    runs = MlflowClient(uri).search_runs([results[0][0].strip()])
    assert sorted(r.info.run_name for r in runs) == ["p0", "p1", "p2"]


TELEMETRY_CHECK = textwrap.dedent(
    """
    import os
    import sys

    import papo_nb.infra.tracking  # noqa: F401
    from mlflow.telemetry import get_telemetry_client
    from mlflow.telemetry.utils import is_telemetry_disabled

    print(is_telemetry_disabled(), get_telemetry_client(), os.environ.get("MLFLOW_DISABLE_TELEMETRY"), sys.argv[1])
    """
)


def test_importing_the_tracking_module_turns_mlflow_telemetry_off():
    # MLflow itself stays quiet under pytest or CI: those variables are removed so that only ours count.
    quiet = {"PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS"}
    quiet |= {"MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"}
    env = {k: v for k, v in os.environ.items() if k not in quiet and not k.startswith("BUILDKITE")}
    out = subprocess.run(
        [sys.executable, "-c", TELEMETRY_CHECK, "done"], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "None", "true", "done"]


def test_a_run_in_another_store_never_logs_to_the_first_stores_model(tmp_path):
    """The process-global MLflow state of one store (active run, active logged model, active experiment) is dropped
    when a run attaches to another store: its metrics would otherwise reference a model the new store lacks
    (FOREIGN KEY constraint failed on logged_model_metrics, whatever ran earlier in the process)."""
    first, second = (f"sqlite:///{tmp_path / name}" for name in ("first.db", "second.db"))
    try:
        attach_run(first, "", run_name="first", tags={})
        model = mlflow.create_external_model(name="policy")
        mlflow.set_active_model(model_id=model.model_id)
        mlflow.set_experiment("elsewhere")
        run, started = attach_run(second, "", run_name="second", tags={})
        assert started and mlflow.get_active_model_id() is None
        assert os.environ.get("MLFLOW_EXPERIMENT_ID") is None
        mlflow.log_metrics({"score": 1.0})  # raised the foreign-key error while the first store's model was active
        client = MlflowClient(second)
        assert client.get_run(run.info.run_id).data.metrics == {"score": 1.0}
        assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT_NAME
    finally:
        while mlflow.active_run():
            mlflow.end_run()
        mlflow.clear_active_model()
        mlflow.set_tracking_uri(None)
        os.environ.pop("MLFLOW_EXPERIMENT_ID", None)


def test_a_client_of_another_store_never_links_metrics_to_this_stores_model(tmp_path):
    """``MlflowClient.log_metric`` links to the process's active logged model whatever store it writes to: the
    workbook runner's client (``tracking_client``) of a second store drops a model that store lacks, and keeps
    one it has."""
    first, second = (f"sqlite:///{tmp_path / name}" for name in ("first.db", "second.db"))
    try:
        attach_run(first, "", run_name="first", tags={})
        model = mlflow.create_external_model(name="policy")
        mlflow.set_active_model(model_id=model.model_id)
        assert tracking_client(first) and mlflow.get_active_model_id() == model.model_id  # its own store: kept
        client = tracking_client(second)
        assert mlflow.get_active_model_id() is None
        run = client.create_run(client.create_experiment("other"))
        client.log_metric(run.info.run_id, "papo_nb/wall_seconds", 1.0)  # the foreign-key error before
        assert client.get_run(run.info.run_id).data.metrics == {"papo_nb/wall_seconds": 1.0}
    finally:
        while mlflow.active_run():
            mlflow.end_run()
        mlflow.clear_active_model()
        mlflow.set_tracking_uri(None)


def test_the_experiment_is_a_training_experiment_new_or_old(tmp_path):
    from papo_nb.infra import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = tracking.tracking_client(uri)
    new = tracking.ensure_experiment(uri, "fresh")
    assert client.get_experiment(new).tags["mlflow.experimentKind"] == "finetuning"
    old = client.create_experiment("made-before")
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    assert tracking.ensure_experiment(uri, "made-before") == old
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "finetuning"
