"""Build every testbed fresh on each CPU kernel path and seed, and print the table docs/study.md publishes.

    python -m papo_nb.testbed.across_paths [--seeds 0 1 2] [--threads 1] [--paths default avx2] [NAME ...]

ATen reads ``ATEN_CPU_CAPABILITY`` once, when torch loads, so each (path, seed, threads) build runs in its own
interpreter with its own empty cache: ``default`` and ``avx2`` everywhere, ``avx512`` where the CPU has it. Each row
is one build: its warm-start steps, the validation check that stopped it, and its held-out card; a build that missed
its goal shows the ``TestbedGoalMissed`` message instead. This is the evidence that the warm start reaches its goal on
any machine's kernels, not only on the one that built the shipped weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from papo_nb.testbed.kernel_paths import cpu_paths

_BUILD = """
import json, sys, torch
from papo_nb.testbed import policy
name, seed, threads, cache = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if threads != 1:  # the build pins one thread; this measures what two threads' reduction order does
    pin = torch.set_num_threads
    torch.set_num_threads = lambda n: pin(threads)
try:
    card = policy.read_card(policy.build_testbed(name, seed=seed, cache_dir=cache))
    print(json.dumps({"card": card}))
except policy.TestbedGoalMissed as missed:
    print(json.dumps({"missed": str(missed)}))
"""


def build_on_path(name: str, seed: int, path: str, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": path}
        args = [sys.executable, "-c", _BUILD, name, str(seed), str(threads), cache]
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the build of testbed:{name} seed {seed} on {path} crashed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table_row(name: str, seed: int, path: str, threads: int, result: dict) -> str:
    head = f"| {name} | {seed} | `{path}` | {threads} |"
    if "missed" in result:
        return f"{head} **missed**: {result['missed'][:160]} | | | | |"
    card = result["card"]
    check, accuracy = card["validation_checks"][-1], card["greedy_accuracy"]
    # all black: the card's vision accuracy (chance), or for a prior testbed the stopping check's prior-consistent one
    blind = check.get("blind_prior", accuracy["masked_1.0/vision"])
    text = f"{accuracy['original/text']:.3f}" if "original/text" in accuracy else "none asked"  # shapes_shortcut
    vision = accuracy["original/vision"]
    return f"{head} {card['sft_steps']} | {check['vision']:.3f} | {vision:.3f} | {text} | {blind:.3f} |"


def main(argv: list[str] | None = None) -> int:
    from papo_nb.testbed.perception import TESTBEDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(TESTBEDS), help=f"testbeds (default: all of {TESTBEDS})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--paths", nargs="+", help="kernel paths (default: every one this CPU runs)")
    args = parser.parse_args(argv)
    paths = cpu_paths()
    if args.paths and not set(args.paths) <= set(paths):
        parser.error(f"--paths {args.paths}: this CPU runs {paths}")
    unknown = [n for n in args.names if n not in TESTBEDS]
    if unknown:
        parser.error(f"unknown testbed name(s) {unknown}; allowed: {list(TESTBEDS)}")
    print("| testbed | seed | kernel path | threads | steps | stopping check | held-out vision | text | all black |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in args.names:
        for seed in args.seeds:
            for threads in args.threads:
                for path in args.paths or paths:
                    print(table_row(name, seed, path, threads, build_on_path(name, seed, path, threads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
