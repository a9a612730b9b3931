"""``papo-nb`` command line.

Each subcommand is one ``_cmd_<name>(subparsers)`` function that adds its parser and sets
``handler`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code).
To add a subcommand, write such a function and append it to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

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


def default_notebooks() -> list[Path]:
    """The project's workbook notebooks, ``notebooks/NN_*.ipynb``, in order."""
    from papo_nb.tracking import project_dir

    return sorted((project_dir() / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _cmd_run(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="execute workbook notebooks with papermill, tracked in MLflow",
        description="Validate the parameters and notebooks, then execute the notebooks in order with "
        "papermill, each in its own MLflow run nested under one workbook run. Stops at the first "
        "failing notebook. Exit codes: 0 all passed, 1 a notebook failed, 2 bad parameters or notebooks.",
    )
    p.add_argument("notebooks", nargs="*", metavar="NOTEBOOK", help="notebooks to run (default: notebooks/NN_*.ipynb)")
    p.add_argument("--params", metavar="FILE", help="YAML params file (default: built-in defaults)")
    p.add_argument("-p", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one parameter; the value is read as YAML (repeatable)")
    p.add_argument("--run-root", metavar="DIR", default="runs", help="where run folders are made (default: ./runs)")
    p.add_argument("--log-output", action="store_true", help="stream the notebooks' cell output to the terminal")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.runner import WorkbookError, run_workbook

        if args.log_output:  # papermill streams cell output through its logger
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        notebooks = args.notebooks or default_notebooks()
        if not notebooks:
            print("papo-nb run: error: no notebooks given, and none match notebooks/[0-9][0-9]_*.ipynb "
                  "in the project folder", file=sys.stderr)
            return 2
        try:
            result = run_workbook(notebooks, args.params, args.overrides, run_root=args.run_root,
                                  log_output=args.log_output)
        except WorkbookError as exc:
            print(f"papo-nb run: error: {exc}", file=sys.stderr)
            return 2
        print(f"run folder: {result.run_dir}")
        print(f"workbook run: {result.parent_run_id}  (store {result.tracking_uri})")
        for nb in result.notebooks:
            line = f"  {nb.status:<9} {nb.name}"
            if nb.run_id:
                line += f"  {nb.wall_seconds:.1f} s  run {nb.run_id}"
            if nb.failed_cell:
                line += f"  at {nb.failed_cell}"
            print(line)
        print("review: papo-nb ui  (then open the run under experiment 'papo_nb')")
        if not result.ok:
            print(f"papo-nb run: {result.failure_message}", file=sys.stderr)
            return 1
        return 0

    p.set_defaults(handler=handler)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _cmd_ui(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "ui",
        help="serve the MLflow UI on the workbook's store",
        description="Run the MLflow UI (mlflow server) on the workbook's tracking store "
        "(MLFLOW_TRACKING_URI, else mlflow.db in the project folder) until Ctrl-C.",
    )
    p.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1, local only)")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.tracking import default_tracking_uri, serve_mlflow_ui

        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # stop the server on kill too
        uri = default_tracking_uri()
        try:
            with serve_mlflow_ui(port=args.port, host=args.host, tracking_uri=uri) as url:
                print(f"MLflow UI: {url}  (store {uri}; Ctrl-C stops it)", flush=True)
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            print("MLflow UI stopped")
            return 0
        except RuntimeError as exc:
            print(f"papo-nb ui: error: {exc}", file=sys.stderr)
            return 1

    p.set_defaults(handler=handler)


# Later: _cmd_lab, _cmd_train, _cmd_bench.
SUBCOMMANDS: list[Callable[[Subparsers], None]] = [_cmd_env, _cmd_run, _cmd_ui]


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
