"""What a long run meets (docs/scale-out.md, "Faults"), each for real and bounded in time: a real ``mlflow server`` on
127.0.0.1 stopped mid-run past the client's retry budget and restarted, or never restarted and then ``papo-nb sync``;
a SIGTERM mid-run, resumed to the uninterrupted run's metrics step for step; a full tmpfs during a checkpoint.

All runs are ``papo-nb train`` on params/smoke_fast.yaml (16 steps, a checkpoint every 4) in child processes.
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from training_child import DEADLINE, SCRIPT, SMOKE, Train, only_run

from papo_nb.infra.servers import free_port, serve_mlflow_ui
from papo_nb.train.disk_full import DISK_FULL_EXIT
from papo_nb.train.preemption import PREEMPTED_EXIT, PREEMPTION_MARK
from papo_nb.train.run_folder import SUMMARY_FILE
from papo_nb.train.spool import FAST_FAILING_HTTP, JOURNAL_FILE, spool_dir
from papo_nb.train.spooled_tracking import DRAIN_ENV

pytestmark = pytest.mark.slow

MAX_STEPS, SAVE_STEPS = 16, 4
# down longer than the run's MLflow HTTP budget (no retry, a 5 s timeout: FAST_FAILING_HTTP), and for several steps
OUTAGE_SECONDS, OUTAGE_STEPS = 3 * float(FAST_FAILING_HTTP["MLFLOW_HTTP_REQUEST_TIMEOUT"]), 4
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def overrides(max_steps: int = MAX_STEPS) -> list[str]:
    return [f"max_steps={max_steps}", f"save_steps={SAVE_STEPS}"]


def server_address(folder: Path) -> tuple[str, int, str]:
    """The store, the local port and the URI of an ``mlflow server`` kept in ``folder``: stopped, it starts again on
    the same three, as a tracking server that comes back does."""
    port = free_port("127.0.0.1")
    return f"sqlite:///{folder}/server.db", port, f"http://127.0.0.1:{port}"


def papo_nb_train(out: Path, uri: str, *extra: str, max_steps: int = MAX_STEPS, env=None) -> Train:
    flags = [arg for item in overrides(max_steps) for arg in ("-p", item)]
    return Train([str(SCRIPT), "train", "--params", str(SMOKE), *flags, "--output-dir", str(out), *extra], uri, env)


def step_logs(out: Path) -> dict[int, dict]:
    history = json.loads((out / SUMMARY_FILE).read_text())["log_history"]
    return {entry["step"]: entry for entry in history if "loss" in entry}


def assert_every_metric_once(client: MlflowClient, run_id: str, out: Path) -> int:
    """Every number of the run's log history (each step's metrics and the closing summary) is in the store exactly
    once, at its step, with its value; returns how many (metric, step) rows were checked."""
    logged: dict[str, list[tuple[int, float]]] = {}
    for entry in json.loads((out / SUMMARY_FILE).read_text())["log_history"]:
        for key, value in entry.items():
            if key != "step" and isinstance(value, (int, float)):
                logged.setdefault(key, []).append((entry["step"], float(value)))
    for key, rows in logged.items():
        stored = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [step for step, _ in stored] == sorted(step for step, _ in rows), f"{key}: {stored} stored, {rows}"
        assert [value for _, value in stored] == pytest.approx([value for _, value in sorted(rows)], rel=1e-6), key
    return sum(map(len, logged.values()))


# --------------------------------------------------------------------------------------------
# the tracking server goes away
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outage_run(tmp_path_factory):
    """A run whose tracking server is stopped after step 3, left down for OUTAGE_SECONDS and OUTAGE_STEPS steps, and
    started again on the same port and store; read back while it is up."""
    folder = tmp_path_factory.mktemp("outage")
    store, port, uri = server_address(folder)
    out = folder / "run"
    with serve_mlflow_ui(port=port, tracking_uri=store, startup_timeout=DEADLINE):
        # the run waits at its end for the server to return (starting it again takes a while on a busy machine)
        train = papo_nb_train(out, uri, env={DRAIN_ENV: str(DEADLINE)})
        train.wait_until(lambda: train.last_step() >= 3, "step 3")
    down_at, step_at_down = time.monotonic(), train.last_step()
    train.wait_until(
        lambda: time.monotonic() - down_at >= OUTAGE_SECONDS and train.last_step() >= step_at_down + OUTAGE_STEPS,
        "progress while the server is down",
    )
    step_at_up = train.last_step()
    with serve_mlflow_ui(port=port, tracking_uri=store, startup_timeout=DEADLINE):
        up_at, step_back = time.monotonic(), train.last_step()
        returncode = train.finish()
        (folder / "train.log").write_text(train.text)  # what the run printed, for a failure's reader
        client = MlflowClient(uri)
        run = only_run(client)
        checked = assert_every_metric_once(client, run.info.run_id, out) if returncode == 0 else 0
    return dict(
        train=train,
        out=out,
        returncode=returncode,
        run=run,
        checked=checked,
        down_at=down_at,
        up_at=up_at,
        step_at_down=step_at_down,
        step_at_up=step_at_up,
        step_back=step_back,
    )


def test_an_outage_neither_pauses_training_nor_loses_or_repeats_a_metric(outage_run):
    o = outage_run
    train = o["train"]
    assert o["returncode"] == 0, train.text[-4000:]
    times = train.step_times()
    durations = {step: times[step] - times[step - 1] for step in times if step - 1 in times}
    during = [d for step, d in durations.items() if o["step_at_down"] < step <= o["step_at_up"]]
    outside = [d for step, d in durations.items() if step <= o["step_at_down"] or step > o["step_at_up"] + 1]
    median = statistics.median(outside)
    print(
        f"\noutage {o['up_at'] - o['down_at']:.1f} s over steps {o['step_at_down'] + 1}-{o['step_at_up']}: longest "
        f"step {max(during):.2f} s during it, median {median:.2f} s outside ({len(outside)} steps), "
        f"{o['checked']} (metric, step) pairs in the store once each; the server answered again "
        + (f"after step {o['step_back']}" if o["step_back"] < MAX_STEPS else "after the last step")
    )
    assert len(during) >= OUTAGE_STEPS, "training did not go on while the server was down"
    assert max(during) < 5 * median + 1.0, f"a step took {max(during):.2f} s during the outage (median {median:.2f})"
    assert o["checked"] >= MAX_STEPS * 10  # every step's metrics, exactly once, with their values (checked above)
    assert train.text.count("is unreachable") == 1 and "answers again" in train.text
    assert o["run"].info.status == "FINISHED"
    assert o["run"].data.tags["papo_nb.probe_status"] in {"passed", "underpowered"}
    assert json.loads((spool_dir(o["out"]) / "delivered.json").read_text())["seq"] > MAX_STEPS


def test_a_server_that_never_returns_ends_the_run_and_sync_delivers_everything_once(tmp_path):
    store, port, uri = server_address(tmp_path)
    out = tmp_path / "run"
    with serve_mlflow_ui(port=port, tracking_uri=store, startup_timeout=DEADLINE):
        train = papo_nb_train(out, uri, max_steps=8, env={DRAIN_ENV: "2"})
        train.wait_until(lambda: train.last_step() >= 2, "step 2")
    assert train.finish() == 0, train.text[-4000:]
    assert f"papo-nb sync {out}" in train.text and str(spool_dir(out) / JOURNAL_FILE) in train.text
    with serve_mlflow_ui(port=port, tracking_uri=store, startup_timeout=DEADLINE):
        client = MlflowClient(uri)
        assert only_run(client).info.status == "RUNNING"  # its end is in the spool too
        for attempt in range(2):  # a second sync finds nothing left and logs nothing twice
            sync = subprocess.run([str(SCRIPT), "sync", str(out)], capture_output=True, text=True, timeout=DEADLINE)
            assert sync.returncode == 0, sync.stdout + sync.stderr
            assert ("delivered 0 call(s)" in sync.stdout) == (attempt == 1), sync.stdout
            run = only_run(client)
            assert run.info.status == "FINISHED"
            assert assert_every_metric_once(client, run.info.run_id, out) >= 8 * 10
    missing = subprocess.run([str(SCRIPT), "sync", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "holds no MLflow spool" in missing.stderr


# --------------------------------------------------------------------------------------------
# preemption
# --------------------------------------------------------------------------------------------


def test_sigterm_checkpoints_exits_75_and_resumes_to_the_uninterrupted_metrics(outage_run, tmp_path):
    """The outage run is the uninterrupted reference (its tracking does not touch training)."""
    uri, out = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "run"
    train = papo_nb_train(out, uri)
    train.wait_until(lambda: train.last_step() >= SAVE_STEPS + 1, f"step {SAVE_STEPS + 1}")
    train.process.send_signal(signal.SIGTERM)
    assert train.finish() == PREEMPTED_EXIT, train.text[-4000:]
    (checkpoint,) = [p for p in out.glob("checkpoint-*") if (p / PREEMPTION_MARK).is_file()]
    mark = json.loads((checkpoint / PREEMPTION_MARK).read_text())
    assert mark["signal"] == "SIGTERM" and SAVE_STEPS < mark["step"] < MAX_STEPS
    assert checkpoint.name == f"checkpoint-{mark['step']}" and train.last_step() == mark["step"]
    print(
        f"\nSIGTERM after step {SAVE_STEPS + 1}: checkpoint-{mark['step']} marked "
        f"{mark['seconds_signal_to_checkpoint']:.2f} s after the signal"
    )
    resumed = papo_nb_train(out, uri, "--resume")
    assert resumed.finish() == 0, resumed.text[-4000:]
    assert min(resumed.step_times()) == mark["step"] + 1
    reference, logs = step_logs(outage_run["out"]), step_logs(out)
    assert sorted(logs) == sorted(reference) == list(range(1, MAX_STEPS + 1))
    for step, entry in reference.items():
        expected = {k: v for k, v in entry.items() if k not in TIMING_KEYS}
        assert {k: v for k, v in logs[step].items() if k not in TIMING_KEYS} == expected, f"step {step} differs"
    assert only_run(MlflowClient(uri)).info.status == "FINISHED"


# --------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------

DRIVER = (
    "import sys; from papo_nb.train.runner import train_command; "
    "sys.exit(train_command(sys.argv[1], sys.argv[2:-2], sys.argv[-2], resume=sys.argv[-1] == 'resume', "
    "report_to='none'))"
)


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (mounting needs root: the CI containers and this machine run tests as root)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"environment: cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_to_resume_from(small_disk, tmp_path):
    """Tracking is off (report_to none) so that the checkpoint is the one thing written when the disk fills."""
    out, filler = small_disk / "run", small_disk / "filler"

    def run(mode: str) -> Train:
        command = [sys.executable, "-c", DRIVER, str(SMOKE), *overrides(2 * SAVE_STEPS), str(out), mode]
        return Train(command, f"sqlite:///{tmp_path}/mlflow.db")

    train = run("fresh")
    train.wait_until(lambda: f"saved checkpoint-{SAVE_STEPS}" in train.text, f"checkpoint-{SAVE_STEPS}")
    free = shutil.disk_usage(small_disk).free
    filler.write_bytes(b"\0" * (free - 40 * 1024))  # less than a checkpoint (about 150 kB) is left
    assert train.finish() == DISK_FULL_EXIT, train.text[-4000:]
    partial = f"checkpoint-{2 * SAVE_STEPS}"
    assert "is full (ENOSPC)" in train.text and f"the resume point is {out / f'checkpoint-{SAVE_STEPS}'}" in train.text
    assert not (out / partial).exists() and len(list(out.glob(f"incomplete-{partial}-*"))) == 1
    filler.unlink()
    resumed = run("resume")
    assert resumed.finish() == 0, resumed.text[-4000:]
    assert min(resumed.step_times()) == SAVE_STEPS + 1 and resumed.last_step() == 2 * SAVE_STEPS
    evidence = json.loads((out / "resume_evidence.json").read_text())
    assert evidence["checkpoint"] == str(out / f"checkpoint-{SAVE_STEPS}")
