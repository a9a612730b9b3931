"""MLflow plumbing shared by the runner, the notebooks and the review notebook.

Everything lands in one experiment (``papo_nb``) of one store: by default an SQLite file in the project
folder, addressed by an ABSOLUTE uri because papermill kernels run in another directory. Artifacts go
to ``mlartifacts/`` next to that file, for runs made by the workbook and by ``papo-nb ui`` alike.

Several processes share the store (two workbooks at once, each with a notebook kernel). MLflow's
creation of a fresh SQLite schema is not safe against a second process doing the same ("duplicate column
name: step"), nor is creating the same experiment twice ("already exists"); both happen here under a file
lock next to the database. Ordinary writes need nothing more: MLflow sets SQLite's busy_timeout to 20 s.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from filelock import FileLock

import papo_nb

# The store is local and nothing should call out: MLflow 3.17 reads these (mlflow/telemetry/utils.py) when it is
# imported, and papermill kernels and the UI server inherit them. An explicit setting by the user is kept.
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
for _name, _value in TELEMETRY_OFF.items():
    os.environ.setdefault(_name, _value)

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID  # noqa: E402
from mlflow.telemetry import set_telemetry_client  # noqa: E402

set_telemetry_client()  # mlflow imported before this module started its client already: re-read the settings

EXPERIMENT_NAME = "papo_nb"
DB_FILENAME = "mlflow.db"
ARTIFACTS_DIRNAME = "mlartifacts"


# --------------------------------------------------------------------------------------------
# where the store is
# --------------------------------------------------------------------------------------------


def project_dir() -> Path:
    """The folder holding papo_nb's pyproject.toml (an editable or source checkout), else the cwd."""
    candidate = Path(papo_nb.__file__).resolve().parents[1]
    return candidate if (candidate / "pyproject.toml").is_file() else Path.cwd()


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` uri (absolute), None for other stores."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path).resolve()  # 'sqlite:////abs' leaves '/abs'; 'sqlite:///rel' is resolved vs cwd


def absolute_tracking_uri(tracking_uri: str) -> str:
    """Make a relative ``sqlite:///x.db`` absolute (kernels change directory); other uris unchanged."""
    path = sqlite_path(tracking_uri)
    if path is None:
        return tracking_uri
    query = tracking_uri.partition("?")[2]
    return f"sqlite:///{path}" + (f"?{query}" if query else "")


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set (made absolute), else ``sqlite:////<project>/mlflow.db``."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    return absolute_tracking_uri(env) if env else f"sqlite:///{project_dir() / DB_FILENAME}"


def artifacts_dir(tracking_uri: str) -> Path | None:
    """``mlartifacts/`` next to the SQLite file; None for non-SQLite stores (they have their own)."""
    path = sqlite_path(tracking_uri)
    return None if path is None else path.parent / ARTIFACTS_DIRNAME


# --------------------------------------------------------------------------------------------
# a store that survives concurrent use
# --------------------------------------------------------------------------------------------


_READY: set[str] = set()  # tracking uris whose store this process has already opened


def tracking_client(tracking_uri: str) -> MlflowClient:
    """An MlflowClient whose store exists, a fresh SQLite schema being created under a file lock.

    MlflowClient() builds the store (and a missing schema) at once; MLflow caches that store per uri per
    process, so only the first call in a process takes the lock.
    """
    db = sqlite_path(tracking_uri)
    if db is None or tracking_uri in _READY:
        return _without_foreign_model(MlflowClient(tracking_uri))
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{db}.lock"):
        client = MlflowClient(tracking_uri)
    _READY.add(tracking_uri)
    return _without_foreign_model(client)


def _without_foreign_model(client: MlflowClient) -> MlflowClient:
    """Clear the process's active logged model when ``client``'s store lacks it: ``MlflowClient.log_metric`` links
    every metric to the active model whatever store the client writes to (a FOREIGN KEY failure there)."""
    model_id = mlflow.get_active_model_id()
    if model_id is not None:
        try:
            client.get_logged_model(model_id)
        except mlflow.exceptions.MlflowException:
            mlflow.clear_active_model()
    return client


# MLflow 3.17's UI opens an experiment of this kind in its training views (runs, charts, compare), not the GenAI
# overview (traces) that its breadcrumb and Compare otherwise lead to.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "finetuning"}


def ensure_experiment(tracking_uri: str, name: str = EXPERIMENT_NAME) -> str:
    """Id of experiment ``name``, created (artifacts under ``mlartifacts/<name>``) or restored if needed."""
    client = tracking_client(tracking_uri)
    db = sqlite_path(tracking_uri)
    # Two processes creating the same experiment: the second gets "already exists". Serialise it.
    with FileLock(f"{db}.lock") if db is not None else nullcontext():
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            root = artifacts_dir(tracking_uri)
            location = None if root is None else (root / re.sub(r"[^\w.-]", "_", name)).as_uri()
            return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_TAGS)
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        for key, value in EXPERIMENT_TAGS.items():  # an experiment made before the tag existed gets it too
            if experiment.tags.get(key) != value:
                client.set_experiment_tag(experiment.experiment_id, key, value)
        return experiment.experiment_id


# --------------------------------------------------------------------------------------------
# inside a notebook
# --------------------------------------------------------------------------------------------


def use_store(tracking_uri: str) -> None:
    """Point MLflow's fluent API at ``tracking_uri``. Moving to another store first drops the process-global state
    that belongs to the old one (the active run, the active logged model, the active experiment): a later
    ``log_metrics`` would link its metrics to a run or model the new store lacks (a FOREIGN KEY failure)."""
    if mlflow.get_tracking_uri() != tracking_uri:
        forget_store_state()
    mlflow.set_tracking_uri(tracking_uri)


def forget_store_state() -> None:
    """End every active run and drop the active logged model and experiment. MLflow keeps them per process, not per
    store (the tracking uri is left as it is)."""
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.clear_active_model()
    # mlflow.set_experiment keeps the experiment in a module global and exports it to child processes
    mlflow.tracking.fluent._active_experiment_id = None
    MLFLOW_EXPERIMENT_ID.unset()


def attach_run(
    tracking_uri: str, run_id: str, *, run_name: str, tags: dict[str, str], reuse_active: bool = False
) -> tuple[mlflow.ActiveRun, bool]:
    """Make an MLflow run of the workbook store active; returns (the run, whether this call started it).

    ``run_id`` given: that run (already active, or re-attached with ``start_run(run_id=...)``). Empty: the active
    run when ``reuse_active`` (a notebook calling the runner in process), else a new run ``run_name`` with
    ``tags`` in the workbook experiment. Any other active run is ended first.
    """
    from papo_nb.workbook.training.review import quiet_mlflow_review_lines

    quiet_mlflow_review_lines()  # before use_store, whose clear_active_model prints one of them
    tracking_uri = absolute_tracking_uri(tracking_uri or default_tracking_uri())
    # This also exports MLFLOW_TRACKING_URI, which transformers' MLflowCallback re-reads: it must agree.
    use_store(tracking_uri)
    active = mlflow.active_run()
    if active is not None:
        if (run_id and active.info.run_id == run_id) or (reuse_active and not run_id):
            return active, False
        mlflow.end_run()
    # A run attached anew never inherits a logged model made active by an earlier run (mlflow exports it to child
    # processes as _MLFLOW_ACTIVE_MODEL_ID): its metrics would be linked to a model of another run or store.
    mlflow.clear_active_model()
    tracking_client(tracking_uri)
    if run_id:
        return mlflow.start_run(run_id=run_id), True
    experiment_id = ensure_experiment(tracking_uri)
    return mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags), True


def attach_notebook_run(tracking_uri: str, run_id: str) -> mlflow.ActiveRun:
    """Make the workbook's run for this notebook the active MLflow run; call it after the parameters cell.

    TRL's ``report_to="mlflow"`` callback then logs into it. With an empty ``run_id`` (the notebook run by
    hand in JupyterLab) a new run is started in the workbook experiment instead. Running the cell again
    is harmless.
    """
    run, _ = attach_run(
        tracking_uri,
        run_id,
        run_name=f"interactive-{time.strftime('%Y%m%d-%H%M%S')}",
        tags={"papo_nb.kind": "notebook", "papo_nb.interactive": "true"},
    )
    return run


def json_safe(value: Any) -> Any:
    """JSON-safe copy: numpy/torch scalars unwrapped, non-finite floats as strings, unknowns as str()."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy / torch values
        return json_safe(value.tolist())
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    return str(value)


def _metric_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_./ -]", "_", text)  # the characters MLflow accepts in metric names


def _metric_leaves(evidence: dict, prefix: str) -> dict[str, float]:
    """Finite number/bool leaves of nested dicts as ``prefix/a/b`` metrics; lists stay JSON-only."""
    metrics: dict[str, float] = {}
    for key, value in evidence.items():
        name = f"{prefix}/{_metric_safe(str(key))}"
        if isinstance(value, dict):
            metrics.update(_metric_leaves(value, name))
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            metrics[name] = float(value)
    return metrics


def log_evidence(
    name: str, evidence: dict, prefix: str | None = None, step: int | None = None, tracker: Any = None, dataset=None
) -> dict[str, float]:
    """Log ``evidence`` to the active run as ``evidence/<name>.json`` and its numeric leaves as metrics.

    Metric names are ``<prefix>/<key>[/<subkey>...]`` (prefix defaults to ``name``). NaN/inf values are
    kept, as strings, only in the JSON. ``tracker`` stands in for the ``mlflow`` module (a run's spool,
    ``papo_nb.train.spooled_tracking.SpooledFluent``). ``dataset`` (an MLflow dataset) is the one the metrics were
    measured on: MLflow links them to it (and to the active model). Returns the metrics logged.
    """
    tracker = tracker or mlflow
    plain = json_safe(evidence)
    tracker.log_dict(plain, f"evidence/{name}.json")
    metrics = _metric_leaves(plain, _metric_safe(prefix or name))
    if metrics:
        tracker.log_metrics(metrics, step=step, **({"dataset": dataset} if dataset is not None else {}))
    return metrics


def log_figure(fig: Any, name: str) -> str:
    """Log a matplotlib figure to the active run as ``figures/<name>.png``; returns the artifact path."""
    artifact = f"figures/{name.removesuffix('.png')}.png"
    mlflow.log_figure(fig, artifact)
    return artifact


def standard_tags(*, upstream_sha_verified: bool, phase: str, precision: str) -> dict[str, str]:
    """Tag the active run with what every result depends on: adapter and TRL versions, the upstream
    SHA check, the training phase and the precision. Returns the tags."""
    import trl

    from papo_nb.papo.contract import PAPO_ADAPTER_VERSION

    tags = {
        "papo_nb.adapter_version": PAPO_ADAPTER_VERSION,
        "papo_nb.trl_version": trl.__version__,
        "papo_nb.upstream_sha_verified": "yes" if upstream_sha_verified else "no",
        "papo_nb.phase": str(phase),
        "papo_nb.precision": str(precision),
    }
    mlflow.set_tags(tags)
    return tags


# --------------------------------------------------------------------------------------------
# review
# --------------------------------------------------------------------------------------------


def search_workbook_runs(tracking_uri: str, experiment: str = EXPERIMENT_NAME, filter_string: str = ""):
    """All runs of the workbook experiment as a pandas DataFrame (params.*, metrics.*, tags.* columns)."""
    tracking_uri = absolute_tracking_uri(tracking_uri or default_tracking_uri())
    tracking_client(tracking_uri)
    use_store(tracking_uri)
    return mlflow.search_runs(experiment_names=[experiment], filter_string=filter_string)
