"""JupyterLab on the workbook's notebooks, started and stopped like ``tracking.serve_mlflow_ui``.

``papo-nb lab`` uses it; so do the browser tests. The server runs under this interpreter
(``sys.executable -m jupyter lab``), so the default ``python3`` kernel (ipykernel's native spec, whose
``python`` jupyter_client replaces by the server's interpreter) sees the installed ``papo_nb``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from papo_nb.infra.tracking import _free_port, _stop_process_group


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
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except OSError:
        pass


@contextmanager
def serve_jupyterlab(
    notebook_dir: str | Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    token: str | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 120.0,
    stop_timeout: float = 20.0,
) -> Iterator[str]:
    """Run JupyterLab on ``notebook_dir``; yield ``http://host:port/lab?token=...`` once it answers.

    Bound to ``host`` (local only by default) on ``port`` or a free one, with ``token`` or a fresh random
    one. ``env`` (merged over ``os.environ``) is the server's and so its kernels' environment, e.g. an
    ``MLFLOW_TRACKING_URI``. On exit the server is asked to shut down (its kernels with it); whatever of
    its process group is left after ``stop_timeout`` s is terminated.
    """
    notebook_dir = Path(notebook_dir).resolve()
    if not notebook_dir.is_dir():
        raise RuntimeError(f"notebook folder {notebook_dir} does not exist")
    port = port or _free_port(host)
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
        # Offline machines: no update check, no news feed, no "receive news?" prompt over the notebook.
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--ServerApp.allow_root=True")  # containers and CI machines run as root
    full_env = {**os.environ, **(env or {})}
    # Its log goes to stderr (fd 2), as mlflow's does in serve_mlflow_ui; stdout keeps what the caller prints.
    server = subprocess.Popen(
        command, cwd=notebook_dir, env=full_env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=2
    )
    try:
        deadline = time.monotonic() + startup_timeout
        while not _lab_answers(base, token):
            if server.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with code {server.returncode} before answering on {base}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer on {base} within {startup_timeout:.0f} s")
            time.sleep(0.5)
        yield f"{base}/lab?token={token}"
    finally:
        if server.poll() is None:
            _shutdown(base, token)
            try:
                server.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        _stop_process_group(server)
