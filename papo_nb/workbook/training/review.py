"""What a reviewer of a PAPO-G run finds in MLflow: completions with their images, checkpoints as logged models,
dataset lineage and system metrics.

``attach_review(trainer, ...)`` adds a ``ReviewCallback`` to a trainer. While an MLflow run is active it

- logs the training and held-out datasets as dataset inputs of the run (name, source, digest, schema);
- samples CPU, memory (and GPU, with ``nvidia-ml-py``) every ``SYSTEM_METRICS_INTERVAL_S`` s as ``system/*`` metrics;
- with ``report_to="mlflow"``, every ``logging_steps`` logs a completions table (``completions/step_NNNNN.json``,
  MLflow's ``log_table``): for ``REVIEW_PROMPTS`` prompts, each completion beside the original and a masked image
  thumbnail, every reward function's value, the advantage, and the completion's perception KL and entropies;
- with ``report_to="mlflow"``, turns every saved checkpoint into an MLflow 3 ``LoggedModel`` linked to the run at its
  step. The weights stay in the checkpoint folder (the model records its path); only TRL's model card, which
  credits PAPO, is copied. After training the last checkpoint's model is the active model, so the held-out metrics
  the notebook logs next are attached to it.

The masked thumbnail is a fresh draw of the training mask (same ``mask_type``, ``mask_ratio`` and patch grid, at the
model's input resolution), not the exact draw the step used: the trainer does not keep its masks.
Per-completion KL and entropies come from ``PAPOGTrainer.completion_perception`` (this process's completions only).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput
from PIL import Image
from transformers import TrainerCallback

from papo_nb.papo.masking import select_units
from papo_nb.workbook.training.checkpoints import holds_model

REVIEW_PROMPTS = 2  # prompts per completions table (each with all its completions, at most the next bound)
REVIEW_COMPLETIONS_PER_PROMPT = 8
THUMBNAIL_PIXELS = 128  # longest side of a thumbnail; smaller images are kept as they are
SYSTEM_METRICS_INTERVAL_S = 5.0  # MLflow's default is 10 s; a CPU smoke run trains in about a minute
CHECKPOINT_PATH_TAG = "papo_nb.checkpoint_path"


# --------------------------------------------------------------------------------------------
# completions table
# --------------------------------------------------------------------------------------------


def thumbnail(image: Image.Image) -> Image.Image:
    copy = image.convert("RGB")
    copy.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    return copy


def masked_image(trainer, image: Image.Image, seed: int) -> Image.Image:
    """``image`` at the model's input size with a fresh draw of the training mask blacked out: ``round(ratio * n)``
    of its patch units (merge units for ``merge_unit``), or single values with probability ``ratio`` (``random``)."""
    args = trainer.args
    processor = trainer.processing_class.image_processor
    image = image.convert("RGB")
    grid = processor(images=[image], return_tensors="pt").get("image_grid_thw")
    patch = trainer.mask_patch_size()
    if grid is not None:  # patch rows (Qwen-VL family): the processor resizes to whole patches
        image = image.resize((int(grid[0][2]) * patch, int(grid[0][1]) * patch))
    pixels = torch.from_numpy(np.array(image))
    generator = torch.Generator().manual_seed(seed)
    if args.mask_type == "random":
        chosen = torch.rand(pixels.shape, generator=generator) < args.mask_ratio
        return Image.fromarray(torch.where(chosen, 0, pixels).numpy())
    unit = patch * (getattr(processor, "merge_size", 2) if args.mask_type == "merge_unit" else 1)
    rows, cols = pixels.shape[0] // unit, pixels.shape[1] // unit
    selected = select_units(torch.tensor([rows * cols]), args.mask_ratio, generator).reshape(rows, cols)
    block = selected.repeat_interleave(unit, 0).repeat_interleave(unit, 1)
    keep = torch.ones(pixels.shape[:2], dtype=torch.bool)
    keep[: block.shape[0], : block.shape[1]] = ~block
    return Image.fromarray((pixels * keep[..., None]).numpy())


def _perception_by_text(trainer) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """(prompt text, completion text) -> [(KL, H, H_masked), ...], decoded as TRL decodes its logged texts."""
    kept = list(getattr(trainer, "completion_perception", ()))
    if not kept:
        return {}
    decode = trainer.processing_class.batch_decode
    prompts = decode([row[0] for row in kept], skip_special_tokens=True)
    completions = decode([row[1] for row in kept], skip_special_tokens=True)
    found: dict[tuple[str, str], list] = defaultdict(list)
    for prompt, completion, row in zip(prompts, completions, kept, strict=True):
        found[(prompt, completion)].append(tuple(row[2:]))
    return found


def completions_table(trainer, step: int) -> pd.DataFrame:
    """The latest rollouts TRL keeps (``trainer._logs``), for the first ``REVIEW_PROMPTS`` distinct prompts."""
    logs = trainer._logs
    prompts, completions = list(logs["prompt"]), list(logs["completion"])
    images = list(logs["images"]) if len(logs["images"]) == len(prompts) else [None] * len(prompts)
    rewards = {name: list(values) for name, values in logs["rewards"].items()}
    advantages = list(logs["advantages"])
    perception = _perception_by_text(trainer)
    chosen: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        if prompt in chosen or len(chosen) < REVIEW_PROMPTS:
            chosen.setdefault(prompt, [])
            if len(chosen[prompt]) < REVIEW_COMPLETIONS_PER_PROMPT:
                chosen[prompt].append(i)
    rows, shown = [], {}
    for prompt_index, (prompt, indices) in enumerate(chosen.items()):
        for i in indices:
            first = (images[i] or [None])[0]
            if first is not None and prompt not in shown:
                seed = int(trainer.args.mask_seed) + 1000 * step + prompt_index
                shown[prompt] = (thumbnail(first), thumbnail(masked_image(trainer, first, seed)))
            kl, entropy, masked_entropy = (perception.get((prompt, completions[i])) or [(None,) * 3]).pop(0)
            row = {"step": step, "prompt": prompt}
            if prompt in shown:
                row["image"], row["masked_image"] = shown[prompt]
            row["completion"] = completions[i]
            row.update({f"reward/{name}": float(values[i]) for name, values in rewards.items()})
            row.update(advantage=float(advantages[i]), perception_kl=kl)
            row.update(original_entropy=entropy, masked_entropy=masked_entropy)
            rows.append(row)
    return pd.DataFrame(rows)


def log_completions(client: MlflowClient, run_id: str, trainer, step: int, artifact_file: str) -> dict[str, Any]:
    """Log ``completions_table`` with ``log_table``; returns what it cost (rows, images, pixels, seconds)."""
    start = time.perf_counter()
    table = completions_table(trainer, step)
    if table.empty:
        return {"rows": 0, "images": 0, "pixels": 0, "seconds": time.perf_counter() - start}
    pictures = [cell for column in ("image", "masked_image") if column in table for cell in table[column]]
    client.log_table(run_id, data=table, artifact_file=artifact_file)  # (it replaces the images by file references)
    return {
        "rows": len(table),
        "images": len(pictures),
        "pixels": sum(p.width * p.height for p in pictures),
        "seconds": time.perf_counter() - start,
    }


# --------------------------------------------------------------------------------------------
# lineage
# --------------------------------------------------------------------------------------------


def dataset_input(dataset, name: str, source: dict[str, str] | str):
    """An MLflow dataset for a Hugging Face ``dataset``: ``source`` a hub id or folder, or the tags of the code that
    generated it (synthetic sets). The digest is MLflow's (a hash of the first rows and the row count)."""
    from mlflow.data.code_dataset_source import CodeDatasetSource

    if isinstance(source, dict):
        return mlflow.data.from_huggingface(dataset, name=name, source=CodeDatasetSource(tags=source))
    return mlflow.data.from_huggingface(dataset, path=source, name=name)


def dataset_source(params, dataset: str) -> dict[str, str] | str:
    """Where the workbook's ``dataset`` comes from: the generator and its arguments, or the hub id / folder."""
    if dataset == "synthetic" or dataset.startswith("testbed:"):
        return {"mlflow.source.name": f"papo_nb {dataset}", "seed": str(params.seed)}
    return dataset


def log_dataset_inputs(client: MlflowClient, run_id: str, named: dict[str, tuple[Any, str, str]]) -> None:
    """``named``: {name: (dataset, source, context)} with context ``training`` or ``evaluation``."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    inputs = [
        DatasetInput(
            dataset_input(dataset, name, source)._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, context)]
        )
        for name, (dataset, source, context) in named.items()
    ]
    client.log_inputs(run_id, datasets=inputs)


# --------------------------------------------------------------------------------------------
# checkpoints as logged models
# --------------------------------------------------------------------------------------------


def log_checkpoint_model(
    client: MlflowClient, run_id: str, checkpoint: Path, step: int, *, params: dict[str, str], copy_weights=False
) -> str:
    """An external MLflow LoggedModel for ``checkpoint`` (weights left where they are unless ``copy_weights``),
    output of ``run_id`` at ``step``; TRL's model card (the PAPO citation) from the output folder is its README.md."""
    run = client.get_run(run_id)
    kind = "lora-adapter" if (checkpoint / "adapter_config.json").is_file() else "full-model"
    model = mlflow.create_external_model(
        name=f"{run.info.run_name}-{checkpoint.name}",
        source_run_id=run_id,
        experiment_id=run.info.experiment_id,
        model_type=f"papo-g {kind}",
        tags={CHECKPOINT_PATH_TAG: str(checkpoint.resolve()), "papo_nb.step": str(step), "papo_nb.weights": (
            "copied into the model's artifacts" if copy_weights else f"on disk, not copied: {checkpoint.resolve()}")},
        params={k: str(v)[:6000] for k, v in params.items()},
    )  # fmt: skip
    card = checkpoint.parent / "README.md"
    with tempfile.TemporaryDirectory() as tmp:
        if card.is_file():
            shutil.copy2(card, Path(tmp) / "README.md")
        if copy_weights:
            shutil.copytree(checkpoint, Path(tmp) / "weights")
        if any(Path(tmp).iterdir()):
            client.log_model_artifacts(model.model_id, tmp)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    return model.model_id


def find_checkpoint_model(experiment_id: str, checkpoint: Path) -> str | None:
    """The id of the logged model of ``checkpoint`` (its resolved path), the newest if logged twice; else None."""
    models = mlflow.search_logged_models(
        experiment_ids=[experiment_id],
        filter_string=f"tags.`{CHECKPOINT_PATH_TAG}` = '{checkpoint.resolve()}'",
        order_by=[{"field_name": "creation_time", "ascending": False}],
        output_format="list",
    )
    return models[0].model_id if models else None


def model_params(trainer) -> dict[str, str]:
    args = trainer.args
    base = getattr(getattr(trainer.model, "config", None), "_name_or_path", "")
    names = ("perception_loss_weight", "mask_type", "mask_ratio", "beta", "loss_type", "learning_rate", "seed")
    return {"base_model": base, **{name: getattr(args, name) for name in names}}


# --------------------------------------------------------------------------------------------
# the callback
# --------------------------------------------------------------------------------------------


class ReviewCallback(TrainerCallback):
    """Logs the review material of the module docstring into the run active when training begins."""

    def __init__(self, trainer, datasets: dict[str, tuple[Any, str, str]]):
        # A weak reference: the trainer holds this callback, and a cycle would keep a deleted trainer's model alive
        # until the next garbage collection (the study deletes each trainer to free its memory).
        self._trainer, self.datasets = weakref.ref(trainer), datasets
        self.run_id: str | None = None
        self.client: MlflowClient | None = None
        self.monitor = None
        self.models: dict[int, str] = {}  # step -> logged model id
        self.costs: list[dict[str, Any]] = []  # per completions table: rows, images, pixels, seconds
        self.tables: set[int] = set()  # steps whose table is logged

    @property
    def trainer(self):
        return self._trainer()

    @property
    def full_review(self) -> bool:
        return "mlflow" in (self.trainer.args.report_to or [])

    def on_train_begin(self, args, state, control, **kwargs):
        run = mlflow.active_run()
        if run is None or not state.is_world_process_zero:
            return
        mlflow.clear_active_model()  # this run's metrics belong to its own checkpoints, not an earlier run's model
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.run_id, self.client = run.info.run_id, MlflowClient(mlflow.get_tracking_uri())
        log_dataset_inputs(self.client, self.run_id, self.datasets)
        self.monitor = SystemMetricsMonitor(
            self.run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=mlflow.get_tracking_uri()
        )
        self.monitor.start()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.log_table(state.global_step)

    def log_table(self, step: int) -> None:
        """The completions table of ``step``, once (the Trainer's closing summary log comes at the last step)."""
        if self.run_id is None or not self.full_review or not self.trainer._logs["prompt"] or step in self.tables:
            return
        self.tables.add(step)
        table = f"completions/step_{step:05d}.json"
        self.costs.append(log_completions(self.client, self.run_id, self.trainer, step, table))

    def on_save(self, args, state, control, **kwargs):
        if self.run_id is None or not self.full_review:
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if holds_model(checkpoint):
            params = model_params(self.trainer)
            self.models[state.global_step] = log_checkpoint_model(
                self.client, self.run_id, checkpoint, state.global_step, params=params
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.run_id is None:
            return
        if self.monitor is not None:
            self.monitor.finish()
            # Its loop drops the sample collected before the stop; publish it, so a run shorter than the interval
            # still has one.
            last = self.monitor.aggregate_metrics()
            if last:
                self.monitor.publish_metrics(last)
                self.monitor.mlflow_logger.flush()
        self.log_table(state.global_step)  # the end of training, when its last step was not a logging step
        if self.costs:
            seconds = [c["seconds"] for c in self.costs]
            self.client.log_metric(self.run_id, "review/completions_table_seconds_mean", sum(seconds) / len(seconds))
        if self.models.get(state.global_step):  # held-out metrics logged next belong to the final policy
            mlflow.set_active_model(model_id=self.models[state.global_step])


def attach_review(trainer, params, train_dataset, eval_dataset) -> ReviewCallback:
    """Add a ``ReviewCallback`` for ``params``' training and held-out datasets to ``trainer``; returns it."""
    source = dataset_source(params, params.dataset)
    named = {"train": (train_dataset, "training"), "heldout": (eval_dataset, "evaluation")}
    datasets = {f"{params.dataset}-{k}": (d, source, context) for k, (d, context) in named.items() if d is not None}
    callback = ReviewCallback(trainer, datasets)
    trainer.add_callback(callback)
    return callback
