"""Where notebook 05's ``eval_checkpoint`` comes from, and the training step its scores are logged at.

``eval_checkpoint: workbook:03_training_run`` (``WORKBOOK_CHECKPOINT``, the smoke workbook's value) is the last
checkpoint notebook 03 saved: the one of this workbook run (the 03 run beside this one under the same parent), or,
for a notebook run by hand, the newest run of the experiment that recorded one (its ``papo_nb.last_checkpoint``
tag). 03 saved it as an MLflow logged model, so 05's scores attach to that model.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlflow

from papo_nb.workbook.recipe.data import RecipeDataError

WORKBOOK_CHECKPOINT = "workbook:03_training_run"
LAST_CHECKPOINT_TAG = "papo_nb.last_checkpoint"  # set by notebook 03 on its run


def _last_checkpoint_run(run) -> mlflow.entities.Run | None:
    """The 03 run this evaluation follows: its sibling under the workbook run, else the experiment's newest."""
    parent = run.data.tags.get("mlflow.parentRunId")
    where = f"tags.`{LAST_CHECKPOINT_TAG}` != ''"
    if parent:
        where += f" and tags.`mlflow.parentRunId` = '{parent}' and tags.`papo_nb.notebook` = '03_training_run'"
    found = mlflow.search_runs(
        [run.info.experiment_id], filter_string=where, order_by=["attributes.start_time DESC"], max_results=1,
        output_format="list",
    )  # fmt: skip
    return found[0] if found else None


def resolve_eval_checkpoint(params) -> Path | None:
    """``eval_checkpoint`` as a folder (None: the base model); ``WORKBOOK_CHECKPOINT`` is looked up in MLflow."""
    if params.eval_checkpoint != WORKBOOK_CHECKPOINT:
        return Path(params.eval_checkpoint).expanduser() if params.eval_checkpoint else None
    run = mlflow.active_run()
    source = _last_checkpoint_run(mlflow.get_run(run.info.run_id)) if run is not None else None
    if source is None:
        raise RecipeDataError(
            f"parameter 'eval_checkpoint' = {WORKBOOK_CHECKPOINT!r}: no run of notebook 03 recorded a checkpoint "
            "(run 03 first, in the same workbook run; or give a checkpoint folder, or '' for the base model)"
        )
    return Path(source.data.tags[LAST_CHECKPOINT_TAG])


def policy_step(checkpoint: Path | None) -> int:
    """The training step a policy comes from: N for ``checkpoint-N``, 0 for the base model (1 for a folder named
    otherwise: trained, step unknown)."""
    if checkpoint is None:
        return 0
    matched = re.fullmatch(r"checkpoint-(\d+)", checkpoint.name)
    return int(matched.group(1)) if matched else 1
