"""The tracking spool (papo_nb.train.spool) against a real MLflow SQLite store, an address nobody answers on, and
real failing writes (/dev/full); the training runs that use it are in test_faults.py. A few seconds in all."""

from __future__ import annotations

import errno
import json
import time

import pytest
import torch

from papo_nb.infra.servers import free_port
from papo_nb.infra.tracking import ensure_experiment, tracking_client
from papo_nb.train.disk_full import disk_full_cause
from papo_nb.train.run_folder import RUN_INFO_FILE, write_json
from papo_nb.train.spool import (
    CURSOR_FILE,
    JOURNAL_FILE,
    TrackingSpool,
    deliver_spool,
    fast_failing_http,
    spool_dir,
    sync_command,
)
from papo_nb.train.spooled_tracking import DRAIN_ENV, drain_seconds


@pytest.fixture
def sqlite_run(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = tracking_client(uri)
    run = client.create_run(ensure_experiment(uri))
    return uri, client, run.info.run_id


def journal_a_run(spool: TrackingSpool, steps: int) -> None:
    spool.log_params({"lr": 0.005})
    for step in range(1, steps + 1):
        spool.log_metrics({"loss": 1.0 / step, "reward": float(step)}, step=step)
    spool.set_tags({"papo_nb.kind": "train"})
    spool.journal("log_dict", dictionary={"a": [1, 2]}, artifact_file="evidence/x.json")
    spool.journal("set_terminated", status="FINISHED", end_time=int(time.time() * 1000))


def test_a_spool_delivers_in_order_with_steps_and_timestamps_and_a_replay_repeats_nothing(sqlite_run, tmp_path):
    uri, client, run_id = sqlite_run
    spool = TrackingSpool(tmp_path / "run", run_id, uri)
    journal_a_run(spool, steps=5)
    assert spool.close(timeout=60) == 0
    journalled = [json.loads(line) for line in (spool_dir(tmp_path / "run") / JOURNAL_FILE).read_text().splitlines()]
    stamps = {r["kwargs"]["metrics"][0]["step"]: r["kwargs"]["metrics"][0]["timestamp"] for r in journalled[1:6]}
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value, m.timestamp) for m in history] == [(s, 1.0 / s, stamps[s]) for s in range(1, 6)]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.005"}
    assert run.data.tags["papo_nb.kind"] == "train"
    (spool_dir(tmp_path / "run") / CURSOR_FILE).unlink()  # as if the process died before recording delivery
    write_json(tmp_path / "run" / RUN_INFO_FILE, {"tracking_uri": uri})
    assert deliver_spool(tmp_path / "run") == (9, 0)  # params, 5 metrics, tags, dict, end
    assert [len(client.get_metric_history(run_id, key)) for key in ("loss", "reward")] == [5, 5]


def test_an_unreachable_store_warns_once_and_the_spool_names_its_sync_command(tmp_path, capsys, monkeypatch):
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    fast_failing_http()
    nobody = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    spool = TrackingSpool(tmp_path / "run", "0123", nobody)
    started = time.monotonic()
    journal_a_run(spool, steps=20)
    assert time.monotonic() - started < 5.0  # journalling never waits for the store
    left = spool.close(timeout=2)
    err = capsys.readouterr().err
    assert left == 24 and err.count("is unreachable") == 1
    assert f"papo-nb sync {tmp_path / 'run'}" in err
    write_json(tmp_path / "run" / RUN_INFO_FILE, {"tracking_uri": nobody})
    assert sync_command(str(tmp_path / "run"), "", timeout=0) == 1
    assert "did not answer" in capsys.readouterr().err


def test_bad_inputs_name_the_parameter(tmp_path, monkeypatch, capsys):
    spool = TrackingSpool(tmp_path / "run", "r", "sqlite:///unused.db", start=False)
    with pytest.raises(ValueError, match="method: 'log_model' is not journalled; allowed: log_batch"):
        spool.journal("log_model")
    monkeypatch.setenv(DRAIN_ENV, "soon")
    with pytest.raises(ValueError, match=f"{DRAIN_ENV}: 'soon' is not allowed"):
        drain_seconds()
    assert sync_command(str(tmp_path / "empty"), "", 10) == 2
    assert "holds no MLflow spool" in capsys.readouterr().err
    assert sync_command(str(tmp_path / "run"), "", -1) == 2


def test_a_full_device_is_recognised_however_the_writer_reports_it():
    with pytest.raises(OSError) as raw, open("/dev/full", "wb") as f:
        f.write(b"x" * 8192)
    assert raw.value.errno == errno.ENOSPC and disk_full_cause(raw.value) == "ENOSPC"
    with pytest.raises(RuntimeError) as torch_save:
        torch.save(torch.zeros(4096), "/dev/full")
    assert disk_full_cause(torch_save.value) is not None
    wrapped = RuntimeError("saving the checkpoint failed")
    wrapped.__cause__ = raw.value
    assert disk_full_cause(wrapped) == "ENOSPC"
    assert disk_full_cause(ValueError("a shape mismatch")) is None


def test_a_line_a_killed_process_left_half_written_is_dropped_and_the_rest_delivered(sqlite_run, tmp_path):
    uri, client, run_id = sqlite_run
    spool = TrackingSpool(tmp_path / "run", run_id, uri, start=False)
    spool.log_metrics({"loss": 0.5}, step=1)
    with spool.journal_path.open("a") as f:
        f.write('{"seq": 2, "method": "log_ba')  # SIGKILL in the middle of a write
    resumed = TrackingSpool(tmp_path / "run", run_id, uri)
    resumed.log_metrics({"loss": 0.25}, step=2)
    assert resumed.close(timeout=60) == 0 and resumed.seq == 2
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 0.5), (2, 0.25)]
