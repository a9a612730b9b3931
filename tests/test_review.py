"""The review material of a training run, read back from a real MLflow SQLite store: completions tables with their
images, checkpoints as LoggedModels carrying the held-out metrics, dataset inputs and system metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from PIL import Image

from papo_nb.infra import tracking
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.training import review
from papo_nb.workbook.training.run import prepare_training

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2


def test_dataset_inputs_name_source_digest_schema_and_context(mlflow_store, shapes_dataset):
    run, _ = tracking.attach_run(mlflow_store, "", run_name="lineage", tags={})
    client = MlflowClient(mlflow_store)
    source = review.dataset_source(load_params(None, ["seed=3"]), "synthetic")
    review.log_dataset_inputs(client, run.info.run_id, {"synthetic-train": (shapes_dataset, source, "training")})
    (logged,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert logged.dataset.name == "synthetic-train" and logged.dataset.source_type == "code"
    assert json.loads(logged.dataset.source)["tags"] == {"mlflow.source.name": "papo_nb synthetic", "seed": "3"}
    schema = json.loads(logged.dataset.schema)
    assert {column["name"] for column in schema["mlflow_colspec"]} == set(shapes_dataset.column_names)
    assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", "training")]
    # The digest follows the content: other rows, another digest.
    other = review.dataset_input(shapes_dataset.select(range(3)), "x", source)
    assert logged.dataset.digest and other.digest != logged.dataset.digest


@pytest.fixture(scope="module")
def trained(tiny_vlm_path, tmp_path_factory):
    """A real two-step PAPO-G run (report_to=mlflow, a checkpoint at each step) inside an active MLflow run, then the
    held-out metric notebook 03 would log; trained once for the tests below."""
    folder = tmp_path_factory.mktemp("reviewed")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    params = load_params(
        ROOT / "params" / "smoke_fast.yaml",
        [f"model_name_or_path={tiny_vlm_path}", f"max_steps={STEPS}", "save_steps=1", "n_train_prompts=8"],
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setattr(review, "SYSTEM_METRICS_INTERVAL_S", 1.0)  # a few samples within a short CPU run
        run, _ = tracking.attach_run(uri, "", run_name="reviewed", tags={})
        trainer, _, _ = prepare_training(params, folder / "out", report_to="mlflow", require_gpu_contract_probe=False)
        trainer.train()
        mlflow.log_metrics({"eval/accuracy_original": 0.25})  # what notebook 03 logs after training
        mlflow.end_run()
        mlflow.clear_active_model()
        mlflow.set_tracking_uri(None)
    return MlflowClient(uri), run.info.run_id, trainer, folder / "out"


@pytest.mark.slow
def test_completions_tables_hold_images_rewards_advantages_and_perception_terms(trained):
    client, run_id, trainer, _ = trained
    files = sorted(f.path for f in client.list_artifacts(run_id, "completions"))
    assert files == [f"completions/step_{step:05d}.json" for step in range(1, STEPS + 1)]
    folder = Path(client.download_artifacts(run_id, ""))
    table = json.loads((folder / files[-1]).read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    generations = trainer.args.num_generations
    assert len(rows) == min(review.REVIEW_PROMPTS * generations, trainer.args.generation_batch_size)
    reward_columns = {f"reward/{name}" for name in trainer.reward_func_names}
    assert reward_columns | {"image", "masked_image", "completion", "advantage", "perception_kl"} <= set(rows[0])
    mask_ratio = trainer.args.mask_ratio
    for row in rows:
        original = np.array(Image.open(folder / row["image"]["filepath"]).convert("RGB"))
        masked = np.array(Image.open(folder / row["masked_image"]["filepath"]).convert("RGB"))
        assert max(original.shape[:2]) <= review.THUMBNAIL_PIXELS and original.shape == masked.shape
        black = (masked.sum(-1) == 0).mean() - (original.sum(-1) == 0).mean()
        assert abs(black - mask_ratio) < 0.15, f"masked thumbnail has {black:.2f} more black, mask_ratio {mask_ratio}"
        assert math.isfinite(row["perception_kl"]) and row["perception_kl"] >= 0.0  # k3 is never negative
        assert row["original_entropy"] > 0.0 and row["masked_entropy"] > 0.0
        assert all(0.0 <= row[column] <= 1.0 for column in reward_columns)  # the shapes rewards are 0..1
    # Each prompt's advantages are its rewards centred on the group mean (GRPO), so they sum to ~0 per prompt.
    by_prompt: dict[str, list[float]] = {}
    for row in rows:
        by_prompt.setdefault(row["prompt"], []).append(row["advantage"])
    assert all(len(a) == generations and abs(sum(a)) < 1e-4 for a in by_prompt.values())
    # The per-completion KL is the step's logged token mean once the completions are weighted by their lengths.
    logged = client.get_metric_history(run_id, "perception_kl")
    assert [m.step for m in logged] == list(range(1, STEPS + 1))
    kept = list(trainer.completion_perception)
    pad = trainer.processing_class.tokenizer.pad_token_id
    lengths = [sum(1 for t in completion if t != pad) for _, completion, *_ in kept]
    weighted = sum(n * kl for n, (_, _, kl, _, _) in zip(lengths, kept, strict=True)) / sum(lengths)
    assert weighted == pytest.approx(logged[-1].value, rel=0.05)


@pytest.mark.slow
def test_checkpoints_become_logged_models_and_the_last_carries_the_heldout_metrics(trained):
    client, run_id, _, output_dir = trained
    run = client.get_run(run_id)
    outputs = sorted((o.step, o.model_id) for o in run.outputs.model_outputs)
    assert [step for step, _ in outputs] == list(range(1, STEPS + 1))
    for step, model_id in outputs:
        model = client.get_logged_model(model_id)
        checkpoint = (output_dir / f"checkpoint-{step}").resolve()
        assert model.source_run_id == run_id and model.tags[review.CHECKPOINT_PATH_TAG] == str(checkpoint)
        assert model.name == f"reviewed-checkpoint-{step}"
        # A reference, not a copy: the weights are on disk only; the model card credits PAPO.
        card = Path(mlflow.artifacts.download_artifacts(f"{model.artifact_location}/README.md")).read_text()
        assert "Perception-Aware Policy Optimization" in card
        listed = {f.path for f in client.list_logged_model_artifacts(model_id)}
        assert "adapter_model.safetensors" not in listed and "README.md" in listed
    last = client.get_logged_model(outputs[-1][1])
    assert {m.key: m.value for m in last.metrics} == {"eval/accuracy_original": 0.25}
    assert not client.get_logged_model(outputs[0][1]).metrics


@pytest.mark.slow
def test_training_run_has_system_metrics_and_its_datasets(trained):
    client, run_id, _, _ = trained
    run = client.get_run(run_id)
    system = {key for key in run.data.metrics if key.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system
    contexts = {d.dataset.name: [t.value for t in d.tags] for d in run.inputs.dataset_inputs}
    assert contexts == {"synthetic-train": ["training"], "synthetic-heldout": ["evaluation"]}
