"""A ``papo-nb train`` child process as the slow tests that kill, cut off or resume one start it (test_faults,
test_launch): its environment, its output lines with the time each arrived, and the one MLflow run it logs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlflow import MlflowClient

from papo_nb.infra.tracking import EXPERIMENT_NAME
from papo_nb.train.run_folder import PROGRESS_PREFIX

SMOKE = Path(__file__).resolve().parents[1] / "params" / "smoke_fast.yaml"
SCRIPT = Path(sys.executable).parent / "papo-nb"
DEADLINE = 300.0  # seconds any one run, server start or wait may take on a busy 2-core machine


def child_env(uri: str) -> dict[str, str]:
    """The environment of a child run logging to ``uri``: one thread (the machine is shared), unbuffered output so
    each progress line arrives when it is printed."""
    return {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Train:
    """A training child process; its output lines, each with the time it arrived."""

    def __init__(self, command: list[str], uri: str, extra_env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            command,
            env={**child_env(uri), **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def step_times(self) -> dict[int, float]:
        """When each ``step N/M`` progress line arrived."""
        marker = f"{PROGRESS_PREFIX} step "
        return {int(line.split(marker)[1].split("/")[0]): t for t, line in list(self.lines) if marker in line}

    def last_step(self) -> int:
        return max(self.step_times(), default=0)

    def wait_until(self, condition, what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            assert self.process.poll() is None, f"the run ended before {what}:\n{self.text[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {DEADLINE:.0f} s:\n{self.text[-4000:]}"
            time.sleep(0.05)

    def finish(self) -> int:
        try:
            self.process.wait(timeout=DEADLINE)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self.reader.join(timeout=30)
        return self.process.returncode


def only_run(client: MlflowClient):
    """The one run of the workbook's experiment in ``client``'s store (a second one would be a run not re-attached,
    or a rank logging its own)."""
    experiment = client.get_experiment_by_name(EXPERIMENT_NAME)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]
