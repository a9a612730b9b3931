"""The notebooks' one preamble: validated params, the MLflow run attached, every RNG seeded, a work folder, the
upstream-source check and the standard tags set once, and third-party noise silenced by name (only that)."""

import warnings

import mlflow
import pytest
import torch
from mlflow import MlflowClient

from papo_nb.infra.notebook_start import LocalKernelManager, quiet_third_party_output, start
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
    namespace["upstream_wheel"] = str(tmp_path / "no-such-trl.whl")  # the check runs offline and fails fast
    params, run, work_dir, _ = start(namespace, "99_example")
    assert params.seed == 3 and params.max_steps == 2
    assert mlflow.active_run().info.run_id == run.info.run_id
    assert MlflowClient(store).get_run(run.info.run_id).data.tags["papo_nb.interactive"] == "true"
    assert work_dir == tmp_path / "99_example" and work_dir.is_dir()
    first = torch.rand(3)
    start(namespace, "99_example")
    assert torch.equal(torch.rand(3), first), "the same seed must give the same random stream"


def test_start_rejoins_the_runners_run(store, tmp_path):
    offline = {"upstream_wheel": str(tmp_path / "no-such-trl.whl")}
    _, parent, _, _ = start({"mlflow_tracking_uri": store, "run_dir": str(tmp_path), **offline}, "99_example")
    mlflow.end_run()
    _, run, _, _ = start({"mlflow_tracking_uri": store, "mlflow_run_id": parent.info.run_id, **offline}, "99_example")
    assert run.info.run_id == parent.info.run_id


def test_a_bad_value_fails_naming_it_before_any_run_starts(store):
    before = run_count(store)
    with pytest.raises(ParamsError, match=r"parameter 'mask_ratio' = 1.5 is invalid"):
        start({"mask_ratio": 1.5, "mlflow_tracking_uri": store}, "99_example")
    assert mlflow.active_run() is None and run_count(store) == before


def test_start_checks_the_upstream_source_and_sets_the_standard_tags_once(store, tmp_path):
    namespace = {"init_adapter": "", "run_dir": str(tmp_path), "upstream_wheel": str(tmp_path / "no-such-trl.whl")}
    _, run, _, upstream = start(namespace, "03_training_run")
    assert not upstream.match and "no-such-trl.whl" in upstream.error
    tags = MlflowClient(store).get_run(run.info.run_id).data.tags
    assert tags["papo_nb.upstream_sha_verified"] == "no"
    assert (tags["papo_nb.phase"], tags["papo_nb.precision"]) == ("phase1 (fresh adapter)", "fp32")
    mlflow.end_run()
    _, run, _, _ = start({**namespace, "calibration_precisions": ["fp32", "bf16"]}, "02_probe_calibration",
                         precision="fp32+bf16")  # fmt: skip
    tags = MlflowClient(store).get_run(run.info.run_id).data.tags
    assert (tags["papo_nb.phase"], tags["papo_nb.precision"]) == ("phase1+phase2", "fp32+bf16")


def test_only_the_named_third_party_warnings_are_silenced():
    from tqdm import TqdmWarning
    from transformers.utils import logging as transformers_logging

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_output()
        warnings.warn("IProgress not found. Please update jupyter and ipywidgets.", TqdmWarning, stacklevel=1)
        warnings.warn(
            "`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1
        )
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
        warnings.warn(
            "IProgress not found", UserWarning, stacklevel=1
        )  # same words, another category: not the tqdm one
    assert [str(w.message) for w in caught] == ["something else is deprecated", "IProgress not found"]
    assert not transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()


def test_the_runners_kernels_talk_over_ipc_not_tcp():
    manager = LocalKernelManager(kernel_name="python3")
    assert manager.transport == "ipc" and "papo_nb-kernel-" in manager.ip
