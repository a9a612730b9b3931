"""The one preamble every workbook notebook runs after its parameters cell: params, MLflow run, seeds, work folder.

A notebook calls ``start(globals(), NOTEBOOK)`` and unpacks what it needs::

    params, run, work_dir = start(globals(), "03_training_run")

Run by ``papo-nb run`` the parameters cell carries the runner's ``mlflow_run_id`` and ``run_dir``; run by hand in
JupyterLab both are empty and an interactive MLflow run and a temporary folder are used instead.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import mlflow
from transformers import set_seed

from papo_nb.infra.tracking import attach_notebook_run
from papo_nb.workbook.config.params import WorkbookParams, notebook_params


class NotebookStart(NamedTuple):
    """What a notebook's preamble builds: validated params, the active MLflow run, this notebook's file folder."""

    params: WorkbookParams
    run: mlflow.ActiveRun
    work_dir: Path


def start(namespace: dict[str, Any], notebook: str) -> NotebookStart:
    """Validate the parameters cell's values, attach the MLflow run, seed every RNG, make the work folder.

    ``namespace`` is the notebook's ``globals()``: its parameter names are read from it (unknown names are
    ignored, bad values raise ``ParamsError`` naming the parameter before anything else runs).
    """
    params = notebook_params(namespace)
    run = attach_notebook_run(namespace.get("mlflow_tracking_uri", ""), namespace.get("mlflow_run_id", ""))
    # python, numpy and torch (CPU and CUDA) RNGs, as transformers' Trainer does with args.seed
    set_seed(params.seed)
    run_dir = namespace.get("run_dir", "")
    work_dir = Path(run_dir or tempfile.mkdtemp(prefix="papo_nb-")) / notebook
    work_dir.mkdir(parents=True, exist_ok=True)
    print(f"MLflow run {run.info.run_id}; files in {work_dir}")
    return NotebookStart(params, run, work_dir)
