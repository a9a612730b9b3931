"""One executed smoke workbook, readable without running it: the five notebooks on ``params/smoke.yaml`` (each
ending on its "What this run showed" cell), rendered as HTML into ``docs/smoke_report/`` with an index that states the
measured wall time of each notebook and of the whole run.

    python -m papo_nb.infra.smoke_report [--out docs/smoke_report] [--root runs/smoke_report]

The run logs to its own MLflow store under ``--root`` (kept, to open with ``papo-nb ui``), so the project's
``mlflow.db`` is left alone; the HTML copies are the ones the runner logs to MLflow beside each executed notebook.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import time
from pathlib import Path

from papo_nb.infra.notebooks import default_notebooks, run_workbook
from papo_nb.infra.smoke_paths import SMOKE_PARAMS

INDEX = "README.md"


def index_page(result, seconds: float) -> str:
    """The report's index: one line per notebook with its status, wall time and HTML page, then the whole run's."""
    lines = [
        "# An executed smoke workbook",
        "",
        "Written by `python -m papo_nb.infra.smoke_report` (`params/smoke.yaml`, the shipped `testbed:shapes_boxed` "
        "weights; 04's study on `testbed:shapes_shortcut`'s) on "
        f"{platform.machine()}, {time.strftime('%Y-%m-%d', time.gmtime())}. Each page is the executed notebook; its "
        "last cell says what the run showed.",
        "",
        "| notebook | status | wall s | page |",
        "|---|---|---:|---|",
    ]
    for nb in result.notebooks:
        page = nb.notebook.with_suffix(".html").name
        lines.append(f"| {nb.notebook.stem} | {nb.status} | {nb.wall_seconds:.0f} | [{page}]({page}) |")
    lines += ["", f"Whole run: {seconds:.0f} s wall (install excluded; the testbed weights ship with the package)."]
    return "\n".join(lines) + "\n"


def write_report(out: Path, root: Path) -> Path:
    """Run the smoke workbook into ``root`` and copy each executed notebook's HTML and the index into ``out``."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run_workbook(
        default_notebooks(), SMOKE_PARAMS, run_root=root / "runs", tracking_uri=f"sqlite:///{root.resolve()}/mlflow.db"
    )
    seconds = time.perf_counter() - start
    if not result.ok:
        raise RuntimeError(f"the smoke workbook failed: {result.failure_message}")
    out.mkdir(parents=True, exist_ok=True)
    for nb in result.notebooks:
        shutil.copyfile(nb.output_path.with_suffix(".html"), out / nb.notebook.with_suffix(".html").name)
    (out / INDEX).write_text(index_page(result, seconds))
    return out / INDEX


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/smoke_report"), help="where the HTML pages go")
    parser.add_argument("--root", type=Path, default=Path("runs/smoke_report"), help="the run's folder and store")
    args = parser.parse_args(argv)
    print(f"wrote {write_report(args.out, args.root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
