"""The trainer's one observer hook: an object that looks at each training loss call until it has its verdict.

The in-training gamma-zero probe (``papo/probe/``) is such an observer. It lives beside the adapter, not in it: the
core never imports it, and a copy of ``papo/`` without ``probe/`` trains as well. Only when the config asks for the
probe (``require_gpu_contract_probe=True``) is the subpackage looked up, by name, and its absence is a clear error.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

PROBE_PACKAGE = f"{__package__}.probe"


class LossObserver(Protocol):
    """What the trainer calls: ``observe`` on each training loss call while ``pending``, then logs ``metrics()``."""

    pending: bool

    def observe(self, trainer, model, parent_loss, terms, step: int | None = None) -> Any: ...

    def metrics(self) -> dict[str, float]: ...


def training_observer(args, model=None) -> LossObserver | None:
    """The in-training probe when ``args.require_gpu_contract_probe`` asks for it, else None; ``model`` (the
    trainer's) lets the probe refuse, before any step, a model too large for it."""
    if not args.require_gpu_contract_probe:
        return None
    try:
        probe = importlib.import_module(PROBE_PACKAGE)
    except ModuleNotFoundError as error:
        if error.name != PROBE_PACKAGE:
            raise
        raise ModuleNotFoundError(
            f"PAPOGConfig.require_gpu_contract_probe=True asks for the in-training gamma-zero probe, but its "
            f"subpackage {PROBE_PACKAGE} is not here (copy papo/probe/ beside the adapter to get it); allowed "
            "without it: require_gpu_contract_probe=False",
            name=PROBE_PACKAGE,
        ) from error
    return probe.training_probe(args, model)
