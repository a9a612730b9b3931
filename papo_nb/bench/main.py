"""Step-overhead benchmark: what PAPO-G adds to a GRPO optimizer step, measured side by side.

In one process, on one model, one fixed rollout batch and one seed, it times interleaved repeats (round-robin:
every variant once, then again) of the variants ``harness`` defines: a GRPO step, a PAPO-G step (masked branch
with and without gradient), the extra forward that is PAPO-G's floor, masking alone and one probe evaluation.
Generation is excluded on purpose: it is identical for GRPO and PAPO-G and would drown the signal. ``memory``
measures each step's memory, ``report`` judges the targets and writes the tables (``benchmarks/README.md``).

Run ``python benchmarks/step_overhead.py [--quick] [--out FILE.json]`` or ``papo-nb bench``. This module is the
entry point: the arguments, one size after another, the printed verdicts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from papo_nb.bench.harness import SIZES, batch_shape, build_setup, make_variants
from papo_nb.bench.memory import measure_memory, measure_rss, measure_work, rss_worker
from papo_nb.bench.report import TARGET_SIZE, environment, markdown_tables, targets, verdict_lines
from papo_nb.bench.timing import RUN_STEPS, ratios, summarise, time_interleaved, training_probe_checks

MODES = {
    # repeats per size, warm-up rounds, real trainer.train() steps for the probe checks, RSS subprocesses
    "quick": dict(repeats={"tiny": 5, "wide": 3}, warmup=1, train_steps=2, rss=False),
    "full": dict(repeats={"tiny": 30, "wide": 12}, warmup=2, train_steps=3, rss=True),
}


def bench_size(
    size: str,
    *,
    family: str,
    seed: int,
    cache_dir,
    repeats: int,
    warmup: int,
    train_steps: int,
    memory: bool,
    rss: bool,
    n_prompts: int = 4,
    log=print,
) -> dict[str, Any]:
    log(f"[{size}] building model, trainers and one rollout batch ...")
    setup = build_setup(size, family=family, seed=seed, cache_dir=cache_dir, n_prompts=n_prompts)
    vocab = setup.model.get_output_embeddings().weight.shape[0]
    result: dict[str, Any] = dict(
        size=size,
        family=family,
        params=setup.n_params,
        trainable_params=setup.n_trainable,
        batch=batch_shape(setup.batch, vocab),
        repeats=repeats,
        warmup=warmup,
        setup_s=setup.setup_s,
    )
    log(
        f"[{size}] {setup.n_params / 1e6:.2f}M parameters; timing {repeats} interleaved rounds (+{warmup} warm-up) ..."
    )
    result.update(timed_variants(setup, repeats, warmup))
    log(f"[{size}] work: FLOPs and op counts per variant (torch.profiler) ...")
    result["work"] = measure_work(setup)
    if memory:
        log(f"[{size}] memory (profiler allocation events, live full-vocab tensors) ...")
        result["memory"] = measure_memory(setup)
    if rss:
        log(f"[{size}] peak RSS, one subprocess per step variant ...")
        result["rss"] = measure_rss(setup, cache_dir, n_prompts)
    if train_steps > 0:
        log(f"[{size}] probe inside real training ({train_steps} trainer.train() steps, probe off then on) ...")
        result["probe_training"] = probe_in_training(setup, train_steps, result)
    return result


def timed_variants(setup, repeats: int, warmup: int) -> dict[str, Any]:
    """Interleaved repeats of every variant on both clocks: samples, summaries, ratios, and the evidence of the last
    probe evaluation."""
    start = time.perf_counter()
    cpu_times: dict[str, list[float]] = {}
    times = time_interleaved(make_variants(setup), repeats, warmup, cpu_out=cpu_times)
    result: dict[str, Any] = {"timing_s": time.perf_counter() - start}
    result["samples_s"] = times
    result["timings"] = {name: summarise(values) for name, values in times.items()}
    result["ratios"] = ratios(times)
    result["cpu_samples_s"] = cpu_times
    result["cpu_timings"] = {name: summarise(values) for name, values in cpu_times.items()}
    result["cpu_ratios"] = ratios(cpu_times)
    evidence = setup.extra["probe_state"].get("evidence")
    result["probe_eval_evidence"] = (
        {
            k: evidence.to_dict()[k]
            for k in ("status", "parent_grad_norm", "grad_diff_norm", "grad_diff_relative", "perception_kl")
        }
        if evidence
        else None
    )
    return result


def probe_in_training(setup, train_steps: int, result: dict[str, Any]) -> dict[str, Any]:
    """``training_probe_checks``, with the in-training probe's share of a 100-step run on both clocks (one step:
    the timed PAPO-G step's median)."""
    checks = training_probe_checks(setup, train_steps)
    on = checks["probe_on"]
    on["fraction_of_100_steps"] = on["probe_total_s"] / (RUN_STEPS * result["timings"]["papo_step"]["median"])
    on["cpu_fraction_of_100_steps"] = on["probe_total_cpu_s"] / (
        RUN_STEPS * result["cpu_timings"]["papo_step"]["median"]
    )
    return checks


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true", help="few repeats, no RSS subprocesses (a few minutes)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the markdown tables here")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated model sizes (tiny, wide)")
    parser.add_argument("--family", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-prompts", type=int, default=4, help="prompts in the fixed batch (x4 generations each)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per size (default: by mode and size)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed warm-up rounds")
    parser.add_argument(
        "--train-steps", type=int, default=None, help="trainer.train() steps for the probe checks (0: skip)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the in-process memory measurement")
    parser.add_argument(
        "--rss", dest="rss", action="store_true", default=None, help="measure peak RSS in subprocesses"
    )
    parser.add_argument("--no-rss", dest="rss", action="store_false", help="skip the RSS subprocesses")
    parser.add_argument(
        "--cache-dir", default=None, help="model cache folder (default: PAPO_NB_CACHE or ~/.cache/papo_nb)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the benchmark's setting)")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="which clock judges the targets (both are reported): process CPU time or wall time",
    )
    parser.add_argument("--rss-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rss-batch", default=None, help=argparse.SUPPRESS)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        raise SystemExit(f"--sizes: unknown size(s) {unknown}; allowed: {list(SIZES)}")
    if args.rss_worker:
        print(
            "RSS_JSON "
            + json.dumps(
                rss_worker(
                    sizes[0], args.rss_worker, args.family, args.seed, args.cache_dir, args.n_prompts, args.rss_batch
                )
            )
        )
        return 0
    mode = "quick" if args.quick else "full"
    settings = MODES[mode]
    rss = settings["rss"] if args.rss is None else args.rss
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    start = time.perf_counter()
    report: dict[str, Any] = dict(mode=mode, environment=environment(), command=" ".join(sys.argv), sizes={})
    for size in sizes:
        repeats = args.repeats if args.repeats is not None else settings["repeats"][size]
        warmup = args.warmup if args.warmup is not None else settings["warmup"]
        train_steps = args.train_steps if args.train_steps is not None else settings["train_steps"]
        result = bench_size(
            size,
            family=args.family,
            seed=args.seed,
            cache_dir=args.cache_dir,
            repeats=repeats,
            warmup=warmup,
            train_steps=train_steps,
            memory=not args.no_memory,
            rss=rss,
            n_prompts=args.n_prompts,
            log=log,
        )
        result["targets"] = targets(result, args.clock)
        report["sizes"][size] = result
    report["target_size"] = TARGET_SIZE if TARGET_SIZE in report["sizes"] else sizes[-1]
    report["targets"] = report["sizes"][report["target_size"]]["targets"]
    report["total_s"] = time.perf_counter() - start
    publish(report, args)
    return 0


def publish(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The tables and verdicts on stdout, the JSON report and the tables into ``--out`` and ``--markdown``."""
    tables = markdown_tables(report)
    report["markdown"] = tables
    print(tables)
    print()
    for line in verdict_lines(report):
        print(line)
    print(f"total {report['total_s']:.1f} s ({report['mode']} mode)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(tables + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = add_bench_arguments(argparse.ArgumentParser(prog="step_overhead", description=__doc__.split("\n\n")[0]))
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
