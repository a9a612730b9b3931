"""Shared fixtures: one tiny offline VLM and one small shapes dataset per test session.

Imports sit inside the fixtures so test files that need neither skip loading transformers.
"""

import logging
import os
import sys

import pytest

# Tiers are markers written on the test (registered in pyproject.toml; the fast tier deselects all four). A safety
# net: a test that takes one of these fixtures but carries no tier marker would land in the fast tier, so collection
# stops and names it.
TIER_MARKERS = ("model", "slow", "notebook", "browser")
MARKER_OF_FIXTURE = {
    "tiny_vlm_path": "model",
    "testbed_path": "model",
    "prior_testbed_path": "model",
    "smoke_workbook": "notebook",
}


def unmarked_heavy_tests(items) -> list[str]:
    """``nodeid: what to add`` for every test that uses a fixture of MARKER_OF_FIXTURE (its closure: fixtures used
    through other fixtures count) without any tier marker."""
    missing = []
    for item in items:
        if any(item.get_closest_marker(marker) is not None for marker in TIER_MARKERS):
            continue
        for fixture, marker in MARKER_OF_FIXTURE.items():
            if fixture in item.fixturenames:
                missing.append(f"{item.nodeid}: uses {fixture}, add @pytest.mark.{marker}")
                break
    return missing


def pytest_collection_modifyitems(items):
    missing = unmarked_heavy_tests(items)
    if missing:
        raise pytest.UsageError("tests without their tier marker:\n" + "\n".join(missing))


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory):
    """Folder of a tiny Qwen2-VL (seed 0), built offline into a session tmp dir."""
    from papo_nb.testbed.models import build_tiny_vlm

    return build_tiny_vlm("qwen2_vl", seed=0, cache_dir=tmp_path_factory.mktemp("tiny_vlm_cache"))


@pytest.fixture(scope="session")
def testbed_path():
    """Folder of the perception testbed (testbed:shapes): the shipped seed-0 weights, checked by SHA-256, so every
    machine tests the same policy (a fresh build differs between CPUs' float paths: papo_nb.testbed.policy)."""
    from papo_nb.testbed.policy import pinned_testbed

    return pinned_testbed("shapes")


@pytest.fixture(scope="session")
def prior_testbed_path():
    """Folder of the language-prior testbed (testbed:shapes_prior): the shipped seed-0 weights."""
    from papo_nb.testbed.policy import pinned_testbed

    return pinned_testbed("shapes_prior")


@pytest.fixture(scope="session")
def shapes_dataset():
    """24 shapes examples (8 of each question kind), seed 0."""
    from papo_nb.testbed.shapes import make_shapes_dataset

    return make_shapes_dataset(24, seed=0)


@pytest.fixture(scope="session")
def smoke_workbook(tmp_path_factory):
    """All workbook notebooks executed once with params/smoke_fast.yaml (random tiny model) into a new store; the
    warnings papermill logged while running them are kept as ``result.papermill_warnings``."""
    from pathlib import Path

    from papo_nb.infra.notebooks import run_workbook

    root = Path(__file__).resolve().parents[1]
    folder = tmp_path_factory.mktemp("smoke_workbook")
    warnings = _Records(logging.WARNING)
    logging.getLogger("papermill").addHandler(warnings)
    try:
        result = run_workbook(
            sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")),
            root / "params" / "smoke_fast.yaml",
            run_root=folder / "runs",
            tracking_uri=f"sqlite:///{folder}/mlflow.db",
        )
    finally:
        logging.getLogger("papermill").removeHandler(warnings)
    assert result.ok, result.failure_message
    result.papermill_warnings = [f"{r.name}: {r.getMessage()}" for r in warnings.records]
    return result


class _Records(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch) -> str:
    """A fresh sqlite MLflow store for one test, named by MLFLOW_TRACKING_URI; no run, model or URI outlives it
    (no_mlflow_state_outlives_a_test)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


# What MLflow exports to os.environ as a process uses its fluent API (so that child processes inherit it).
MLFLOW_PROCESS_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
    "MLFLOW_ACTIVE_MODEL_ID",
    "_MLFLOW_ACTIVE_MODEL_ID",
)


@pytest.fixture(autouse=True)
def no_mlflow_state_outlives_a_test():
    """MLflow keeps the active run, logged model, experiment and tracking uri per process: a test that used them in
    process would otherwise leave them to whichever test runs next (in a shuffled order, a run or logged model of
    another store: a FOREIGN KEY failure there). A test that never imported mlflow pays nothing."""
    env_before = {name: os.environ.get(name) for name in MLFLOW_PROCESS_ENV}
    yield
    if "mlflow" in sys.modules:
        import mlflow

        from papo_nb.infra.tracking import forget_store_state

        forget_store_state()
        mlflow.set_tracking_uri(None)
    for name, value in env_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
