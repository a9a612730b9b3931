"""``papo-nb`` command line.

Each subcommand is one ``_cmd_<name>(subparsers)`` function that adds its parser and sets
``handler`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code).
To add a subcommand, write such a function and append it to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from papo_nb import __version__

NOT_INSTALLED = "not installed"

# Distributions whose versions ``environment_report`` lists, in this order.
REPORTED_PACKAGES = ("torch", "torchvision", "trl", "transformers", "peft", "mlflow")


# --------------------------------------------------------------------------------------------
# environment report (also meant for notebooks)
# --------------------------------------------------------------------------------------------


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


def _format_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --------------------------------------------------------------------------------------------
# subcommands
# --------------------------------------------------------------------------------------------

Subparsers = argparse._SubParsersAction  # what add_subparsers() returns


def _cmd_env(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "env",
        help="print versions of python, torch, trl, ... and CUDA availability",
        description="Print versions of python, torch, torchvision, trl, transformers, peft, "
        "mlflow and whether CUDA is available (with the device name if so).",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object instead")

    def handler(args: argparse.Namespace) -> int:
        report = environment_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            for key, value in report.items():
                print(f"{key}: {_format_value(value)}")
        return 0

    p.set_defaults(handler=handler)


# Later: _cmd_run, _cmd_ui, _cmd_lab, _cmd_train, _cmd_bench.
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_cmd_env]


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="papo-nb",
        description="Notebook workbook for PAPO-G on TRL's GRPOTrainer.",
    )
    parser.add_argument("--version", action="version", version=f"papo_nb {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
