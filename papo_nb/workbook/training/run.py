"""One PAPO-G training run from workbook parameters: the body of notebook 03 (and of ``papo-nb train``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.builder import build_trainer, load_datasets, load_policy, papo_config
from papo_nb.workbook.training.checkpoints import (
    RestoredAdapter,
    describe_reference,
    latest_checkpoint,
    load_trainable_adapter,
)
from papo_nb.workbook.training.review import attach_review


@dataclass
class TrainingResult:
    trainer: Any
    eval_dataset: Any
    output_dir: Path
    last_checkpoint: Path | None
    restored_adapter: RestoredAdapter | None
    reference_policy: str
    log_history: list[dict]

    @property
    def step_logs(self) -> list[dict]:
        """Per-step training logs (the final summary entry excluded)."""
        from papo_nb.workbook.training.figures import step_logs

        return step_logs(self.log_history)


def prepare_training(params: WorkbookParams, output_dir: str | Path, *, report_to: str = "none", **config_overrides):
    """Model (fresh LoRA, or a trained adapter for phase 2), data and trainer, ready to ``train()``
    or to probe. Returns (trainer, held-out eval dataset, restored-adapter evidence or None)."""
    model, processor = load_policy(params)
    train_dataset, eval_dataset = load_datasets(params)
    restored = None
    if params.init_adapter:
        model, restored = load_trainable_adapter(model, params.init_adapter)
    args = papo_config(params, output_dir, processor, report_to=report_to, **config_overrides)
    trainer = build_trainer(params, args, model, processor, train_dataset)
    attach_review(trainer, params, train_dataset, eval_dataset)  # completions, checkpoint models, lineage (MLflow)
    if params.reference_policy == "base" and "ref" in getattr(trainer.model, "peft_config", {}):
        # TRL 1.9.1 copied the loaded adapter into a frozen "ref" adapter (beta != 0); without it, TRL computes the
        # reference with adapters disabled: the base model. (Before train(), so before accelerate wraps the model.)
        trainer.model.delete_adapter("ref")
    return trainer, eval_dataset, restored


def tag_probe_status(trainer) -> str | None:
    """Tag the active MLflow run ``papo_nb.probe_status`` with the in-training probe's status ("passed",
    "underpowered", "pending", ...) so an underpowered probe shows as a warning next to the run; returns it."""
    evidence = getattr(getattr(trainer, "probe", None), "evidence", None)
    if evidence is None:
        return None
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.set_tag("papo_nb.probe_status", evidence.status)
        if evidence.status == "underpowered":
            mlflow.set_tag("papo_nb.probe_warning", evidence.message[:5000])
    return evidence.status


def run_training(
    params: WorkbookParams, output_dir: str | Path, *, report_to: str = "none", **config_overrides
) -> TrainingResult:
    trainer, eval_dataset, restored = prepare_training(params, output_dir, report_to=report_to, **config_overrides)
    trainer.train()
    tag_probe_status(trainer)
    output_dir = Path(output_dir)
    return TrainingResult(
        trainer,
        eval_dataset,
        output_dir,
        latest_checkpoint(output_dir),
        restored,
        describe_reference(trainer),
        list(trainer.state.log_history),
    )
