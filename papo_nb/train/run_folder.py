"""The run folder of ``papo-nb train``: what each file is, written atomically, read back.

The output folder (``--output-dir``) holds everything a run needs to be resumed:

    params.yaml           the resolved parameters, written when the run starts; ``--resume`` compares against it
    run_info.json         the MLflow run (id and store) and one entry per attempt (start, each resume)
    checkpoint-N/         the Trainer's checkpoints every ``save_steps`` steps: adapter, optimizer, scheduler, RNG
                          states (the PAPO-G masking generator's included), trainer state
    resume_evidence.json  what the last resume restored, compared tensor by tensor with its checkpoint
    train_summary.json    at the end: final step, probe verdict (checked identical on every rank), log history
    train.log             everything the run printed, each attempt appended (``output``); it outlives the terminal
    README.md             TRL's model card, naming the base model (``workbook.training.model_card``)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from papo_nb.infra.tracking import json_safe

PARAMS_FILE = "params.yaml"
RUN_INFO_FILE = "run_info.json"
RESUME_EVIDENCE_FILE = "resume_evidence.json"
SUMMARY_FILE = "train_summary.json"
TRAINER_STATE_FILE = "trainer_state.json"
PROGRESS_PREFIX = "papo-nb train:"


class LaunchError(RuntimeError):
    """A run that must not start; the message says why and what to do instead."""


class LaunchFailed(RuntimeError):
    """A launched job (``accelerate launch``) that exited with an error; ``returncode`` is its exit code."""

    def __init__(self, returncode: int, command: list[str]):
        super().__init__(f"the launched training run failed with exit code {returncode}: {' '.join(command)}")
        self.returncode = returncode


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(json_safe(data), indent=2) + "\n")


def read_saved_params(output_dir: str | Path) -> dict | None:
    path = Path(output_dir) / PARAMS_FILE
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def read_run_info(output_dir: str | Path) -> dict:
    path = Path(output_dir) / RUN_INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
