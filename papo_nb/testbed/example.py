"""The folders docs/adapter.md's quick start trains on, made offline: a tiny random Qwen2-VL
(``models.build_tiny_vlm``'s, copied to a folder of one's choosing) and a few shapes rows saved with ``datasets``.
It proves the plumbing, not a result: the model is random.

    python -m papo_nb.testbed.example my_model my_dataset
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from papo_nb.testbed.models import build_tiny_vlm
from papo_nb.testbed.shapes import make_shapes_dataset


def write_example(model_dir: str | Path, dataset_dir: str | Path, rows: int = 8, seed: int = 0) -> tuple[Path, Path]:
    """Copy the tiny Qwen2-VL (built, or reused, in the testbed's cache) into ``model_dir`` and write ``rows`` shapes
    rows (prompt, image, answer) into ``dataset_dir``; returns both folders."""
    model_dir, dataset_dir = Path(model_dir), Path(dataset_dir)
    shutil.copytree(build_tiny_vlm("qwen2_vl", seed=seed), model_dir, dirs_exist_ok=True)
    make_shapes_dataset(rows, seed=seed).save_to_disk(str(dataset_dir))
    return model_dir, dataset_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m papo_nb.testbed.example",
        description="Write a tiny random Qwen2-VL folder and a few shapes rows (docs/adapter.md's quick start), "
        "offline.",
    )
    parser.add_argument("model_dir", help="folder for the model and its processor")
    parser.add_argument("dataset_dir", help="folder for the rows (datasets.load_from_disk reads it)")
    parser.add_argument("--rows", type=int, default=8, help="shapes rows to write (default 8)")
    args = parser.parse_args(argv)
    model_dir, dataset_dir = write_example(args.model_dir, args.dataset_dir, args.rows)
    print(f"model: {model_dir.resolve()}\ndataset: {dataset_dir.resolve()} ({args.rows} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
