"""Run the workbook: validate everything, then execute notebooks with papermill, one MLflow run each.

Layout of one workbook run:
- a folder ``<run_root>/<YYYYmmdd-HHMMSS>-<6 hex>/`` with ``params.yaml`` (the resolved parameters) and the
  executed notebooks;
- an MLflow parent run ``workbook-<timestamp>`` (all parameters, ``params.yaml``) with one nested child
  run per notebook. The runner injects the child's id as ``mlflow_run_id`` and the notebook attaches to
  it with ``papo_nb.infra.notebook_start.start``; the executed notebook, failed or not, is logged to
  the child as ``notebook/<name>.ipynb`` and, readable in the browser, ``notebook/<name>.html``;
- a results page on every run (its Description, ``workbook.results.page``), the notebooks' headline numbers on the
  parent as ``headline/*`` metrics.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# tracking first: it turns MLflow's telemetry off before mlflow is imported
from papo_nb.infra.tracking import (  # isort: skip
    EXPERIMENT_NAME,
    absolute_tracking_uri,
    default_tracking_uri,
    ensure_experiment,
    project_dir,
    tracking_client,
)
import papermill
import yaml
from mlflow import MlflowClient
from mlflow.entities import Param
from papermill.exceptions import PapermillExecutionError

from papo_nb.infra.notebook_start import LocalKernelManager
from papo_nb.workbook.config.machine_checks import preflight_problems
from papo_nb.workbook.config.params import (
    ParamsError,
    WorkbookParams,
    load_params,
    parse_override,
)
from papo_nb.workbook.results.page import publish_notebook_page, publish_workbook_page
from papo_nb.workbook.results.readable import write_html_copy

# Values the runner supplies to any notebook that declares them, on top of the WorkbookParams fields.
RUNTIME_PARAMETERS = ("mlflow_tracking_uri", "mlflow_run_id", "run_dir")
OUTPUT_PATH_PARAMETERS = ("study_report_dir",)  # folders a notebook writes into, given relative to the caller

FINISHED, FAILED, NOT_RUN = "FINISHED", "FAILED", "NOT_RUN"


class WorkbookError(ValueError):
    """Bad input (parameters, notebooks) found before anything ran; the message says what and why."""


@dataclass
class NotebookResult:
    notebook: Path
    status: str = NOT_RUN  # FINISHED, FAILED or NOT_RUN
    run_id: str | None = None
    output_path: Path | None = None
    failed_cell: str | None = None  # "cell 3 (In [2]: raise ...): RuntimeError: boom"
    wall_seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.notebook.stem


@dataclass
class WorkbookResult:
    run_dir: Path
    parent_run_id: str
    tracking_uri: str
    notebooks: list[NotebookResult] = field(default_factory=list)
    unread_params: list[str] = field(default_factory=list)  # params-file values no workbook notebook declares

    @property
    def ok(self) -> bool:
        return all(nb.status == FINISHED for nb in self.notebooks)

    @property
    def failure_message(self) -> str | None:
        failed = next((nb for nb in self.notebooks if nb.status == FAILED), None)
        if failed is None:
            return None
        return f"notebook {failed.notebook.name} failed at {failed.failed_cell} (executed copy: {failed.output_path})"


# --------------------------------------------------------------------------------------------
# checks before anything runs
# --------------------------------------------------------------------------------------------


def check_notebooks(notebooks: list[str | Path]) -> dict[Path, set[str]]:
    """Each notebook exists, is .ipynb and declares only known parameters; returns its declared names."""
    if not notebooks:
        raise WorkbookError("no notebooks to run")
    allowed = WorkbookParams.field_names() | set(RUNTIME_PARAMETERS)
    declared: dict[Path, set[str]] = {}
    for item in notebooks:
        path = Path(item).resolve()
        if path.suffix != ".ipynb":
            raise WorkbookError(f"notebook {str(item)!r} is not a .ipynb file (papermill reads only .ipynb)")
        if not path.is_file():
            raise WorkbookError(f"notebook {str(item)!r} does not exist")
        if any(other.stem == path.stem for other in declared):
            raise WorkbookError(f"notebook {str(item)!r} is given twice (or shares its name with another)")
        try:
            names = set(papermill.inspect_notebook(path))
        except Exception as exc:  # unreadable JSON, not a notebook...
            raise WorkbookError(f"notebook {str(item)!r} cannot be read: {exc}") from None
        unknown = sorted(names - allowed)
        if unknown:
            raise WorkbookError(
                f"notebook {path.name!r} declares parameter(s) {', '.join(map(repr, unknown))} in its parameters "
                f"cell, which are not workbook parameters; allowed: the fields of WorkbookParams "
                f"({', '.join(sorted(WorkbookParams.field_names()))}) and the runtime values "
                f"{', '.join(RUNTIME_PARAMETERS)}"
            )
        declared[path] = names
    return declared


def _param_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _describe_failure(exc: BaseException) -> str:
    if isinstance(exc, PapermillExecutionError):
        first_line = next((line for line in (exc.source or "").splitlines() if line.strip()), "")
        return f"cell {exc.cell_index} (In [{exc.exec_count}]: {first_line[:80]}): {exc.ename}: {exc.evalue}"[:1000]
    return f"{type(exc).__name__}: {exc}"[:1000]


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def default_notebooks() -> list[Path]:
    """The project's workbook notebooks, ``notebooks/NN_*.ipynb``, in order."""
    return sorted((project_dir() / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _accepts(declared: dict[Path, set[str]]) -> str:
    return "; ".join(
        f"{path.name!r} accepts {', '.join(sorted(names - set(RUNTIME_PARAMETERS))) or 'none'}"
        for path, names in declared.items()
    )


def undeclared_overrides(overrides: list[str], declared: dict[Path, set[str]]) -> list[str]:
    """One line per ``-p key=value`` that no notebook to run (``declared``) declares in its parameters cell: papermill
    hands a notebook only what that cell declares and drops the rest without a word."""
    problems = []
    for item in overrides:
        key, value = parse_override(item)
        if not any(key in names for names in declared.values()):
            where = "the notebook" if len(declared) == 1 else "any notebook"
            problems.append(
                f"parameter {key!r} = {value!r} (-p {item}) is not declared in the parameters cell of {where} to "
                f"run, so it would have no effect ({_accepts(declared)})"
            )
    return problems


def unread_parameters(params: WorkbookParams, overrides: list[str], declared: dict[Path, set[str]]) -> list[str]:
    """The params file's values, changed from their defaults, that neither the notebooks to run nor the project's
    workbook (``notebooks/NN_*.ipynb``) declares: fine for a file shared with ``papo-nb train`` (the recipes'
    ``dataset_schema``), so the runner notes them rather than refusing them."""
    overridden = {parse_override(item)[0] for item in overrides}
    values, defaults = params.model_dump(mode="json"), WorkbookParams().model_dump(mode="json")
    changed = [key for key in values if key not in overridden and values[key] != defaults[key]]
    if not changed:
        return []
    readers = set().union(*declared.values(), *(papermill.inspect_notebook(path) for path in default_notebooks()))
    return [f"{key}={values[key]!r}" for key in changed if key not in readers]


def checked_params(
    params_file: str | Path | None, overrides: list[str], declared: dict[Path, set[str]]
) -> WorkbookParams:
    """The workbook parameters, validated, each ``-p`` override declared by a notebook to run (``declared``, from
    ``check_notebooks``), and preflighted; WorkbookError says what is wrong."""
    try:
        params = load_params(params_file, list(overrides))
    except ParamsError as exc:
        raise WorkbookError(str(exc)) from None
    problems = undeclared_overrides(list(overrides), declared) or preflight_problems(params, project_dir())
    if problems:
        raise WorkbookError("\n".join(problems))
    return params


def notebook_values(params: WorkbookParams) -> dict[str, Any]:
    """The parameters as the notebooks receive them, output paths made absolute: the kernel runs beside its
    notebook, and a relative path means the caller's."""
    values = params.model_dump(mode="json")
    for name in OUTPUT_PATH_PARAMETERS:
        if values[name]:
            values[name] = str(Path(values[name]).resolve())
    return values


def _new_run_dir(run_root: str | Path, values: dict[str, Any]) -> tuple[Path, str]:
    """A fresh ``<run_root>/<timestamp>-<id>/`` holding the notebooks' parameter values as ``params.yaml``, and its
    timestamp (the workbook run's name)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = (Path(run_root) / f"{stamp}-{secrets.token_hex(3)}").resolve()
    run_dir.mkdir(parents=True)
    (run_dir / "params.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    return run_dir, stamp


def _workbook_tags(
    params_file: str | Path | None,
    overrides: list[str],
    declared: dict[Path, set[str]],
    run_dir: Path,
    unread: list[str],
) -> dict[str, str]:
    """The workbook run's tags: where its parameters came from, which notebooks it runs and where its folder is."""
    return {
        "papo_nb.kind": "workbook",
        "papo_nb.params_file": str(Path(params_file).resolve()) if params_file else "(defaults)",
        "papo_nb.overrides": " ".join(overrides),
        "papo_nb.notebooks": " ".join(path.stem for path in declared),
        "papo_nb.run_dir": str(run_dir),
        **({"papo_nb.unread_params": " ".join(unread)} if unread else {}),
    }


def run_workbook(
    notebooks: list[str | Path],
    params_file: str | Path | None,
    overrides: list[str] = (),
    run_root: str | Path = "runs",
    tracking_uri: str | None = None,
    experiment: str = EXPERIMENT_NAME,
    log_output: bool = False,
) -> WorkbookResult:
    """Execute ``notebooks`` in order under one MLflow parent run; stop at the first failure.

    Raises WorkbookError (nothing created) on bad parameters or notebooks. A failing notebook does not
    raise: the result has ``ok == False`` and ``failure_message`` naming the notebook and cell.
    """
    declared = check_notebooks(notebooks)
    params = checked_params(params_file, overrides, declared)
    unread = unread_parameters(params, list(overrides), declared)

    tracking_uri = absolute_tracking_uri(tracking_uri or default_tracking_uri())
    values = notebook_values(params)
    run_dir, stamp = _new_run_dir(run_root, values)
    params_yaml = run_dir / "params.yaml"

    client = tracking_client(tracking_uri)
    experiment_id = ensure_experiment(tracking_uri, experiment)
    tags = _workbook_tags(params_file, overrides, declared, run_dir, unread)
    parent_id = client.create_run(experiment_id, run_name=f"workbook-{stamp}", tags=tags).info.run_id
    result = WorkbookResult(run_dir, parent_id, tracking_uri, [NotebookResult(path) for path in declared], unread)
    parent_status = FAILED
    pages: list = []  # each notebook run's record and headline numbers, for the workbook run's own page
    try:
        client.log_batch(parent_id, params=[Param(k, _param_text(v)) for k, v in values.items()])
        client.log_artifact(parent_id, str(params_yaml))
        runtime = {"mlflow_tracking_uri": tracking_uri, "run_dir": str(run_dir)}
        for nb in result.notebooks:
            _run_notebook(
                nb, declared[nb.notebook], {**values, **runtime}, client, experiment_id, parent_id, log_output
            )
            pages.append(publish_notebook_page(client, nb.run_id))
            if nb.status != FINISHED:
                break
        else:
            parent_status = FINISHED
    except KeyboardInterrupt:
        parent_status = "KILLED"
        raise
    finally:
        try:
            if pages:
                publish_workbook_page(client, parent_id, pages)
        finally:
            client.set_terminated(parent_id, parent_status)
    return result


def _run_notebook(
    nb: NotebookResult,
    declared: set[str],
    values: dict[str, Any],
    client: MlflowClient,
    experiment_id: str,
    parent_id: str,
    log_output: bool,
) -> None:
    """Execute one notebook in its own child run and fill in ``nb``; a notebook error does not raise.

    ``values`` holds the parameters and the runtime values except ``mlflow_run_id``, which is the child's.
    """
    child = client.create_run(
        experiment_id,
        run_name=nb.name,
        tags={"mlflow.parentRunId": parent_id, "papo_nb.kind": "notebook", "papo_nb.notebook": nb.name},
    )
    nb.run_id = child.info.run_id
    nb.output_path = Path(values["run_dir"]) / nb.notebook.name
    # papermill only warns about parameters a notebook does not declare, so pass exactly the declared ones.
    parameters = {k: v for k, v in {**values, "mlflow_run_id": nb.run_id}.items() if k in declared}
    status = FAILED
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            nb.notebook,
            nb.output_path,
            parameters=parameters,
            progress_bar=True,
            log_output=log_output,
            cwd=nb.notebook.parent,  # as in JupyterLab: relative paths resolve next to the notebook
            kernel_manager_class=LocalKernelManager,
        )
        status = FINISHED
    except Exception as exc:
        nb.failed_cell = _describe_failure(exc)
        client.set_tag(nb.run_id, "papo_nb.failed_cell", nb.failed_cell)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        nb.wall_seconds = time.perf_counter() - start
        nb.status = FINISHED if status == FINISHED else FAILED
        # papermill writes the executed notebook even when a cell fails: that is the evidence.
        if nb.output_path.is_file():
            client.log_artifact(nb.run_id, str(nb.output_path), "notebook")
            client.log_artifact(nb.run_id, str(write_html_copy(nb.output_path)), "notebook")
        client.log_metric(nb.run_id, "papo_nb/wall_seconds", nb.wall_seconds)
        # The kernel may have left the run RUNNING or ended it FINISHED; the runner has the last word.
        client.set_terminated(nb.run_id, status)
