"""``papo-nb`` command line.

Each subcommand is one ``_cmd_<name>(subparsers)`` function that adds its parser and sets
``handler`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code).
To add a subcommand, write such a function and append it to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from papo_nb import __version__
from papo_nb.infra.environment import drift_report, environment_report


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
    p.add_argument(
        "--drift",
        action="store_true",
        help="also check the TRL contract on 0.29.1 and every release from 1.9.1 to the newest on the package index "
        "(wheels fetched with pip download --no-deps, cached); a drifted release exits 0, it is reported",
    )

    def handler(args: argparse.Namespace) -> int:
        report = environment_report()
        drift = drift_report() if args.drift else None
        if args.json:
            print(json.dumps(report if drift is None else {**report, "trl_drift": drift}, indent=2))
            return 0
        for key, value in report.items():
            print(f"{key}: {_format_value(value)}")
        if drift is not None:
            print(f"TRL drift table (releases from: {drift['releases_from']})")
            print(drift["markdown"])
        return 0

    p.set_defaults(handler=handler)


def _add_params_arguments(p: argparse.ArgumentParser) -> None:
    """``--params FILE`` and repeatable ``-p KEY=VALUE``: how ``run`` and ``train`` take the workbook parameters."""
    p.add_argument("--params", metavar="FILE", help="YAML params file (default: built-in defaults)")
    _add_override_argument(p)


def _add_override_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-p",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one parameter; the value is read as YAML (repeatable)",
    )


def _cmd_run(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="execute workbook notebooks with papermill, tracked in MLflow",
        description="Validate the parameters and notebooks, then execute the notebooks in order with "
        "papermill, each in its own MLflow run nested under one workbook run. Stops at the first "
        "failing notebook. Exit codes: 0 all passed, 1 a notebook failed, 2 bad parameters or notebooks.",
    )
    p.add_argument("notebooks", nargs="*", metavar="NOTEBOOK", help="notebooks to run (default: notebooks/NN_*.ipynb)")
    _add_params_arguments(p)
    p.add_argument("--run-root", metavar="DIR", default="runs", help="where run folders are made (default: ./runs)")
    p.add_argument("--log-output", action="store_true", help="stream the notebooks' cell output to the terminal")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.infra.notebooks import WorkbookError, default_notebooks, run_workbook

        if args.log_output:  # papermill streams cell output through its logger
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        notebooks = args.notebooks or default_notebooks()
        if not notebooks:
            print(
                "papo-nb run: error: no notebooks given, and none match notebooks/[0-9][0-9]_*.ipynb "
                "in the project folder",
                file=sys.stderr,
            )
            return 2
        try:
            result = run_workbook(
                notebooks, args.params, args.overrides, run_root=args.run_root, log_output=args.log_output
            )
        except WorkbookError as exc:
            print(f"papo-nb run: error: {exc}", file=sys.stderr)
            return 2
        if result.unread_params:
            print(
                f"papo-nb run: note: no workbook notebook declares {', '.join(result.unread_params)} from the "
                "params file (papo-nb train reads them); the notebooks ran without them",
                file=sys.stderr,
            )
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


def _serve_until_interrupted(command: str, name: str, server, detail: str) -> int:
    """Enter a server context manager (it yields the url), print it, and hold until Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # stop the server on kill too
    # A background job inherits SIGINT ignored (POSIX shells), and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    try:
        with server as url:
            print(f"{name}: {url}  ({detail}; Ctrl-C stops it)", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print(f"{name} stopped")
        return 0
    except RuntimeError as exc:
        print(f"papo-nb {command}: error: {exc}", file=sys.stderr)
        return 1


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
        from papo_nb.infra.servers import serve_mlflow_ui
        from papo_nb.infra.tracking import default_tracking_uri

        uri = default_tracking_uri()
        return _serve_until_interrupted(
            "ui", "MLflow UI", serve_mlflow_ui(port=args.port, host=args.host, tracking_uri=uri), f"store {uri}"
        )

    p.set_defaults(handler=handler)


def _cmd_lab(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "lab",
        help="serve JupyterLab on the workbook's notebooks",
        description="Run JupyterLab on the project's notebooks folder until Ctrl-C, bound to 127.0.0.1 with a "
        "fresh token (printed in the url). Its python3 kernel is this environment's, so it imports papo_nb; "
        "notebooks run by hand log to MLFLOW_TRACKING_URI, else mlflow.db in the project folder.",
    )
    p.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    p.add_argument(
        "--notebook-dir", metavar="DIR", default=None, help="folder to serve (default: the project's notebooks/)"
    )
    p.add_argument(
        "--runs-dir", metavar="DIR", default=None,
        help="the workbook runs' folder, linked into the served folder as runs/ (default: the project's runs/)",
    )  # fmt: skip
    p.add_argument("--edit", action="store_true", help="allow saving over the tracked NN_*.ipynb notebooks")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.infra.lab import PROTECT_TRACKED_ARGS, link_results
        from papo_nb.infra.servers import serve_jupyterlab
        from papo_nb.infra.tracking import default_tracking_uri, project_dir

        folder = Path(args.notebook_dir) if args.notebook_dir else project_dir() / "notebooks"
        results = link_results(folder, args.runs_dir or project_dir() / "runs")
        return _serve_until_interrupted(
            "lab",
            "JupyterLab",
            serve_jupyterlab(folder, port=args.port, extra_args=() if args.edit else PROTECT_TRACKED_ARGS),
            f"notebooks {folder.resolve()}; executed runs {results}; store {default_tracking_uri()}",
        )

    p.set_defaults(handler=handler)


def _cmd_train(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="one PAPO-G training run: resumable, on one or several processes",
        description="Train PAPO-G with the workbook parameters into --output-dir, logging to MLflow "
        "(MLFLOW_TRACKING_URI, else mlflow.db in the project folder). With num_processes > 1 it runs itself under "
        "accelerate launch; it can also be started by accelerate launch (-m papo_nb.cli train ...). A killed run "
        "continues with --resume from its last complete checkpoint, in the same MLflow run. Exit codes: 0 trained, "
        "1 training failed, 2 bad parameters or a refused run (an existing run without --resume, or a resume whose "
        "parameters differ), 74 a full disk (the last complete checkpoint is the resume point), 75 stopped by SIGTERM "
        "or SIGUSR1 at a marked checkpoint (continue with --resume); docs/scale-out.md.",
    )
    _add_params_arguments(p)
    p.add_argument(
        "--output-dir", metavar="DIR", required=True, help="folder of the run: parameters, MLflow run id, checkpoints"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its last complete checkpoint"
    )
    p.add_argument(
        "--force-resume", action="store_true", help="--resume even if parameters that matter differ from the run's"
    )
    p.add_argument(
        "--mlflow-run-id",
        metavar="ID",
        default="",
        help="log into this MLflow run (default: the run's own, or a new one)",
    )
    p.add_argument(
        "--skip-eval",
        action="store_true",
        help="leave out the held-out evaluation of eval_split after the last step (the results page is still written)",
    )
    _add_gpu_memory_argument(p)

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.train.runner import train_command

        _simulate_gpu_memory(args)

        return train_command(
            args.params,
            args.overrides,
            args.output_dir,
            resume=args.resume,
            force_resume=args.force_resume,
            mlflow_run_id=args.mlflow_run_id,
            evaluate=not args.skip_eval,
        )

    p.set_defaults(handler=handler)


def _add_gpu_memory_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpu-memory",
        metavar="GIB",
        type=float,
        default=None,
        help="memory of each GPU in GiB for the memory forecast (default: the visible GPUs', or the environment "
        "variable PAPO_NB_GPU_MEMORY_GIB); a device: cuda run that cannot fit is refused before any weight loads",
    )


def _simulate_gpu_memory(args: argparse.Namespace) -> None:
    """``--gpu-memory`` reaches the forecast (and launched ranks) through the environment."""
    import os

    from papo_nb.workbook.recipe.forecast_report import GPU_MEMORY_ENV

    if args.gpu_memory is not None:
        os.environ[GPU_MEMORY_ENV] = str(args.gpu_memory)


def _cmd_preflight(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "preflight",
        help="check a run before anything loads: memory and time forecast, the plan that makes it fit, batches, data",
        description="The one preflight (papo_nb.workbook.recipe.check): forecast, per GPU, each part of a training "
        "step's peak memory and the step time from the params and the model's configuration alone (no weights); "
        "where the run does not fit, print every change that makes it fit as one plan, each departure from the "
        "named recipe marked and a batch change said as such; check the batch sizes TRL would refuse, the data's "
        "columns and rows and its images' tokens, and the GPUs here. Offline it reads only local data and the "
        "cache (HF_HUB_OFFLINE=1) or gives the hub 5 s. Exit codes: 0 fits and no problem (or no GPU memory "
        "given), 1 does not fit or a problem, 2 bad parameters.",
    )
    p.add_argument("params_file", metavar="PARAMS", help="YAML params file")
    _add_override_argument(p)
    _add_gpu_memory_argument(p)
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs (sets num_processes)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.infra.tracking import project_dir
        from papo_nb.workbook.config.params import ParamsError, load_params
        from papo_nb.workbook.recipe.check import plan_lines, preflight
        from papo_nb.workbook.recipe.forecast_report import as_dict, describe, gpu_memory_here

        _simulate_gpu_memory(args)
        overrides = [*args.overrides, *([f"num_processes={args.gpus}"] if args.gpus else [])]
        try:
            params = load_params(args.params_file, overrides)
            result = preflight(params, gpu_memory_here(), root=project_dir())
        except (ParamsError, ValueError) as exc:
            print(f"papo-nb preflight: error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            plan = [{"parameter": c.parameter, "from": c.old, "to": c.new, "batch": c.batch} for c in result.plan]
            extra = {"problems": result.problems, "notes": result.notes, "deviations": result.deviations, "plan": plan,
                     "run_length": result.estimates}  # fmt: skip
            print(json.dumps({**as_dict(result.forecast), **extra}, indent=1, default=str))
        else:
            lines = [describe(result.forecast)]
            lines += plan_lines(result, params.recipe) if result.fits is False else []
            lines += [f"data: {k} {v:g}" for k, v in result.estimates.items() if v is not None]
            lines += [f"problem: {p}" for p in result.problems] + [f"note: {n}" for n in result.notes]
            lines += [f"departs from the recipe: {d}" for d in result.deviations]
            print("\n".join(lines))
        return 1 if result.fits is False or result.problems else 0

    p.set_defaults(handler=handler)


def _cmd_rehearse(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "rehearse",
        help="rehearse a GPU run on the CPU at true widths and hold the memory forecast against it",
        description="Build a random-weight model from the params' published configuration with K decoder layers and "
        "K vision blocks (no weights, no hub), run two optimizer steps of the params' training phases on the CPU "
        "(completions, accumulation and the round shortened, the micro-batch kept), and print per part the forecast "
        "beside the measured peak. Exit codes: 0 every part within 15%, 1 some part not, 2 bad parameters.",
    )
    p.add_argument("params_file", metavar="PARAMS", help="YAML params file")
    _add_override_argument(p)
    p.add_argument("--layers", type=int, nargs="+", default=[1], metavar="K", help="decoder layers (default: 1)")
    p.add_argument("--json", metavar="FILE", default=None, help="write forecast and measurement per part to FILE")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.bench.rehearsal import rehearse_command

        return rehearse_command(args.params_file, args.overrides, args.layers, args.json)

    p.set_defaults(handler=handler)


def _cmd_sync(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "sync",
        help="deliver a run's spooled MLflow logging (kept while the tracking server was unreachable)",
        description="Deliver, in order and with their original steps and timestamps, the MLflow calls a run kept in "
        "RUN_DIR/mlflow_spool because its tracking store did not answer before the run ended. Delivering twice "
        "logs nothing twice. Exit codes: 0 all delivered, 1 the store stayed unreachable, 2 no spool in RUN_DIR.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's --output-dir")
    p.add_argument("--tracking-uri", default="", help="deliver to this store (default: the one in run_info.json)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to keep retrying an unreachable store")

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.train.spool import sync_command

        return sync_command(args.run_dir, args.tracking_uri, args.timeout)

    p.set_defaults(handler=handler)


def _cmd_bench(subparsers: Subparsers) -> None:
    # Arguments pass through to papo_nb.bench.main (which imports torch), so other subcommands stay fast to start.
    p = subparsers.add_parser(
        "bench",
        add_help=False,
        help="PAPO-G step overhead benchmark (see benchmarks/README.md); --help for its options",
    )

    def handler(args: argparse.Namespace) -> int:
        from papo_nb.bench.main import main as bench_main

        return bench_main(args.passthrough)

    p.set_defaults(handler=handler, passthrough_allowed=True)


SUBCOMMANDS: list[Callable[[Subparsers], None]] = [
    _cmd_env,
    _cmd_run,
    _cmd_ui,
    _cmd_lab,
    _cmd_train,
    _cmd_preflight,
    _cmd_rehearse,
    _cmd_sync,
    _cmd_bench,
]


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
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passthrough_allowed", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.passthrough = unknown
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
