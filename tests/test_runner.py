"""The workbook runner and ``papo-nb run`` / ``papo-nb ui``, with real papermill kernels and a real
MLflow SQLite store in tmp_path. Notebooks are written here with nbformat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import nbformat
import pytest
import yaml
from mlflow import MlflowClient

from papo_nb.infra.notebooks import (
    FAILED,
    FINISHED,
    NOT_RUN,
    WorkbookError,
    check_notebooks,
    run_workbook,
    undeclared_overrides,
    unread_parameters,
)
from papo_nb.infra.tracking import EXPERIMENT_NAME, ensure_experiment
from papo_nb.workbook.config.params import load_params

pytestmark = pytest.mark.notebook

SCRIPT = Path(sys.executable).parent / "papo-nb"

PARAMETERS_CELL = """\
seed: int = 0  # seed for everything
max_steps: int = 6  # optimizer steps
mlflow_tracking_uri: str = ""  # set by the runner
mlflow_run_id: str = ""  # set by the runner
run_dir: str = ""  # set by the runner
"""

ATTACH_CELL = """\
from pathlib import Path
import mlflow
from papo_nb.infra.tracking import attach_notebook_run, log_evidence
run = attach_notebook_run(mlflow_tracking_uri, mlflow_run_id)
"""


def write_notebook(path: Path, *cells: str, parameters: str = PARAMETERS_CELL) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in (ATTACH_CELL, *cells)]
    nbformat.write(nb, path)
    return path


def notebook_a(folder: Path) -> Path:
    return write_notebook(
        folder / "a_first.ipynb",
        'mlflow.log_metric("seed_plus_steps", seed + max_steps)\n'
        'log_evidence("a", {"seed": seed, "nested": {"ok": True, "loss": float("nan")}, "note": "text"})\n'
        'Path(run_dir, "a_was_here.txt").write_text(mlflow_run_id)',
    )


def notebook_b(folder: Path) -> Path:
    # declares only seed and the runtime keys: it must not be handed max_steps
    params = "\n".join(line for line in PARAMETERS_CELL.splitlines() if not line.startswith("max_steps"))
    return write_notebook(
        folder / "b_second.ipynb", 'mlflow.log_metric("seed_times_ten", seed * 10)', parameters=params
    )


def notebook_failing(folder: Path) -> Path:
    return write_notebook(
        folder / "failing.ipynb",
        'mlflow.log_metric("before_failure", 1)',
        'raise RuntimeError("boom in the middle")',
        'mlflow.log_metric("after_failure", 1)',
    )


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def all_runs(uri: str):
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT_NAME)
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def run_cli(*args: str, uri: str, cwd: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    return subprocess.Popen(
        [str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        **popen,
    )


def children_of(runs, parent_id: str) -> dict[str, object]:
    return {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id}


# --------------------------------------------------------------------------------------------


def test_two_notebook_workbook_logs_everything(tmp_path, store):
    params_file = tmp_path / "p.yaml"
    params_file.write_text("seed: 3\n")
    a, b = notebook_a(tmp_path), notebook_b(tmp_path)

    result = run_workbook([a, b], params_file, ["max_steps=7"], run_root=tmp_path / "runs", tracking_uri=store)

    assert result.ok and [nb.status for nb in result.notebooks] == [FINISHED, FINISHED]
    assert result.run_dir.parent == (tmp_path / "runs").resolve()
    resolved = yaml.safe_load((result.run_dir / "params.yaml").read_text())
    assert resolved["seed"] == 3 and resolved["max_steps"] == 7 and resolved["mask_ratio"] == 0.6

    client = MlflowClient(store)
    runs = all_runs(store)
    assert len(runs) == 3
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == FINISHED
    assert parent.data.tags["papo_nb.kind"] == "workbook"
    assert parent.data.tags["papo_nb.params_file"] == str(params_file.resolve())
    assert parent.data.tags["papo_nb.notebooks"] == "a_first b_second"
    assert parent.data.params["seed"] == "3" and parent.data.params["max_steps"] == "7"
    assert json.loads(parent.data.params["trl_releases"]) == []  # empty: the drift table reads the package index

    children = children_of(runs, result.parent_run_id)
    assert set(children) == {"a_first", "b_second"}
    run_a, run_b = children["a_first"], children["b_second"]
    assert [r.info.run_id for r in (run_a, run_b)] == [nb.run_id for nb in result.notebooks]
    for run, name in ((run_a, "a_first"), (run_b, "b_second")):
        assert run.info.status == FINISHED
        assert run.data.tags["papo_nb.kind"] == "notebook" and run.data.tags["papo_nb.notebook"] == name
        notebook_copies = [f.path for f in client.list_artifacts(run.info.run_id, "notebook")]
        assert notebook_copies == [f"notebook/{name}.html", f"notebook/{name}.ipynb"]  # the HTML one renders in MLflow

    # values the kernels computed from the injected parameters
    assert run_a.data.metrics["seed_plus_steps"] == 10
    assert run_b.data.metrics["seed_times_ten"] == 30
    assert run_a.data.metrics["a/seed"] == 3 and run_a.data.metrics["a/nested/ok"] == 1
    assert "a/nested/loss" not in run_a.data.metrics  # NaN stays out of metrics...
    evidence = json.loads(
        Path(client.download_artifacts(run_a.info.run_id, "evidence/a.json", str(tmp_path))).read_text()
    )
    assert evidence["nested"]["loss"] == "nan" and evidence["note"] == "text"  # ...and is a string in the JSON
    assert (result.run_dir / "a_was_here.txt").read_text() == run_a.info.run_id

    # b declares no max_steps, so papermill was not handed it
    executed_b = nbformat.read(result.run_dir / "b_second.ipynb", as_version=4)
    injected = next(c for c in executed_b.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert "seed = 3" in injected.source and "max_steps" not in injected.source
    assert f'mlflow_run_id = "{run_b.info.run_id}"' in injected.source


BAD_INPUTS = {
    "unknown key": ("learning_rat: 0.1\n", [], ["'learning_rat'", "0.1", "did you mean 'learning_rate'?"]),
    "wrong type": ("seed: three\n", [], ["'seed'", "'three'", "integer"]),
    "out of range": ("mask_ratio: 1.5\n", [], ["'mask_ratio'", "1.5", "(0, 1]"]),
    "bad override": ("seed: 1\n", ["num_generations=1"], ["'num_generations'", "= 1", "greater than or equal to 2"]),
    "override not key=value": ("", ["seed"], ["'seed'", "key=value"]),
}


def test_bad_params_fail_before_any_run(tmp_path, store):
    ensure_experiment(store)  # an existing store, so "no new runs" is a real check
    notebook = notebook_a(tmp_path)
    for case, (text, overrides, fragments) in BAD_INPUTS.items():
        params_file = tmp_path / "p.yaml"
        params_file.write_text(text)
        with pytest.raises(WorkbookError) as info:
            run_workbook([notebook], params_file, overrides, run_root=tmp_path / "runs", tracking_uri=store)
        for fragment in fragments:
            assert fragment in str(info.value), case
    assert all_runs(store) == []
    assert not (tmp_path / "runs").exists()


def test_bad_notebooks_fail_before_any_run(tmp_path, store):
    stray = write_notebook(tmp_path / "stray.ipynb", "pass", parameters=PARAMETERS_CELL + "warmup_steps: int = 2\n")
    script = tmp_path / "c.py"
    script.write_text("print(1)")
    cases = [
        ([stray], ["'stray.ipynb'", "'warmup_steps'", "not workbook parameters", "max_steps", "mlflow_run_id"]),
        ([tmp_path / "missing.ipynb"], ["missing.ipynb", "does not exist"]),
        ([script], ["c.py", "not a .ipynb"]),
    ]
    for notebooks, fragments in cases:
        with pytest.raises(WorkbookError) as info:
            run_workbook([notebook_a(tmp_path), *notebooks], None, run_root=tmp_path / "runs", tracking_uri=store)
        for fragment in fragments:
            assert fragment in str(info.value)
    assert not (tmp_path / "mlflow.db").exists()  # nothing touched the store at all
    assert not (tmp_path / "runs").exists()


def test_an_override_no_notebook_declares_is_refused_before_any_run(tmp_path, store):
    """papermill hands a notebook only what its parameters cell declares: ``-p max_steps=3`` on a notebook without
    ``max_steps`` would be dropped without a word, so the runner refuses it, naming the parameter, its value, the
    notebook and what it accepts."""
    b = notebook_b(tmp_path)
    with pytest.raises(WorkbookError) as info:
        run_workbook([b], None, ["seed=1", "max_steps=3"], run_root=tmp_path / "runs", tracking_uri=store)
    message = str(info.value)
    assert "'max_steps' = 3" in message and "-p max_steps=3" in message and "'b_second.ipynb'" in message
    assert "accepts seed)" in message and "'seed'" not in message  # the runtime values are not offered
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlflow.db").exists()
    # declared by one of the notebooks to run, it reaches that one
    assert undeclared_overrides(["max_steps=3"], check_notebooks([notebook_a(tmp_path), b])) == []


def test_params_file_values_no_workbook_notebook_reads_are_noted(tmp_path):
    """A params file shared with ``papo-nb train`` may set what no notebook declares: noted, not refused."""
    params_file = tmp_path / "p.yaml"
    params_file.write_text("seed: 3\ndataset_schema: official\nmax_steps: 7\n")
    declared = check_notebooks([notebook_b(tmp_path)])
    params = load_params(params_file, ["mask_ratio=0.5"])
    assert undeclared_overrides([], declared) == []
    # max_steps reaches notebook 03 of the workbook; dataset_schema only papo-nb train
    assert unread_parameters(params, ["mask_ratio=0.5"], declared) == ["dataset_schema='official'"]


def test_cli_override_no_notebook_declares_exits_2_without_runs(tmp_path, store):
    b = notebook_b(tmp_path)
    proc = run_cli("run", str(b), "-p", "max_steps=3", "--run-root", "runs", uri=store, cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err
    assert "'max_steps' = 3" in err and "'b_second.ipynb' accepts seed" in err
    assert out == "" and all_runs(store) == [] and not (tmp_path / "runs").exists()


def test_cli_bad_override_exits_2_without_runs(tmp_path, store):
    proc = run_cli("run", str(notebook_a(tmp_path)), "-p", "seed=-4", "--run-root", "runs", uri=store, cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "'seed' = -4" in err and "greater than or equal to 0" in err
    assert out == "" and all_runs(store) == [] and not (tmp_path / "runs").exists()


def test_failing_notebook_is_recorded_and_cli_exits_1(tmp_path, store):
    failing, after = notebook_failing(tmp_path), notebook_b(tmp_path)
    proc = run_cli("run", str(failing), str(after), "-p", "seed=2", "--run-root", "runs", uri=store, cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "failing.ipynb" in err and "RuntimeError: boom in the middle" in err and "cell " in err
    assert f"{NOT_RUN}   b_second" in out

    client = MlflowClient(store)
    runs = all_runs(store)
    (parent,) = [r for r in runs if r.data.tags.get("papo_nb.kind") == "workbook"]
    assert parent.info.status == FAILED
    children = children_of(runs, parent.info.run_id)
    assert set(children) == {"failing"}  # the later notebook got no run
    child = children["failing"]
    assert child.info.status == FAILED
    failed_cell = child.data.tags["papo_nb.failed_cell"]
    assert failed_cell.startswith("cell ") and 'raise RuntimeError("boom in the middle")' in failed_cell
    assert failed_cell.endswith("RuntimeError: boom in the middle")
    assert child.data.metrics["before_failure"] == 1 and "after_failure" not in child.data.metrics

    executed = client.download_artifacts(child.info.run_id, "notebook/failing.ipynb", str(tmp_path))
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert [e["ename"] for e in errors] == ["RuntimeError"]
    run_dir = Path(parent.data.tags["papo_nb.run_dir"])
    assert (run_dir / "failing.ipynb").is_file() and not (run_dir / "b_second.ipynb").exists()


def test_two_workbooks_at_once_on_a_fresh_store(tmp_path, store):
    # Both CLIs create the schema of the same new database at the same moment, then log concurrently.
    a = notebook_a(tmp_path)
    assert not (tmp_path / "mlflow.db").exists()
    procs = [
        run_cli("run", str(a), "-p", f"seed={seed}", "--run-root", "runs", uri=store, cwd=tmp_path) for seed in (1, 2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out + err

    runs = all_runs(store)
    parents = [r for r in runs if r.data.tags.get("papo_nb.kind") == "workbook"]
    assert len(runs) == 4 and len(parents) == 2
    seeds = set()
    for parent in parents:
        assert parent.info.status == FINISHED
        children = children_of(runs, parent.info.run_id)
        assert set(children) == {"a_first"} and children["a_first"].info.status == FINISHED
        seed = int(parent.data.params["seed"])
        seeds.add(seed)
        assert children["a_first"].data.metrics["seed_plus_steps"] == seed + 6
        assert children["a_first"].data.metrics["a/seed"] == seed
    assert seeds == {1, 2}
    assert len(list((tmp_path / "runs").iterdir())) == 2


def ignore_sigint() -> None:
    """In the child before exec: SIGINT ignored, as a job started in the background of a POSIX shell inherits it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_ui_serves_on_localhost_and_stops_on_ctrl_c(tmp_path, store):
    """The child starts with SIGINT ignored whatever this process inherited (pytest run as a background job or not):
    Ctrl-C must stop the CLI all the same (it installs its own handler)."""
    ensure_experiment(store)
    proc = run_cli("ui", uri=store, cwd=tmp_path, preexec_fn=ignore_sigint)
    try:
        line = proc.stdout.readline()  # blocks until the server answers
        assert line.startswith("MLflow UI: http://127.0.0.1:"), line + proc.stderr.read() if proc.poll() else line
        landing = line.split()[2]  # the workbook experiment's runs page: <base>/#/experiments/<id>/runs?...
        url, _, page = landing.partition("/#/")
        assert page.startswith("experiments/") and "workflowType=machine_learning" in page, landing
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert response.status == 200
        query = f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={EXPERIMENT_NAME}"
        with urllib.request.urlopen(query, timeout=10) as response:
            assert json.load(response)["experiment"]["name"] == EXPERIMENT_NAME  # it reads our store
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert "stopped" in out
        with pytest.raises(OSError):  # the server went with it
            urllib.request.urlopen(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the CLI stops its server on SIGTERM too; SIGKILL would orphan it
            proc.wait(timeout=60)


# --------------------------------------------------------------------------------------------
# the one training path: notebook 03 and ``papo-nb train`` tag the probe status alike
# --------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "params" / "smoke_fast.yaml"  # the tiny model: these tests are about the runner, not the policy
# The weakest case the tiny model offers: 1% of the image blacked out (one patch of 64). Before the projection test
# (issue 20) this ended the probe underpowered (leak-detection power 0.2-0.4); the projection test powers it
# (recorded: weakest margin at the recipe's gamma about 6e4), so the run's probe passes and the tags say so.
WEAK_PERCEPTION = [
    "mask_ratio=0.01",
    "probe_max_degenerate_batches=2",
    "max_steps=2",
    "save_steps=2",
    "n_eval_prompts=4",
]


# A batch the probe cannot power, constructed honestly: the shipped smoke policy answers its first training batch
# (2 prompts x 4 rollouts) right every time, so every advantage is 0, the parent gradient is exactly 0, and there is
# no roundoff floor to measure an injected leak against. With a budget of one batch the run ends underpowered.
UNPOWERABLE = ["probe_max_degenerate_batches=1", "max_steps=1", "save_steps=1", "n_eval_prompts=4"]
PROBE_CASES = {
    "passed": (SMOKE, WEAK_PERCEPTION),
    "underpowered": (ROOT / "params" / "smoke.yaml", UNPOWERABLE),
}


def assert_probe_tags(tags: dict[str, str], status: str) -> None:
    assert tags["papo_nb.probe_status"] == status, tags
    assert ("papo_nb.probe_warning" in tags) == (status == "underpowered"), tags
    if status == "underpowered":
        assert tags["papo_nb.probe_warning"].startswith("probe UNDERPOWERED after 1 batches, none powered"), tags


@pytest.mark.parametrize("status", PROBE_CASES)
def test_notebook_03_tags_the_probe_status(tmp_path, store, status):
    params_file, overrides = PROBE_CASES[status]
    result = run_workbook(
        [ROOT / "notebooks" / "03_training_run.ipynb"],
        params_file,
        overrides,
        run_root=tmp_path / "runs",
        tracking_uri=store,
    )
    assert result.ok, result.failure_message
    run = MlflowClient(store).get_run(result.notebooks[0].run_id)
    assert_probe_tags(run.data.tags, status)
    assert run.data.metrics["probe_final/underpowered"] == float(status == "underpowered")
    assert run.data.metrics["start/trainable_parameters"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("status", PROBE_CASES)
def test_papo_nb_train_tags_the_probe_status(tmp_path, store, status):
    params_file, overrides = PROBE_CASES[status]
    arguments = [arg for override in overrides for arg in ("-p", override)]
    out = tmp_path / "run"
    process = run_cli(
        "train", "--params", str(params_file), *arguments, "--output-dir", str(out), uri=store, cwd=tmp_path
    )
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stdout[-4000:] + stderr[-4000:]
    run_id = json.loads((out / "run_info.json").read_text())["mlflow_run_id"]
    run = MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["papo_nb.kind"] == "train"
    assert_probe_tags(run.data.tags, status)
    assert json.loads((out / "train_summary.json").read_text())["probe"]["status"] == status
