"""Where a run's model comes from and where it runs: the one leaf the builder and the data loaders use."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from papo_nb.testbed.models import build_tiny_vlm
from papo_nb.testbed.perception import testbed_name
from papo_nb.testbed.policy import pinned_testbed
from papo_nb.workbook.config.params import WorkbookParams

TINY_PREFIX = "tiny:"


def resolve_device(params: WorkbookParams) -> str:
    if params.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("parameter 'device' = 'cuda' but no CUDA device is present; allowed here: 'auto' or 'cpu'")
    if params.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return params.device


def process_device(device: str, environ: Mapping[str, str], device_count: int) -> str:
    """Where this process loads its model: ``device`` ('cpu' or 'cuda') as ``resolve_device`` gives it, the launch's
    environment (``LOCAL_RANK``, accelerate's ``ACCELERATE_USE_FSDP``) and the visible GPU count.

    On CUDA each process takes its own GPU, ``cuda:<LOCAL_RANK>`` (0 outside a launch), as the Trainer places a DDP
    model (``args.device``); under FSDP the model stays on the CPU and accelerate shards it onto each process's GPU
    (``fsdp_cpu_ram_efficient_loading``: a whole copy on a GPU first is the VRAM spike it avoids)."""
    if device != "cuda":
        return device
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "cpu"
    text = environ.get("LOCAL_RANK", "0")
    rank = int(text) if text.isdigit() else -1
    if not 0 <= rank < device_count:
        raise ValueError(
            f"environment LOCAL_RANK = {text!r}: this process would train on GPU {text} but {device_count} GPU(s) "
            "are visible; allowed: 0 to the GPU count - 1 (parameter 'num_processes' at most the GPU count, "
            "CUDA_VISIBLE_DEVICES listing them)"
        )
    return f"cuda:{rank}"


def resolve_model_path(params: WorkbookParams, cache_dir: str | Path | None = None) -> str:
    """``tiny:<family>`` builds the offline tiny model (cached); ``testbed:<name>`` is the shipped warm-started
    perception testbed (seed 0, checked by SHA-256: every machine and run seed starts from the same policy); anything
    else is a hub id or local folder."""
    testbed = testbed_name(params.model_name_or_path)
    if testbed is not None:
        return str(pinned_testbed(testbed))
    if params.model_name_or_path.startswith(TINY_PREFIX):
        family = params.model_name_or_path[len(TINY_PREFIX) :]
        return str(build_tiny_vlm(family, seed=params.seed, cache_dir=cache_dir))
    return params.model_name_or_path
