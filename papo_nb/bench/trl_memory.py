"""Peak memory of one PAPO-G step on two TRL releases at the same shapes: 1.9.1's logits path against
1.15+'s fused LM head (``prefix_sharing/trl_seams.py``).

Each release lives in its own virtualenv, so each measurement is a fresh worker process of that virtualenv's Python
(``--python``, once per release), all on one batch: the first worker makes it (``harness.build_setup``: the
``size`` tiny Qwen2-VL with LoRA, ``n_prompts`` x 4 completions) and saves it, every worker loads it. Per worker and
variant (a GRPO step and a PAPO-G step, masked branch in the step, ``harness.make_variants``): torch's CPU allocation
peak above the pre-step level and the peak bytes of live full-vocabulary tensors (``memory.measure_memory``). The
releases are interleaved round by round; the report gives each release's median and spread and the per-round ratio.

    python -m papo_nb.bench.trl_memory --python .venv/bin/python --python .venv-trl116/bin/python [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MARK = "TRL_MEMORY_JSON "
VARIANTS = ("grpo_step", "papo_step")
FIELDS = ("alloc_peak_mib", "vocab_bytes_peak")


def worker(size: str, seed: int, n_prompts: int, batch_file: Path, cache_dir: str | None) -> dict[str, Any]:
    """One release's measurement in this process: the setup on the saved batch (made and saved here if absent)."""
    import torch
    import trl
    from trl import GRPOTrainer

    from papo_nb.bench.harness import batch_shape, build_setup
    from papo_nb.bench.memory import measure_memory
    from papo_nb.prefix_sharing import trl_seams

    torch.set_num_threads(1)
    batch = torch.load(batch_file, weights_only=True) if batch_file.exists() else None
    setup = build_setup(size, seed=seed, cache_dir=cache_dir, n_prompts=n_prompts, batch=batch)
    if batch is None:
        torch.save(setup.batch, batch_file)
    vocab = setup.model.get_output_embeddings().weight.shape[0]
    memory = measure_memory(setup, VARIANTS)
    return {
        "trl": trl.__version__,
        "form": trl_seams.live_seam(GRPOTrainer).name,
        "shape": batch_shape(setup.batch, vocab),
        **{name: {field: memory[name][field] for field in FIELDS} for name in VARIANTS},
    }


def run_worker(python: str, arguments: list[str]) -> dict[str, Any]:
    command = [python, "-m", "papo_nb.bench.trl_memory", "--worker", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} worker failed:\n{(done.stderr or done.stdout)[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per release and variant: median, min and max of each field; per round, each release's PAPO-G peak over the
    first release's (same round, neighbouring processes)."""
    out: dict[str, Any] = {}
    for release, runs in results.items():
        out[release] = {"form": runs[0]["form"], "shape": runs[0]["shape"]}
        for name in VARIANTS:
            for field in FIELDS:
                values = [run[name][field] for run in runs]
                out[release][f"{name}.{field}"] = dict(
                    median=statistics.median(values), min=min(values), max=max(values)
                )
    first, *others = results
    for release in others:
        out[release]["papo_step_peak_ratio_per_round"] = [
            mine["papo_step"]["alloc_peak_mib"] / theirs["papo_step"]["alloc_peak_mib"]
            for mine, theirs in zip(results[release], results[first])
        ]
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "| TRL | log-prob form | GRPO step peak (MiB) | PAPO-G step peak (MiB) | PAPO-G full-vocab peak (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for release, row in summary.items():
        cells = [
            f"{row[key]['median']:.1f} [{row[key]['min']:.1f}, {row[key]['max']:.1f}]"
            if "vocab" not in key
            else f"{row[key]['median'] / 2**20:.1f}"
            for key in ("grpo_step.alloc_peak_mib", "papo_step.alloc_peak_mib", "papo_step.vocab_bytes_peak")
        ]
        lines.append(f"| {release} | {row['form']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m papo_nb.bench.trl_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", default=[], help="a release's virtualenv Python (repeat)")
    parser.add_argument("--size", default="wide", choices=("tiny", "wide"), help="the tiny model's size")
    parser.add_argument("--n-prompts", type=int, default=4, help="prompts in the batch (4 completions each)")
    parser.add_argument("--rounds", type=int, default=3, help="worker processes per release, interleaved")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="where the tiny model is built once")
    parser.add_argument("--out", default=None, help="write the results and summary as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.n_prompts < 1:
        parser.error(f"--rounds {args.rounds} and --n-prompts {args.n_prompts}: each must be at least 1")
    if args.worker:
        result = worker(args.size, args.seed, args.n_prompts, Path(args.batch_file), args.cache_dir)
        print(MARK + json.dumps(result))
        return 0
    if len(args.python) < 2:
        parser.error(f"--python given {len(args.python)} time(s): give one virtualenv Python per release, at least 2")
    batch_file = Path(tempfile.mkdtemp(prefix="papo_trl_memory_")) / "batch.pt"
    common = ["--size", args.size, "--n-prompts", str(args.n_prompts), "--seed", str(args.seed)]
    common += ["--batch-file", str(batch_file)] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    results: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        for python in args.python:
            result = run_worker(python, common)
            results.setdefault(result["trl"], []).append(result)
            print(f"round {round_ + 1}: TRL {result['trl']} ({result['form']}): PAPO-G step peak "
                  f"{result['papo_step']['alloc_peak_mib']:.1f} MiB", flush=True)  # fmt: skip
    summary = summarise(results)
    print(markdown(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
