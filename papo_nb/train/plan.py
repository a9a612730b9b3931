"""What a run folder says before anything trains: a fresh run, a resume (from which checkpoint), or a finished run.

Everything here only reads the folder, so every rank of a launched job decides alike; writing is rank 0's
(``records``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from papo_nb.train.integrity import find_resume_checkpoint
from papo_nb.train.resume import ResumeMismatch, mismatch_message, resume_differences
from papo_nb.train.run_folder import (
    PARAMS_FILE,
    RUN_INFO_FILE,
    SUMMARY_FILE,
    TRAINER_STATE_FILE,
    LaunchError,
    read_run_info,
    read_saved_params,
)
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.checkpoints import checkpoint_folders, checkpoint_step


@dataclass
class RunPlan:
    """The folder's state and what this call will do with it."""

    output_dir: Path
    resume: bool
    saved_params: dict | None
    run_info: dict
    checkpoint: Path | None = None  # the newest complete checkpoint to resume from
    skipped: list[tuple[Path, list[str]]] = field(default_factory=list)  # newer corrupt ones, with their problems
    forced: list[tuple[str, object, object]] = field(default_factory=list)  # parameter changes --force-resume took
    final_state: dict | None = None  # trainer_state.json of a checkpoint at or past max_steps

    @property
    def reattached(self) -> bool:
        """An earlier attempt started this run (its MLflow run already holds the start record)."""
        return bool(self.run_info.get("attempts"))

    @property
    def finished(self) -> bool:
        return self.checkpoint is not None and self.final_state is not None

    def attempt(self, params: WorkbookParams) -> dict:
        """This attempt's entry for run_info.json."""
        return {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "resume": self.resume,
            "num_processes": params.num_processes,
            "resumed_from": str(self.checkpoint) if self.checkpoint else None,
            "skipped_checkpoints": {str(p): problems for p, problems in self.skipped},
            "forced_parameter_changes": {k: [old, new] for k, old, new in self.forced},
        }

    def summary(self) -> dict:
        """train_summary.json of the run, empty when it has none."""
        path = self.output_dir / SUMMARY_FILE
        return json.loads(path.read_text()) if path.is_file() else {}


def plan_run(
    params: WorkbookParams, output_dir: Path, *, resume: bool, force_resume: bool, warn: bool = True
) -> RunPlan:
    """Read ``output_dir`` and decide. Raises LaunchError for a folder that already holds a run without ``resume``,
    and ResumeMismatch for a resume whose parameters differ in a way that matters, without ``force_resume``."""
    resume = resume or force_resume
    plan = RunPlan(output_dir, resume, read_saved_params(output_dir), read_run_info(output_dir))
    if not resume:
        if plan.saved_params is not None or plan.run_info or checkpoint_folders(output_dir):
            raise LaunchError(
                f"{output_dir} already holds a run ({PARAMS_FILE}, {RUN_INFO_FILE} or checkpoints); pass "
                "--resume to continue it, or choose a new --output-dir"
            )
        return plan
    if plan.saved_params is not None:
        plan.forced = resume_differences(plan.saved_params, params)
        if plan.forced and not force_resume:
            raise ResumeMismatch(mismatch_message(output_dir, plan.forced))
    plan.checkpoint, plan.skipped = find_resume_checkpoint(output_dir, warn=warn)
    if plan.checkpoint is not None and checkpoint_step(plan.checkpoint) >= params.max_steps:
        # The Trainer would run one step past max_steps when resumed at max_steps: a finished run stays finished.
        plan.final_state = json.loads((plan.checkpoint / TRAINER_STATE_FILE).read_text())
    return plan
