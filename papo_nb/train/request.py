"""One training run asked for: the parameters, the run folder, how to treat a run already there, the MLflow run and
store. ``run_training`` makes one; the same request trains in this process or goes to ``accelerate launch``
(``distributed.launch_distributed``), whose ranks read it back from their ``papo-nb train`` command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from papo_nb.workbook.config.params import WorkbookParams


@dataclass(frozen=True)
class RunRequest:
    """``output_dir`` is made absolute, so that every launched rank, whatever its working folder, writes the same
    run. ``resume`` continues the run there; ``force_resume`` does even when parameters that matter changed;
    ``mlflow_run_id`` and ``tracking_uri`` name the MLflow run and store (empty: the folder's run, the default
    store)."""

    params: WorkbookParams
    output_dir: Path
    resume: bool = False
    force_resume: bool = False
    mlflow_run_id: str = ""
    tracking_uri: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "output_dir", Path(self.output_dir).resolve())

    def train_arguments(self, params_file: str | Path) -> list[str]:
        """The ``papo-nb train`` arguments of this request, the parameters read from ``params_file`` (the store
        goes to the ranks by ``MLFLOW_TRACKING_URI``)."""
        arguments = ["--params", str(params_file), "--output-dir", str(self.output_dir)]
        if self.resume:
            arguments.append("--resume")
        if self.force_resume:
            arguments.append("--force-resume")
        if self.mlflow_run_id:
            arguments += ["--mlflow-run-id", self.mlflow_run_id]
        return arguments
