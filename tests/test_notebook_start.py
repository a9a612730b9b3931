"""The notebooks' one preamble: validated params, the MLflow run attached, every RNG seeded, a work folder."""

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from papo_nb.infra.notebook_start import start
from papo_nb.infra.tracking import EXPERIMENT_NAME
from papo_nb.workbook.config.params import ParamsError


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One store for the module: creating MLflow's SQLite schema takes seconds."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        yield uri


@pytest.fixture
def store(shared_store):
    yield shared_store
    mlflow.end_run()


def run_count(uri: str) -> int:
    experiment = MlflowClient(uri).get_experiment_by_name(EXPERIMENT_NAME)
    return 0 if experiment is None else len(MlflowClient(uri).search_runs([experiment.experiment_id]))


def test_start_by_hand_attaches_an_interactive_run_seeds_and_makes_the_folder(store, tmp_path):
    namespace = {"seed": 3, "max_steps": 2, "mlflow_tracking_uri": "", "mlflow_run_id": "", "run_dir": str(tmp_path)}
    params, run, work_dir = start(namespace, "99_example")
    assert params.seed == 3 and params.max_steps == 2
    assert mlflow.active_run().info.run_id == run.info.run_id
    assert MlflowClient(store).get_run(run.info.run_id).data.tags["papo_nb.interactive"] == "true"
    assert work_dir == tmp_path / "99_example" and work_dir.is_dir()
    first = torch.rand(3)
    start(namespace, "99_example")
    assert torch.equal(torch.rand(3), first), "the same seed must give the same random stream"


def test_start_rejoins_the_runners_run(store, tmp_path):
    _, parent, _ = start({"mlflow_tracking_uri": store, "run_dir": str(tmp_path)}, "99_example")
    mlflow.end_run()
    _, run, _ = start({"mlflow_tracking_uri": store, "mlflow_run_id": parent.info.run_id}, "99_example")
    assert run.info.run_id == parent.info.run_id


def test_a_bad_value_fails_naming_it_before_any_run_starts(store):
    before = run_count(store)
    with pytest.raises(ParamsError, match=r"parameter 'mask_ratio' = 1.5 is invalid"):
        start({"mask_ratio": 1.5, "mlflow_tracking_uri": store}, "99_example")
    assert mlflow.active_run() is None and run_count(store) == before
