"""Where a run's model comes from and where it runs: the one leaf both the builder and the recipe preflight use."""

from __future__ import annotations

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
