"""The smoke workbook's headline numbers on each CPU kernel path, side by side, with their spread.

    python -m papo_nb.infra.smoke_paths [--paths default avx2 avx512] [--root runs/smoke_paths]

The smoke workbook starts from the shipped ``testbed:shapes_boxed`` weights, so its card is the same on any machine;
its RL steps and sampling are not: another CPU's kernels (``ATEN_CPU_CAPABILITY``) round differently and the runs
drift apart. This runs notebooks 03-05 on ``params/smoke.yaml`` once per kernel path (each path's notebook kernels
start with the variable set, so ATen picks that path when torch loads there), each into its own MLflow store under
``--root`` (kept, to open with ``papo-nb ui``), and prints the numbers README quotes per path with their range: what
a researcher on another machine should expect to see.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mlflow import MlflowClient

from papo_nb.infra.notebooks import run_workbook
from papo_nb.infra.tracking import project_dir
from papo_nb.testbed.kernel_paths import cpu_paths

# the checkout (else the cwd), found as the notebooks and the MLflow store are (``tracking.project_dir``)
SMOKE_PARAMS = project_dir() / "params" / "smoke.yaml"
HEADLINE_NOTEBOOKS = ("03_training_run", "04_method_study", "05_evaluation")


def smoke_headlines(client: MlflowClient, runs: dict) -> dict[str, float]:
    """The numbers a researcher reads first in notebooks 03, 04 and 05, from the MLflow store (``runs``: notebook
    name -> its MLflow run)."""
    training, evaluation, study = (
        runs[n].data.metrics for n in ("03_training_run", "05_evaluation", "04_method_study")
    )
    headlines = {
        "03 held-out accuracy": training["eval/accuracy_original"],
        "03 image-reliance gap": training["eval/image_reliance_gap"],
        "03 vision-dependent accuracy": training["eval/accuracy_original/vision"],
        "05 overall avg@k": evaluation["eval/overall/avg_at_k"],
        "05 vision-dependent avg@k": evaluation["eval/testbed_vision/avg_at_k"],
    }
    arms = sorted(k.removeprefix("study/headline/") for k in study if k.startswith("study/headline/"))
    for arm in arms:  # mean over the study's seeds
        headlines[f"04 {arm} vision avg@k"] = study[f"study/headline/{arm}"]
    # the calibrated design's verdict: GRPO's drift from the warm start, each PAPO-G arm minus GRPO (95% CI, MDE)
    for key in sorted(k for k in study if k.startswith(("study/drift", "study/vs_grpo"))):
        headlines["04 " + key.removeprefix("study/")] = study[key]
    headlines["04 arms on the notebook run"] = len(arms)
    headlines["04 seeds"] = len({run.data.params.get("seed") for run in _study_runs(client, runs["04_method_study"])})
    return headlines


def _study_runs(client: MlflowClient, study) -> list:
    """The trained runs nested under notebook 04's run."""
    return client.search_runs(
        [study.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{study.info.run_id}'"
    )


def headlines_on_path(path: str | None, root: Path) -> dict[str, float]:
    """Notebooks 03-05 on the smoke parameters, every notebook kernel on kernel path ``path`` (None: the one this
    process's environment gives), their stores and executed copies under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("ATEN_CPU_CAPABILITY")
    if path is not None:
        os.environ["ATEN_CPU_CAPABILITY"] = path  # the kernels papermill starts inherit it
    try:
        result = run_workbook(
            [project_dir() / "notebooks" / f"{name}.ipynb" for name in HEADLINE_NOTEBOOKS],
            SMOKE_PARAMS,
            run_root=root / "runs",
            tracking_uri=f"sqlite:///{root.resolve()}/mlflow.db",
        )
    finally:
        if before is None:
            os.environ.pop("ATEN_CPU_CAPABILITY", None)
        else:
            os.environ["ATEN_CPU_CAPABILITY"] = before
    if not result.ok:
        raise RuntimeError(f"the smoke workbook failed on kernel path {path or 'native'}: {result.failure_message}")
    client = MlflowClient(result.tracking_uri)
    return smoke_headlines(client, {nb.name: client.get_run(nb.run_id) for nb in result.notebooks})


def spread_table(by_path: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per headline, one column per path, then the range across paths."""
    paths = list(by_path)
    lines = [f"| headline | {' | '.join(f'`{p}`' for p in paths)} | range |", "|---|" + "---:|" * (len(paths) + 1)]
    for key in next(iter(by_path.values())):
        values = [by_path[p][key] for p in paths]
        lines.append(f"| {key} | {' | '.join(f'{v:.3f}' for v in values)} | {max(values) - min(values):.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", help="kernel paths (default: every one this CPU runs)")
    parser.add_argument("--root", type=Path, default=Path("runs/smoke_paths"), help="where each path's store goes")
    args = parser.parse_args(argv)
    runnable = cpu_paths()
    if args.paths and not set(args.paths) <= set(runnable):
        parser.error(f"--paths {args.paths}: this CPU runs {runnable}")
    by_path = {}
    for path in args.paths or runnable:
        by_path[path] = headlines_on_path(path, args.root / path)
        print(f"{path}: {by_path[path]}", flush=True)
    print(spread_table(by_path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
