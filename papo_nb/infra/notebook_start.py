"""The one preamble every workbook notebook runs after its parameters cell: params, MLflow run, seeds, work folder,
the upstream-source check and the standard tags, and quiet third-party output.

A notebook calls ``start(globals(), NOTEBOOK)`` and unpacks what it needs::

    params, run, work_dir, upstream = start(globals(), "03_training_run")

Run by ``papo-nb run`` the parameters cell carries the runner's ``mlflow_run_id`` and ``run_dir``; run by hand in
JupyterLab both are empty and an interactive MLflow run and a temporary folder are used instead.

Quiet output: each third-party message that says nothing about the run is silenced by name, here, where it starts
(``quiet_third_party_output``); every other warning still shows. The kernel's own start-up warning comes before any
cell runs, so the runner starts its kernels with ``LocalKernelManager`` instead.
"""

from __future__ import annotations

import tempfile
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import mlflow
from jupyter_client.manager import KernelManager
from transformers import set_seed

from papo_nb.infra.tracking import attach_notebook_run, standard_tags
from papo_nb.workbook.config.params import WorkbookParams, notebook_params
from papo_nb.workbook.verification.provenance import SourceVerification, verify_upstream_source

# What each notebook's standard ``papo_nb.phase`` tag says (a function of its parameters).
PHASES: dict[str, Callable[[WorkbookParams], str]] = {
    "01_contract_verification": lambda p: "probe batch (fresh adapter)",
    "02_probe_calibration": lambda p: "phase1+phase2",
    "03_training_run": lambda p: "phase2 (resumed adapter)" if p.init_adapter else "phase1 (fresh adapter)",
    "04_method_study": lambda p: "phase1 (study arms)",
    "05_evaluation": lambda p: "evaluation (checkpoint)" if p.eval_checkpoint else "evaluation (base model)",
}


class NotebookStart(NamedTuple):
    """What a notebook's preamble builds: validated params, the active MLflow run, this notebook's file folder and
    the check of the pinned upstream source (also in the run's tags)."""

    params: WorkbookParams
    run: mlflow.ActiveRun
    work_dir: Path
    upstream: SourceVerification


def quiet_third_party_output() -> None:
    """Silence, by name, the third-party messages that fill an executed notebook without saying anything about it.

    - tqdm's ``IProgress not found`` (TqdmWarning): the text fallback when ipywidgets is missing; it is declared, so
      this shows only in a broken install, where the text bars still work;
    - transformers' ``is_gradient_checkpointing`` deprecation (FutureWarning), raised by TRL 1.9.1's
      ``unwrap_model_for_generation`` at every generation, not by this project's code;
    - transformers' per-load ``Loading weights`` bars (its own progress-bar switch; training bars are TRL's and stay).
    """
    from tqdm import TqdmWarning
    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", message=r"IProgress not found", category=TqdmWarning)
    warnings.filterwarnings("ignore", message=r".*`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    transformers_logging.disable_progress_bar()


class LocalKernelManager(KernelManager):
    """A Jupyter kernel on local IPC sockets (in the temporary folder) instead of TCP ports: the kernel then has no
    reason for its start-up warning that TCP traffic is unencrypted (IPC is what that warning recommends)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("transport", "ipc")
        kwargs.setdefault("ip", str(Path(tempfile.gettempdir()) / f"papo_nb-kernel-{uuid.uuid4().hex[:8]}"))
        super().__init__(**kwargs)


def start(namespace: dict[str, Any], notebook: str, *, precision: str | None = None) -> NotebookStart:
    """Validate the parameters cell's values, attach the MLflow run, seed every RNG, make the work folder, check the
    pinned upstream source and set the standard tags (``tracking.standard_tags``) once.

    ``namespace`` is the notebook's ``globals()``: its parameter names are read from it (unknown names are
    ignored, bad values raise ``ParamsError`` naming the parameter before anything else runs). ``precision`` is the
    tag's precision when it is not ``params.precision`` (notebook 02 compares several). ``upstream_wheel`` in the
    namespace, if set, is the wheel the source is hashed in (else pip fetches it, cached).
    """
    quiet_third_party_output()
    params = notebook_params(namespace)
    run = attach_notebook_run(namespace.get("mlflow_tracking_uri", ""), namespace.get("mlflow_run_id", ""))
    # python, numpy and torch (CPU and CUDA) RNGs, as transformers' Trainer does with args.seed
    set_seed(params.seed)
    run_dir = namespace.get("run_dir", "")
    work_dir = Path(run_dir or tempfile.mkdtemp(prefix="papo_nb-")) / notebook
    work_dir.mkdir(parents=True, exist_ok=True)
    upstream = verify_upstream_source(namespace.get("upstream_wheel") or None)
    phase = PHASES[notebook](params) if notebook in PHASES else "interactive"
    standard_tags(upstream_sha_verified=upstream.match, phase=phase, precision=precision or params.precision)
    print(f"MLflow run {run.info.run_id}; files in {work_dir}")
    return NotebookStart(params, run, work_dir, upstream)
