"""Which Python, libraries and accelerator this process runs on: ``papo-nb env`` prints it, notebook 01 logs it."""

from __future__ import annotations

import platform
from importlib import metadata

NOT_INSTALLED = "not installed"

# Distributions whose versions ``environment_report`` lists, in this order.
REPORTED_PACKAGES = ("torch", "torchvision", "trl", "transformers", "peft", "mlflow")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def environment_report() -> dict[str, str | bool]:
    """Versions of Python and the key libraries, and whether CUDA is usable.

    Keys: ``python``, ``torch``, ``torchvision``, ``trl``, ``transformers``, ``peft``,
    ``mlflow`` (version strings, ``"not installed"`` when absent), ``cuda_available`` (bool)
    and, only when CUDA is available, ``cuda_device`` (name of device 0).
    """
    report: dict[str, str | bool] = {"python": platform.python_version()}
    for name in REPORTED_PACKAGES:
        report[name] = _version(name)
    cuda_available = False
    device = None
    if report["torch"] != NOT_INSTALLED:
        import torch

        cuda_available = bool(torch.cuda.is_available())
        if cuda_available:
            device = torch.cuda.get_device_name(0)
    report["cuda_available"] = cuda_available
    if device is not None:
        report["cuda_device"] = device
    return report


def drift_report() -> dict:
    """The TRL drift table (notebook 01's section 4) for ``papo-nb env --drift``: where the release list came from,
    the rows and the same as markdown."""
    from papo_nb.workbook.verification import trl_releases

    releases = trl_releases.drift_releases()
    rows = trl_releases.contract_drift_table(releases.versions)
    return {
        "releases_from": releases.source,
        "rows": [row.to_dict() for row in rows],
        "markdown": trl_releases.drift_markdown(rows),
    }
