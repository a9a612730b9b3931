"""Checkpoint integrity: whether a ``checkpoint-N/`` folder is complete, and the newest one a resume can use."""

from __future__ import annotations

import json
import struct
import warnings
import zipfile
from pathlib import Path

from papo_nb.train.run_folder import TRAINER_STATE_FILE
from papo_nb.workbook.training.checkpoints import ADAPTER_FILE, FULL_MODEL_FILES, checkpoint_folders, checkpoint_step


class CorruptCheckpointWarning(UserWarning):
    """A checkpoint folder is incomplete or damaged and is skipped."""


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the data its offsets describe."""
    try:
        with path.open("rb") as f:
            (header_length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_length))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        return f"{path.name} is unreadable ({type(exc).__name__}: {exc})"
    expected, size = 8 + header_length + end, path.stat().st_size
    if size != expected:
        return f"{path.name} has {size} bytes where its header describes {expected} (truncated or damaged)"
    return None


def torch_archive_problem(path: Path) -> str | None:
    """``torch.save`` writes a zip archive; a truncated one has lost its central directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{path.name} is not a complete torch archive ({exc})"
    return None


def policy_weight_files(folder: Path) -> list[Path]:
    """The safetensors files that hold the policy: the LoRA adapter(s) (the "ref" copy sits in a subfolder), or after
    full fine-tuning the whole model, one file or the shards its index lists. Empty when there are none."""
    root_adapter = folder / ADAPTER_FILE
    sub_adapters = sorted(p / ADAPTER_FILE for p in folder.iterdir() if (p / ADAPTER_FILE).is_file())
    if root_adapter.is_file() or sub_adapters:
        return [root_adapter, *sub_adapters]  # a missing root adapter is then named as missing
    single, index = (folder / name for name in FULL_MODEL_FILES)
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            return [index]  # unreadable index: safetensors_problem names it
        return [folder / shard for shard in shards]
    return []


def checkpoint_problems(folder: str | Path) -> list[str]:
    """Why ``folder`` cannot be resumed from (empty: it is complete).

    The Trainer writes a checkpoint as adapter, optimizer, scheduler, RNG states and, last, trainer_state.json,
    so a save cut short lacks trainer_state.json; a damaged file fails its format check. DeepSpeed checkpoints
    keep the optimizer in ``global_step*/`` instead of optimizer.pt.
    """
    folder = Path(folder)
    problems: list[str] = []
    weights = policy_weight_files(folder)
    if not weights:
        problems.append(f"missing {ADAPTER_FILE} (LoRA) or {' / '.join(FULL_MODEL_FILES)} (full fine-tuning)")
    for path in weights:
        if not path.is_file():
            listed = "" if path.name == ADAPTER_FILE else f" (listed in {FULL_MODEL_FILES[1]})"
            problems.append(f"missing {path.relative_to(folder)}{listed}")
        elif problem := safetensors_problem(path):
            problems.append(problem if path.parent == folder else f"{path.parent.name}/{problem}")
    state = folder / TRAINER_STATE_FILE
    if not state.is_file():
        problems.append(f"missing {TRAINER_STATE_FILE} (written last: the save was cut short)")
    else:
        try:
            step = json.loads(state.read_text())["global_step"]
            if step != checkpoint_step(folder):
                problems.append(f"{TRAINER_STATE_FILE} says step {step}, the folder name {checkpoint_step(folder)}")
        except (ValueError, KeyError) as exc:
            problems.append(f"{TRAINER_STATE_FILE} is unreadable ({type(exc).__name__}: {exc})")
    deepspeed = any(folder.glob("global_step*"))
    for name in ([] if deepspeed else ["optimizer.pt"]) + ["scheduler.pt"]:
        path = folder / name
        if not path.is_file():
            problems.append(f"missing {name}")
        elif problem := torch_archive_problem(path):
            problems.append(problem)
    return problems


def find_resume_checkpoint(
    output_dir: str | Path, *, warn: bool = True
) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest complete checkpoint (or None), and the newer ones skipped with their problems.

    Each skipped checkpoint is named in a ``CorruptCheckpointWarning`` (when ``warn``)."""
    skipped: list[tuple[Path, list[str]]] = []
    for folder in checkpoint_folders(output_dir):
        problems = checkpoint_problems(folder)
        if not problems:
            return folder, skipped
        skipped.append((folder, problems))
        if warn:
            warnings.warn(
                f"skipping corrupt or partial checkpoint {folder}: {'; '.join(problems)}",
                CorruptCheckpointWarning,
                stacklevel=2,
            )
    return None, skipped
