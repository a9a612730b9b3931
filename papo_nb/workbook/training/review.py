"""What a reviewer of a PAPO-G run finds in MLflow: completions with their images, checkpoints as logged models,
dataset lineage and system metrics.

``attach_review(trainer, ...)`` adds a ``ReviewCallback`` to a trainer. While an MLflow run is active it

- logs the training and held-out datasets as dataset inputs of the run (name, source, digest, schema);
- samples CPU, memory (and GPU, with ``nvidia-ml-py``) every ``SYSTEM_METRICS_INTERVAL_S`` s as ``system/*`` metrics;
- with ``report_to="mlflow"``, every ``logging_steps`` appends that step's rows to one completions table
  (``completions.json``, see ``completions.py``): each completion beside its own image and the exact mask its step
  trained with, every reward function's value, the advantage, and the completion's perception KL and entropies;
- with ``report_to="mlflow"``, turns every saved checkpoint into an MLflow 3 ``LoggedModel`` linked to the run at its
  step. The weights stay in the checkpoint folder (the model records its path); only TRL's model card, which
  credits PAPO, is copied. After training the last checkpoint's model is the active model, so the held-out metrics
  the notebook logs next are attached to it.

Per-completion KL, entropies and masks come from ``PAPOGTrainer.perception_record.rollout`` and
``masks.rollout_masks`` (this process's completions only).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import LoggedModelOutput, Metric
from mlflow.utils.mlflow_tags import MLFLOW_SOURCE_NAME
from mlflow.utils.time import get_current_time_millis
from transformers import TrainerCallback
from transformers.integrations import MLflowCallback

from papo_nb.workbook.training.checkpoints import holds_model
from papo_nb.workbook.training.completions import log_completions

SYSTEM_METRICS_INTERVAL_S = 5.0  # MLflow's default is 10 s; a CPU smoke run trains in about a minute
CHECKPOINT_PATH_TAG = "papo_nb.checkpoint_path"
# A checkpoint's own metric columns in the models list: its step's training curves, as ``checkpoint/<key>`` (the
# same key again would put a second point at that step into the run's curve), with the training dataset. The held-out
# scores of the final checkpoint and of an evaluated one come from notebooks 03 and 05.
CHECKPOINT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "kl", "perception_kl", "entropy")
CHECKPOINT_PREFIX = "checkpoint/"
# The INFO lines the workbook's own MLflow calls print in every notebook (attaching a run, training, setting the
# evaluated model), by logger: they say nothing about the run. Only these messages are dropped; every other line of
# those loggers still shows. Installed by ``tracking.attach_run`` and the callback.
QUIET_MLFLOW_LINES = {
    "mlflow.tracking.fluent": ("Active model is cleared", "Active model is set to"),
    "mlflow.system_metrics.system_metrics_monitor": (
        "Started monitoring system metrics.",
        "Stopping system metrics monitoring...",
        "Successfully terminated system metrics monitoring!",
        "Skip logging GPU metrics.",
    ),
}


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_mlflow_review_lines() -> None:
    """Filter ``QUIET_MLFLOW_LINES`` at their loggers, once per process."""
    for name, starts in QUIET_MLFLOW_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines(starts))


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
            "copied into the model's artifacts" if copy_weights else f"on disk, not copied: {checkpoint.resolve()}"),
            **model_source_tags(run)},
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


def model_source_tags(run) -> dict[str, str]:
    """Where a model of ``run`` was logged from, for the models list's "Logged from": the workbook notebook that made
    it (a notebook run's ``papo_nb.notebook`` tag), not the kernel's launcher script MLflow would name (``ipykernel_
    launcher.py``); empty outside a workbook notebook run (the process's own source is then right)."""
    notebook = run.data.tags.get("papo_nb.notebook")
    return {MLFLOW_SOURCE_NAME: f"notebooks/{notebook}.ipynb"} if notebook else {}


def log_step_metrics_to_model(
    client: MlflowClient, run_id: str, model_id: str, logs: dict, step: int, dataset
) -> dict[str, float]:
    """The training metrics of ``step`` (``CHECKPOINT_METRICS`` present in the Trainer's log ``logs``) as
    ``checkpoint/<key>`` at that step, with the checkpoint's ``model_id`` and the training ``dataset`` (an MLflow
    dataset), so the models list shows them as its metric columns beside the dataset. Returns what was logged."""
    metrics = {
        f"{CHECKPOINT_PREFIX}{key}": float(logs[key])
        for key in CHECKPOINT_METRICS
        if isinstance(logs.get(key), (int, float))
    }
    now = get_current_time_millis()
    client.log_batch(run_id, metrics=[
        Metric(key, value, now, step, model_id=model_id, dataset_name=dataset.name, dataset_digest=dataset.digest)
        for key, value in metrics.items()
    ])  # fmt: skip
    return metrics


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
        quiet_mlflow_review_lines()
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
        self.costs.append(log_completions(self.client, self.run_id, self.trainer, step))

    def on_save(self, args, state, control, **kwargs):
        if self.run_id is None or not self.full_review:
            return
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if holds_model(checkpoint):
            params = model_params(self.trainer)
            model_id = log_checkpoint_model(self.client, self.run_id, checkpoint, state.global_step, params=params)
            self.models[state.global_step] = model_id
            logs = next((e for e in reversed(state.log_history) if e.get("step") == state.global_step), {})
            training = next((k for k, (_, _, context) in self.datasets.items() if context == "training"), None)
            if training is not None:
                dataset = dataset_input(self.datasets[training][0], training, self.datasets[training][1])
                log_step_metrics_to_model(self.client, self.run_id, model_id, logs, state.global_step, dataset)

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


class MLflowCallbackWithoutModelConfig(MLflowCallback):
    """transformers' ``MLflowCallback`` except that the model's config is not logged as run params (a tiny Qwen2-VL's
    is some 160 of them, which buried the run's own parameters): the TrainingArguments stay params, the model config
    is logged once as ``train/model_config.json``."""

    def setup(self, args, state, model):
        super().setup(args, state, None)
        config = getattr(model, "config", None)
        if config is not None and state.is_world_process_zero and mlflow.active_run() is not None:
            mlflow.log_text(config.to_json_string(), "train/model_config.json")


def attach_review(trainer, params, train_dataset, eval_dataset) -> ReviewCallback:
    """Add a ``ReviewCallback`` for ``params``' training and held-out datasets to ``trainer``, and put
    ``MLflowCallbackWithoutModelConfig`` in place of transformers' MLflow callback where it reports; returns the
    review callback."""
    if trainer.pop_callback(MLflowCallback) is not None:
        trainer.add_callback(MLflowCallbackWithoutModelConfig())
    source = dataset_source(params, params.dataset)
    named = {"train": (train_dataset, "training"), "heldout": (eval_dataset, "evaluation")}
    datasets = {f"{params.dataset}-{k}": (d, source, context) for k, (d, context) in named.items() if d is not None}
    callback = ReviewCallback(trainer, datasets)
    trainer.add_callback(callback)
    return callback
