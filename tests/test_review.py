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
from papo_nb.testbed import raw_masks
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.evaluation import eval_review
from papo_nb.workbook.training import completions, review
from papo_nb.workbook.training.builder import prepare_training

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


def test_the_heldout_table_draws_its_masks_as_the_training_table_does_and_marks_a_missed_shape(
    mlflow_store, monkeypatch
):
    """Issue 45 item 4: a held-out table row shows the pixels the masked condition received (the scored mask, same
    seed) beside the training table's overlay, and says when the mask missed every pixel the image shows."""
    ratio, seed, square = 0.5, 7, eval_review.RAW_MASK_SQUARE
    masks = [raw_masks.square_mask(56, 56, ratio, seed=raw_masks.image_mask_seed(seed, row)) for row in (0, 1)]
    images = []
    for mask, covered in zip(masks, (False, True), strict=True):  # a red shape in a square the mask skips / takes
        r, c = next((r, c) for r in range(4) for c in range(4) if mask[r * square, c * square] == covered)
        pixels = np.zeros((56, 56, 3), dtype=np.uint8)
        pixels[r * square + 2 : r * square + 12, c * square + 2 : c * square + 12] = (255, 0, 0)
        images.append(Image.fromarray(pixels))
    shown = []

    def fake_generate(model, processor, prompts, images, max_new_tokens):
        shown.append(images)
        return ["red"] * len(prompts)

    monkeypatch.setattr(eval_review, "generate_answers", fake_generate)
    run, _ = tracking.attach_run(mlflow_store, "", run_name="heldout", tags={})  # artifacts beside the store
    with run:
        cost = eval_review.log_heldout_completions(
            None, None, "heldout", ["colour?", "colour?"], images, ["red", "blue"],
            grade=lambda completions, answers: [c == a for c, a in zip(completions, answers, strict=True)],
            max_new_tokens=4, mask_ratio=ratio, seed=seed,
        )  # fmt: skip
    client = MlflowClient(mlflow_store)
    folder = Path(client.download_artifacts(run.info.run_id, ""))
    table = json.loads((folder / "completions" / "heldout_heldout.json").read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert set(completions.MASK_VIEW_COLUMNS) <= set(table["columns"]) and cost["images"] == 6

    def picture(row, column):
        return np.array(Image.open(folder / row[column]["filepath"]).convert("RGB"))

    assert [row["mask_missed_content"] for row in rows] == [True, False]
    assert [row["mask_content_share"] for row in rows] == [0.0, 1.0]
    assert [row["correct_masked"] for row in rows] == [1.0, 0.0]
    for row, image, mask, received in zip(rows, images, masks, shown[1], strict=True):
        # the pixels the model received: the scored mask's image, black where the mask is
        blacked = np.array(image) * ~mask[..., None]
        assert np.array_equal(picture(row, "model_input"), np.array(received))
        assert np.array_equal(picture(row, "model_input"), blacked)
        drawn = picture(row, "masked_image")
        overlay = drawn[: mask.shape[0], : mask.shape[1]]  # grey, outlined magenta, exactly where the mask is
        marked = (overlay == completions.MASK_GREY).all(-1) | (overlay == completions.MASK_OUTLINE).all(-1)
        assert np.array_equal(marked, mask) and np.array_equal(overlay[~mask], np.array(image)[~mask])
        # the legend under it: the swatch, and the missed-content flag in red on the row whose mask missed
        legend = drawn[mask.shape[0] :]
        assert legend.shape[1] >= completions.LEGEND_WIDTH and (legend == completions.MASK_OUTLINE).all(-1).any()
        flagged = (np.abs(legend.astype(int) - completions.MISSED_FLAG).sum(-1) < 60).sum()
        assert (flagged > 20) == row["mask_missed_content"], (flagged, row["mask_missed_content"])


def test_the_callbacks_mlflow_info_lines_are_dropped_at_their_logger_and_only_they(caplog):
    import logging

    review.quiet_mlflow_review_lines()
    review.quiet_mlflow_review_lines()  # once per process: a second call adds no second filter
    fluent = logging.getLogger("mlflow.tracking.fluent")
    assert sum(isinstance(f, review._DropLines) for f in fluent.filters) == 1
    with caplog.at_level(logging.INFO, logger="mlflow"):
        mlflow.clear_active_model()
        fluent.info("another line")
    assert [r.getMessage() for r in caplog.records if r.name == fluent.name] == ["another line"]


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
        run, _ = tracking.attach_run(uri, "", run_name="reviewed", tags={"papo_nb.notebook": "03_training_run"})
        trainer, heldout, _ = prepare_training(
            params, folder / "out", report_to="mlflow", require_gpu_contract_probe=False
        )
        trainer.train()
        # what notebook 03 logs after training, on its held-out set
        heldout_input = eval_review.heldout_input(params, heldout)
        tracking.log_evidence("evaluation", {"accuracy_original": 0.25}, prefix="eval", dataset=heldout_input)
        mlflow.end_run()
        mlflow.clear_active_model()
        mlflow.set_tracking_uri(None)
    return MlflowClient(uri), run.info.run_id, trainer, folder / "out"


def trainer_logs(trained) -> list[dict]:
    return trained[2].state.log_history


def _table_rows(client, run_id):
    folder = Path(client.download_artifacts(run_id, ""))
    table = json.loads((folder / completions.TABLE_FILE).read_text())
    return folder, [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


@pytest.mark.slow
def test_one_completions_table_across_steps_each_row_with_its_own_item_and_terms(trained):
    client, run_id, trainer, _ = trained
    assert [f.path for f in client.list_artifacts(run_id) if f.path.startswith("completions")] == ["completions.json"]
    folder, rows = _table_rows(client, run_id)
    assert sorted({row["step"] for row in rows}) == list(range(1, STEPS + 1))
    generations = trainer.args.num_generations
    per_step = min(completions.REVIEW_PROMPTS * generations, trainer.args.generation_batch_size)
    assert all(sum(r["step"] == s for r in rows) == per_step for s in range(1, STEPS + 1))
    reward_columns = {f"reward/{name}" for name in trainer.reward_func_names}
    wanted = reward_columns | {"row", "item", "answer", "image", "masked_image", "advantage", "perception_kl"}
    assert wanted - set(rows[0]) == set()
    # A row's image and answer are its own item's (MLflow re-reads the table to append, so "4" may come back 4).
    dataset = trainer.train_dataset
    by_digest = {completions.image_digest(image): i for i, image in enumerate(dataset["image"])}
    for row in rows:
        item = dataset[by_digest[row["item"]]]
        assert str(row["answer"]) == str(item["answer"])
        assert item["prompt"][0]["content"][1]["text"] in row["prompt"]
        shown = np.array(Image.open(folder / row["image"]["filepath"]).convert("RGB"))
        assert np.array_equal(shown, np.array(completions.thumbnail(item["image"])))
        assert math.isfinite(row["perception_kl"]) and row["perception_kl"] >= 0.0  # k3 is never negative
        assert row["original_entropy"] > 0.0 and row["masked_entropy"] > 0.0
        assert all(0.0 <= row[column] <= 1.0 for column in reward_columns)  # the shapes rewards are 0..1
    # Each item's advantages are its rewards centred on the group mean (GRPO), so they sum to ~0 per item and step.
    by_item: dict[tuple, list[float]] = {}
    for row in rows:
        by_item.setdefault((row["step"], row["item"]), []).append(row["advantage"])
    assert all(len(a) == generations and abs(sum(a)) < 1e-4 for a in by_item.values())
    # The last step's rows carry the trainer's own per-row terms, by row.
    last = [row for row in rows if row["step"] == STEPS]
    for row in last:
        kl, entropy, masked_entropy = trainer.perception_record.rollout[row["row"]]
        assert (row["perception_kl"], row["original_entropy"], row["masked_entropy"]) == pytest.approx(
            (kl, entropy, masked_entropy), rel=1e-6
        )
    # The per-completion KL is the step's logged token mean once the completions are weighted by their lengths.
    logged = client.get_metric_history(run_id, "perception_kl")
    assert [m.step for m in logged] == list(range(1, STEPS + 1))
    kept = list(trainer.perception_record.completions)
    pad = trainer.processing_class.tokenizer.pad_token_id
    lengths = [sum(1 for t in completion if t != pad) for _, completion, *_ in kept]
    weighted = sum(n * kl for n, (_, _, kl, _, _) in zip(lengths, kept, strict=True)) / sum(lengths)
    assert weighted == pytest.approx(logged[-1].value, rel=0.05)


@pytest.mark.slow
def test_the_model_config_is_an_artifact_not_a_hundred_params(trained):
    """Issue 45: transformers' MLflow callback logged the model config as params (160 of them for the tiny model); the
    run keeps the TrainingArguments as params and the config as one artifact."""
    client, run_id, trainer, _ = trained
    params = client.get_run(run_id).data.params
    assert {"learning_rate", "perception_loss_weight", "num_generations"} <= set(params)
    assert not {"vocab_size", "vision_config", "architectures", "model_type"} & set(params)
    config = json.loads(Path(client.download_artifacts(run_id, "train/model_config.json")).read_text())
    assert config["model_type"] == trainer.model.config.model_type and "vision_config" in config


@pytest.mark.slow
def test_masked_thumbnails_draw_the_steps_own_mask_visibly(trained):
    client, run_id, trainer, _ = trained
    folder, rows = _table_rows(client, run_id)
    grey = np.array(completions.MASK_GREY)
    for row in rows:
        original = np.array(Image.open(folder / row["image"]["filepath"]).convert("RGB"))
        masked = np.array(Image.open(folder / row["masked_image"]["filepath"]).convert("RGB"))
        masked = masked[: original.shape[0], : original.shape[1]]  # the overlay, above its legend
        assert max(masked.shape[:2]) <= completions.THUMBNAIL_PIXELS
        # Masked patches are grey or outlined: visible whatever the image (the testbed's background is black).
        marked = (np.abs(masked.astype(int) - grey).sum(-1) < 30) | (masked == completions.MASK_OUTLINE).all(-1)
        assert abs(marked.mean() - trainer.args.mask_ratio) < 0.2, f"{marked.mean():.2f} of the thumbnail marked"
        assert not np.array_equal(masked, original)
    # The mask is the one the step trained with: the trainer's selection for that row, drawn again, is the picture,
    # and (masks shared per prompt) rows of one item show one mask while two items show different ones.
    last = [row for row in rows if row["step"] == STEPS]
    dataset = trainer.train_dataset
    by_digest = {completions.image_digest(image): image for image in dataset["image"]}
    items = completions.item_keys(list(trainer._logs["prompt"]), list(trainer._logs["images"]))
    pictures = {}
    for row in last:
        selection = completions.row_mask(trainer.masks.rollout_masks, items, row["row"])
        views = completions.mask_views(trainer, by_digest[row["item"]], selection)
        drawn = np.array(views["masked_image"])
        assert np.array_equal(drawn, np.array(Image.open(folder / row["masked_image"]["filepath"]).convert("RGB")))
        # the pixels the model received: black exactly where the overlay is grey (issue 45)
        received = np.array(Image.open(folder / row["model_input"]["filepath"]).convert("RGB"))
        grey_fill = (drawn[: received.shape[0], : received.shape[1]] == completions.MASK_GREY).all(-1)
        assert grey_fill.any() and (received[grey_fill] == 0).all()
        assert row["mask_content_share"] == pytest.approx(views["mask_content_share"])
        assert row["mask_missed_content"] == (row["mask_content_share"] == 0.0)
        pictures.setdefault(row["item"], set()).add(selection.numpy().tobytes())
    assert all(len(seen) == 1 for seen in pictures.values()) and len(set().union(*pictures.values())) == len(pictures)


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
    # Issue 45 item 8: every checkpoint lists its step's training metrics on the training set, the last one also the
    # held-out score on the held-out set, and says it was logged from notebook 03 (not ipykernel_launcher.py).
    history = {entry["step"]: entry for entry in trainer_logs(trained) if "reward" in entry}
    for step, model_id in outputs:
        model = client.get_logged_model(model_id)
        assert model.tags["mlflow.source.name"] == "notebooks/03_training_run.ipynb"
        training = {
            m.key.removeprefix(review.CHECKPOINT_PREFIX): m.value
            for m in model.metrics
            if m.dataset_name == "synthetic-train"
        }
        assert set(training) == {k for k in review.CHECKPOINT_METRICS if k in history[step]} >= {"reward", "kl"}
        assert all(m.step == step for m in model.metrics if m.dataset_name == "synthetic-train")
        assert all(training[key] == pytest.approx(history[step][key]) for key in training)
        heldout = {m.key: m.value for m in model.metrics if m.dataset_name == "synthetic-heldout"}
        assert heldout == ({"eval/accuracy_original": 0.25} if step == STEPS else {})
        assert {m.dataset_name for m in model.metrics} <= {"synthetic-train", "synthetic-heldout"}


@pytest.mark.slow
def test_training_run_has_system_metrics_and_its_datasets(trained):
    client, run_id, _, _ = trained
    run = client.get_run(run_id)
    system = {key for key in run.data.metrics if key.startswith("system/")}
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= system
    contexts = {d.dataset.name: [t.value for t in d.tags] for d in run.inputs.dataset_inputs}
    assert contexts == {"synthetic-train": ["training"], "synthetic-heldout": ["evaluation"]}
