"""The workbook's two servers, the MLflow UI and JupyterLab, started as process groups and stopped cleanly.

``papo-nb ui`` and ``papo-nb lab`` use them; so do the browser tests. Both yield their url once the server
answers (``wait_until_answers``) and stop the whole process group on exit (``stop_process_group``).
JupyterLab runs under this interpreter (``sys.executable -m jupyter lab``), so the default ``python3`` kernel
(ipykernel's native spec, whose ``python`` jupyter_client replaces by the server's interpreter) sees the
installed ``papo_nb``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from papo_nb.infra.tracking import (
    TELEMETRY_OFF,
    absolute_tracking_uri,
    artifacts_dir,
    default_tracking_uri,
    ensure_experiment,
    tracking_client,
)


def free_port(host: str) -> int:
    """A port nobody listens on now (the OS picks it); the caller binds it soon after."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def stop_process_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the whole group (start_new_session made it one), SIGKILL what is left after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, else it lingers as a zombie group member
            try:
                os.killpg(process.pid, 0)  # is anyone of the group left?
            except ProcessLookupError:
                return
            time.sleep(0.1)
    process.wait()


def wait_until_answers(server: subprocess.Popen, answers: Callable[[], bool], name: str, url: str, timeout: float):
    """Poll ``answers()`` every 0.5 s until it is true; RuntimeError if ``server`` exits or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while not answers():
        if server.poll() is not None:
            raise RuntimeError(f"{name} exited with code {server.returncode} before answering on {url}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer on {url} within {timeout:.0f} s")
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------
# the MLflow UI
# --------------------------------------------------------------------------------------------


def health_answers(url: str) -> bool:
    """``url``/health answers 200 (MLflow's server and vLLM's OpenAI server both serve it)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# The "Model training" view of an experiment's runs (MLflow 3.17 opens GenAI pages otherwise), newest first. Its
# URL takes no column choice: the chosen columns live in the browser's localStorage (mlflow.sharedViewState.*).
RUNS_VIEW_QUERY = "workflowType=machine_learning&orderByKey=attributes.start_time&orderByAsc=false"


def runs_page(base_url: str, experiment_id: str) -> str:
    """The url of an experiment's runs in MLflow's model-training view."""
    return f"{base_url}/#/experiments/{experiment_id}/runs?{RUNS_VIEW_QUERY}"


def server_base(url: str) -> str:
    """``http://host:port`` of a url ``serve_mlflow_ui`` yielded."""
    return url.split("/#/", 1)[0].rstrip("/")


@contextmanager
def serve_mlflow_ui(
    port: int | None = None,
    host: str = "127.0.0.1",
    tracking_uri: str | None = None,
    startup_timeout: float = 120.0,
) -> Iterator[str]:
    """Run ``mlflow server`` (what ``mlflow ui`` runs) on the workbook store; once it answers, yield the url of the
    workbook experiment's runs in the model-training view (``runs_page``; ``server_base`` gives the server's url).

    Bound to ``host`` (local only by default) on ``port`` or a free one, one worker, MLflow's telemetry off. Artifacts
    uploaded through the server land in the same ``mlartifacts/`` as the runner's. On exit the server's whole
    process group (it starts uvicorn children) is terminated.
    """
    tracking_uri = absolute_tracking_uri(tracking_uri or default_tracking_uri())
    tracking_client(tracking_uri)  # create a fresh schema under our lock, not racing a workbook run
    experiment_id = ensure_experiment(tracking_uri)  # the page to land on exists before anything ran
    port = port or free_port(host)
    url = f"http://{host}:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    root = artifacts_dir(tracking_uri)
    if root is not None:
        command += ["--artifacts-destination", root.as_uri()]
    # The job runner (8 huey processes for GenAI evaluation jobs) is of no use here and slow to start.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **TELEMETRY_OFF, **os.environ}
    # Its chatter goes to stderr (fd 2) so stdout keeps only what the caller prints, like the url.
    server = subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=2)
    try:
        wait_until_answers(server, lambda: health_answers(url), "mlflow server", url, startup_timeout)
        yield runs_page(url, experiment_id)
    finally:
        stop_process_group(server)


# --------------------------------------------------------------------------------------------
# JupyterLab
# --------------------------------------------------------------------------------------------


def _lab_answers(base: str, token: str) -> bool:
    """The server answers its REST API with our token (the web app is served by then too)."""
    request = urllib.request.Request(f"{base}/api/status", headers={"Authorization": f"token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200 and "started" in json.loads(response.read() or b"{}")
    except (OSError, ValueError):
        return False


def _shutdown(base: str, token: str) -> None:
    """Ask the server to stop its kernels and exit (kernels run in their own sessions, out of its group)."""
    request = urllib.request.Request(
        f"{base}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"}
    )
    with suppress(OSError):
        urllib.request.urlopen(request, timeout=5).close()


# JupyterLab's defaults for this server (its settings overrides, below any setting a user saves): no autosave, since
# opening a tracked notebook and starting its kernel marks it modified (kernelspec, language_info, key order) and an
# autosave would then rewrite the file; nothing changes on disk until the user saves (Ctrl-S). No news or update
# check either (offline machines; no "Jupyter news?" toast over the notebook).
LAB_SETTING_OVERRIDES = {
    "@jupyterlab/docmanager-extension:plugin": {"autosave": False},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


@contextmanager
def serve_jupyterlab(
    notebook_dir: str | Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    token: str | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 120.0,
    stop_timeout: float = 20.0,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Run JupyterLab on ``notebook_dir``; yield ``http://host:port/lab?token=...`` once it answers.

    Bound to ``host`` (local only by default) on ``port`` or a free one, with ``token`` or a fresh random
    one. ``env`` (merged over ``os.environ``) is the server's and so its kernels' environment, e.g. an
    ``MLFLOW_TRACKING_URI``. ``LAB_SETTING_OVERRIDES`` are its settings' defaults (no autosave: opening and
    browsing a notebook leaves its file as it is). On exit the server is asked to shut down (its kernels with it);
    whatever of its process group is left after ``stop_timeout`` s is terminated. ``extra_args`` are passed to
    ``jupyter lab`` as they are.
    """
    notebook_dir = Path(notebook_dir).resolve()
    if not notebook_dir.is_dir():
        raise RuntimeError(f"notebook folder {notebook_dir} does not exist")
    with tempfile.TemporaryDirectory(prefix="papo_nb-lab-settings-") as app_settings:
        (Path(app_settings) / "overrides.json").write_text(json.dumps(LAB_SETTING_OVERRIDES, indent=2))
        yield from _run_jupyterlab(
            notebook_dir, app_settings, port, host, token, env, startup_timeout, stop_timeout, extra_args
        )


def _run_jupyterlab(notebook_dir, app_settings, port, host, token, env, startup_timeout, stop_timeout, extra_args):
    """``serve_jupyterlab``'s server, its settings overrides in ``app_settings``."""
    port = port or free_port(host)
    token = token or secrets.token_hex(24)
    base = f"http://{host}:{port}"
    command = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        f"--ServerApp.ip={host}",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={notebook_dir}",
        f"--IdentityProvider.token={token}",
        f"--LabApp.app_settings_dir={app_settings}",
        # Offline machines: no update check, no news feed, no "receive news?" prompt over the notebook.
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        *extra_args,  # e.g. lab.PROTECT_TRACKED_ARGS
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--ServerApp.allow_root=True")  # containers and CI machines run as root
    full_env = {**os.environ, **(env or {})}
    # Its log goes to stderr (fd 2), as mlflow's does in serve_mlflow_ui; stdout keeps what the caller prints.
    server = subprocess.Popen(
        command, cwd=notebook_dir, env=full_env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=2
    )
    try:
        wait_until_answers(server, lambda: _lab_answers(base, token), "jupyter lab", base, startup_timeout)
        yield f"{base}/lab?token={token}"
    finally:
        if server.poll() is None:
            _shutdown(base, token)
            with suppress(subprocess.TimeoutExpired):
                server.wait(timeout=stop_timeout)
        stop_process_group(server)
