"""Peak memory of one PAPO-G step with prefix sharing at Qwen's vocabulary (151,936), tiny widths otherwise, on two
TRL releases: 1.9.1's logits path (the packed forward's logits at its needed positions only)
against 1.15+'s fused LM head (the packed forward scored through TRL's own head, no vocabulary-sized logits).

Each release lives in its own virtualenv, so each measurement is a fresh worker process of that virtualenv's Python
(``--python``, once per release), one per variant: plain PAPO-G (``prefix_sharing=False``) and PAPO-G with sharing
(``prefix_sharing=True``), the masked branch in the step. The tiny Qwen2.5-VL with LoRA, its embeddings and LM head
resized to ``--vocab``, on a synthetic batch (``harness.synthetic_batch``: real prompts and images, ``--n-prompts``
x 4 completions of ``--completion-tokens`` ids drawn from the whole vocabulary). Per worker: one warm-up step (the
optimizer's state), then torch's CPU allocation peak above the pre-step level (``memory.allocation_peak``) and the
process's RSS peak above it (``memory.rss_peak``), each over one step, and whether every log-prob call was packed.

    python -m papo_nb.bench.sharing_memory --python .venv/bin/python --python .venv-trl-newest/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MARK = "SHARING_MEMORY_JSON "
QWEN_VOCAB = 151936
VARIANTS = {"papo_plain": False, "papo_shared": True}  # variant: its prefix_sharing


def worker(variant: str, vocab: int, n_prompts: int, completion_tokens: int, seed: int) -> dict[str, Any]:
    """One variant's measurement in this process, on the installed TRL."""
    import torch
    import trl
    from trl import GRPOTrainer

    from papo_nb.bench import harness, memory
    from papo_nb.prefix_sharing import sharing as prefix_sharing
    from papo_nb.prefix_sharing import trl_seams

    torch.set_num_threads(1)
    settings = harness.bench_params(seed, n_prompts, model_name_or_path="tiny:qwen2_5_vl")
    setup = harness.tiny_setup(
        settings, "tiny", seed=seed, cache_dir=None, work_dir=Path(tempfile.mkdtemp(prefix="papo_sharing_mem_")),
        n_dataset=max(8, n_prompts), started=time.perf_counter(), vocab_size=vocab,
    )  # fmt: skip
    trainer = setup.trainer(variant, masked_branch="update", prefix_sharing=VARIANTS[variant])
    batch = harness.synthetic_batch(setup.processor, 4 * n_prompts, completion_tokens, vocab_size=vocab, seed=seed)
    setup.ready(batch)

    def step():
        return harness.optimizer_step(trainer, setup.model, setup.batch, setup.params, setup.optimizer)

    step()  # warm-up: the optimizer's state and one-time initialisation, common to both variants
    allocated = memory.allocation_peak(step)
    resident = memory.rss_peak(step)
    shared = trainer._metrics["train"].get(prefix_sharing.METRIC, [])
    return {
        "trl": trl.__version__,
        "form": trl_seams.live_seam(GRPOTrainer).name,
        "variant": variant,
        "shape": harness.batch_shape(batch, setup.model.get_output_embeddings().weight.shape[0]),
        "alloc_peak_mib": allocated["peak_bytes"] / 2**20,
        "rss_peak_mib": resident["peak_bytes"] / 2**20,
        "packed_calls": f"{int(sum(shared))}/{len(shared)}",
    }


def run_worker(python: str, variant: str, arguments: list[str]) -> dict[str, Any]:
    command = [python, "-m", "papo_nb.bench.sharing_memory", "--worker", variant, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} {variant} worker failed:\n{(done.stderr or done.stdout)[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| TRL | log-prob form | variant | packed calls | step allocation peak (MiB) | step RSS peak (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r['trl']} | {r['form']} | {r['variant']} | {r['packed_calls']} | "
                     f"{r['alloc_peak_mib']:.1f} | {r['rss_peak_mib']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m papo_nb.bench.sharing_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--python", action="append", default=[], help="a release's virtualenv Python (repeat)")
    parser.add_argument("--vocab", type=int, default=QWEN_VOCAB, help="vocabulary the LM head is resized to")
    parser.add_argument("--n-prompts", type=int, default=4, help="prompts in the batch (4 completions each)")
    parser.add_argument("--completion-tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--worker", choices=sorted(VARIANTS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("vocab", "n_prompts", "completion_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.worker:
        print(MARK + json.dumps(worker(args.worker, args.vocab, args.n_prompts, args.completion_tokens, args.seed)))
        return 0
    if not args.python:
        parser.error("--python not given: give one virtualenv Python per release")
    common = ["--vocab", str(args.vocab), "--n-prompts", str(args.n_prompts)]
    common += ["--completion-tokens", str(args.completion_tokens), "--seed", str(args.seed)]
    results = []
    for python in args.python:
        for variant in VARIANTS:
            results.append(run_worker(python, variant, common))
            print(f"TRL {results[-1]['trl']} {variant}: {results[-1]['alloc_peak_mib']:.1f} MiB", flush=True)
    print(markdown(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
