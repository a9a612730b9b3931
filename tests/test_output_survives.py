"""Output never kills training (train.output): a closed stdout or stderr is survived and the run's own log file
carries on; ``papo-nb train ... | tee log`` under a SIGTERM to the whole process group (tee dies with it, as on a
cluster) leaves a marked checkpoint at its step and exits 75. A real pipe and a real process-group signal, bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from training_child import DEADLINE, SCRIPT, SMOKE, child_env

from papo_nb.train.output import LOG_FILE, SurvivingStream, start_run_log, surviving_output
from papo_nb.train.preemption import PREEMPTED_EXIT, PREEMPTION_MARK
from papo_nb.train.run_folder import PROGRESS_PREFIX


def test_a_stream_whose_reader_is_gone_is_dropped_and_its_log_carries_on(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write to the pipe is EPIPE
    pipe = os.fdopen(write_end, "w")
    with pytest.raises(BrokenPipeError):  # what a print in a Trainer callback met
        pipe.write("x\n")
        pipe.flush()
    with open(tmp_path / "log", "w") as log:
        stream = SurvivingStream(pipe, log)
        assert stream.write("step 1\n") == 7 and stream.lost
        stream.write("step 2\n")
        stream.flush()
    assert (tmp_path / "log").read_text() == "step 1\nstep 2\n"
    os.write(write_end, b"the descriptor now points at /dev/null\n")  # holders of the old stream write safely
    with open(tmp_path / "closed", "w") as closed:
        pass
    assert SurvivingStream(closed).write("to a closed file\n") == 17  # ValueError, survived


def test_surviving_output_copies_both_streams_into_the_log_and_restores_them(tmp_path, capsys):
    before = sys.stdout, sys.stderr
    with surviving_output(tmp_path / "run" / LOG_FILE):
        print("out line")
        start_run_log()  # the run accepted: the log opens with what came before
        print("err line", file=sys.stderr)
    assert (sys.stdout, sys.stderr) == before
    assert (tmp_path / "run" / LOG_FILE).read_text() == "out line\nerr line\n"
    assert capsys.readouterr() == ("out line\n", "err line\n")


def test_a_run_refused_before_its_log_starts_writes_nothing(tmp_path, capsys):
    with surviving_output(tmp_path / "run" / LOG_FILE):
        print("papo-nb train: error: refusing to resume", file=sys.stderr)
    assert not (tmp_path / "run").exists()
    assert "refusing to resume" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_to_the_process_group_under_tee_checkpoints_and_exits_75(tmp_path):
    teed, out = tmp_path / "tee.log", tmp_path / "run"
    tee = subprocess.Popen(["tee", teed], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, process_group=0)
    overrides = ["max_steps=200", "save_steps=200", "require_gpu_contract_probe=false"]
    command = [str(SCRIPT), "train", "--params", str(SMOKE), "--output-dir", str(out)]
    command += [arg for override in overrides for arg in ("-p", override)]
    env = child_env(f"sqlite:///{tmp_path / 'mlflow.db'}")
    train = subprocess.Popen(command, stdout=tee.stdin, stderr=subprocess.STDOUT, env=env, process_group=tee.pid)
    tee.stdin.close()  # the pipe's one writer is papo-nb train, as in `papo-nb train ... 2>&1 | tee log`
    try:
        deadline = time.monotonic() + DEADLINE
        while f"{PROGRESS_PREFIX} step 2/" not in (teed.read_text() if teed.exists() else ""):
            assert train.poll() is None and time.monotonic() < deadline, teed.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(tee.pid, signal.SIGTERM)  # the whole job, as a cluster stops it: tee dies, the pipe breaks
        assert tee.wait(timeout=30) == -signal.SIGTERM
        returncode = train.wait(timeout=DEADLINE)
    finally:
        for process in (train, tee):
            if process.poll() is None:
                process.kill()
    assert returncode == PREEMPTED_EXIT, f"exit {returncode}: " + teed.read_text()[-3000:]
    log = (out / LOG_FILE).read_text()
    (checkpoint,) = [p for p in out.glob("checkpoint-*") if (p / PREEMPTION_MARK).is_file()]
    mark = json.loads((checkpoint / PREEMPTION_MARK).read_text())
    assert mark["signal"] == "SIGTERM" and checkpoint.name == f"checkpoint-{mark['step']}" and mark["step"] >= 2
    stopped = f"stopped by SIGTERM after step {mark['step']}"
    assert stopped in log and stopped not in teed.read_text()  # written after the pipe broke: in the run's log
    assert f"{PROGRESS_PREFIX} step {mark['step']}/200" in log and "BrokenPipeError" not in log
    seconds = mark["seconds_signal_to_checkpoint"]
    print(f"\nprocess-group SIGTERM under tee: checkpoint-{mark['step']} marked {seconds:.2f} s after the signal")


def close_stdout_and_stderr() -> None:
    os.close(1)
    os.close(2)


@pytest.mark.slow
def test_a_run_started_with_stdout_and_stderr_closed_trains_and_logs(tmp_path):
    out = tmp_path / "run"
    command = [str(SCRIPT), "train", "--params", str(SMOKE), "--output-dir", str(out), "--skip-eval"]
    command += [arg for o in ("max_steps=2", "save_steps=2", "require_gpu_contract_probe=false") for arg in ("-p", o)]
    train = subprocess.Popen(
        command, env=child_env(f"sqlite:///{tmp_path / 'mlflow.db'}"), preexec_fn=close_stdout_and_stderr
    )
    assert train.wait(timeout=DEADLINE) == 0, (out / LOG_FILE).read_text()[-3000:]
    log = (out / LOG_FILE).read_text()
    assert f"{PROGRESS_PREFIX} step 2/2" in log and f"{PROGRESS_PREFIX} done at step 2" in log
