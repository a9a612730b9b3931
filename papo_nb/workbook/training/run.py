"""The pieces of one PAPO-G training run that need no run folder and no launcher: the trainer built from workbook
parameters, the start record (with its trainable-parameter check) and the probe-status tags.

``papo_nb.train.runner.run_training`` composes them into the one training path that notebook 03 and
``papo-nb train`` share; notebooks 01, 02 and the study build trainers with ``prepare_training`` alone.
"""

from __future__ import annotations

from pathlib import Path

from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.builder import build_trainer, load_datasets, load_policy, papo_config
from papo_nb.workbook.training.checkpoints import RestoredAdapter, load_trainable_adapter
from papo_nb.workbook.training.review import attach_review

PROBE_STATUS_TAG = "papo_nb.probe_status"
PROBE_WARNING_TAG = "papo_nb.probe_warning"
MLFLOW_TAG_LIMIT = 5000  # characters MLflow keeps in a tag value


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


def training_phase(params: WorkbookParams) -> str:
    return "phase2 (resumed adapter)" if params.init_adapter else "phase1 (fresh adapter)"


def start_record(params: WorkbookParams, trainer, restored: RestoredAdapter | None, reference: str) -> dict:
    """What a run starts from: phase, trainable parameters, KL reference, restored adapter, processes.

    Raises ValueError when nothing is trainable (a saved adapter loaded with ``is_trainable=False`` trains nothing,
    silently), before the first step."""
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if trainable == 0:
        raise ValueError(
            f"no trainable parameters in {type(trainer.model).__name__} (init_adapter = {params.init_adapter!r}): "
            "the run would train nothing; load the adapter trainable or leave init_adapter empty"
        )
    return {
        "phase": training_phase(params),
        "trainable_parameters": trainable,
        "reference_policy": reference,
        "restored_adapter": restored.to_dict() if restored else None,
        "num_processes": params.num_processes,
    }


def tag_probe_status(trainer) -> str | None:
    """Tag the active MLflow run ``papo_nb.probe_status`` with the in-training probe's status ("passed",
    "underpowered", "pending", ...) and, when underpowered, ``papo_nb.probe_warning`` with its message, so the
    warning shows next to the run; returns the status (None without a probe or evidence)."""
    evidence = getattr(getattr(trainer, "probe", None), "evidence", None)
    if evidence is None:
        return None
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.set_tag(PROBE_STATUS_TAG, evidence.status)
        if evidence.status == "underpowered":
            mlflow.set_tag(PROBE_WARNING_TAG, evidence.message[:MLFLOW_TAG_LIMIT])
    return evidence.status
