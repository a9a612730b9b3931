"""vLLM colocate against HF ``generate`` per generation round, inside ``trainer.train()`` (issue 65, docs/vllm.md).

One process per group size G (a colocated engine per process), in the vLLM venv (scripts/vllm_cpu_env.sh). The
trainer trains with vLLM rollouts; in every round its ``_generate_single_turn`` also runs HF ``generate`` on the same
prompts from a second trainer (``use_vllm`` off, the same weights copied in before the round), the order alternating
round by round, one thread. Per call: seconds, completion tokens per second, the process's peak RSS during the call
and its growth over the RSS at the call's start (sampled every 5 ms; the colocated engine, its KV cache included,
lives in the same process, so the peak counts both engines' weights). Reported: the median and the min-max
spread over the timed rounds, and the ratio of medians.

    .venv-vllm/bin/python benchmarks/vllm_vs_generate.py              # G 5 and 8, 8 timed rounds each, ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")


class PeakRSS:
    """The process's peak resident set size (MiB) while the block runs, sampled by a thread."""

    def __enter__(self):
        import psutil

        self.process, self.running = psutil.Process(), True
        self.start = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.growth, self.peak = (self.peak - self.start) / 2**20, self.peak / 2**20


def trainer_for(model: str, group: int, completion: int, rounds: int, out: str, use_vllm: bool):
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.training.builder import prepare_training

    overrides = [f"model_name_or_path={model}", f"use_vllm={str(use_vllm).lower()}", f"max_steps={rounds}",
                 f"save_steps={rounds}", f"num_generations={group}", f"per_device_train_batch_size={2 * group}",
                 f"max_completion_length={completion}", "require_gpu_contract_probe=false",
                 "n_train_prompts=64", "vllm_fidelity_every=0"]  # fmt: skip
    trainer, _, _ = prepare_training(load_params("params/smoke_fast.yaml", overrides), out)
    return trainer


def measure(group: int, rounds: int, warmup: int, completion: int) -> dict:
    import torch

    from papo_nb.testbed.models import build_tiny_vlm

    torch.set_num_threads(1)
    model = str(build_tiny_vlm("qwen2_5_vl", size="vllm"))
    calls = {"vllm": [], "generate": []}
    with tempfile.TemporaryDirectory() as out:
        hf = trainer_for(model, group, completion, rounds + warmup, f"{out}/hf", use_vllm=False)
        trainer = trainer_for(model, group, completion, rounds + warmup, f"{out}/vllm", use_vllm=True)
        vllm_turn, hf_turn = trainer._generate_single_turn, hf._generate_single_turn

        def timed(name, turn, *args):
            with PeakRSS() as rss:
                start = time.perf_counter()
                result = turn(*args)
                seconds = time.perf_counter() - start
            tokens = sum(len(ids) for ids in result[0])  # (completion_ids, logprobs): TRL 1.16
            calls[name].append({"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_rss_mib": rss.peak,
                                "rss_growth_mib": rss.growth})  # fmt: skip
            return result

        def both(prompt_ids, images, multimodal_fields, num_generations, *rest):
            hf.model.load_state_dict(trainer.model.state_dict())  # the same weights, outside the timing
            args = (prompt_ids, images, multimodal_fields, num_generations, *rest)
            if len(calls["vllm"]) % 2:
                timed("generate", hf_turn, *args)
                return timed("vllm", vllm_turn, *args)
            result = timed("vllm", vllm_turn, *args)
            timed("generate", hf_turn, *args)
            return result

        trainer._generate_single_turn = both
        trainer.train()
    return {"group": group, "completion_tokens_max": completion, "warmup": warmup} | {
        name: summary(rows[warmup:]) for name, rows in calls.items()
    }


def summary(rows: list[dict]) -> dict:
    return {key: {"median": statistics.median(r[key] for r in rows), "min": min(r[key] for r in rows),
                  "max": max(r[key] for r in rows), "n": len(rows)} for key in rows[0]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="5,8", help="group sizes G, one process each")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per G")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before the timed ones")
    parser.add_argument("--completion", type=int, default=64, help="max_completion_length")
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)  # one G in this process (JSON on the last line)
    args = parser.parse_args()
    if args.group:
        print(json.dumps(measure(args.group, args.rounds, args.warmup, args.completion)))
        return 0
    print("| G | engine | seconds per round (median, min-max) | tokens/s (median, min-max) | peak RSS MiB | "
          "RSS growth MiB (max) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for group in map(int, args.groups.split(",")):
        command = [sys.executable, __file__, "--group", str(group), "--rounds", str(args.rounds), "--warmup",
                   str(args.warmup), "--completion", str(args.completion)]  # fmt: skip
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(run.stdout.strip().splitlines()[-1])
        for name in ("vllm", "generate"):
            s, t, m, g = (row[name][k] for k in ("seconds", "tokens_per_s", "peak_rss_mib", "rss_growth_mib"))
            print(f"| {group} | {'vLLM colocate' if name == 'vllm' else 'HF generate'} | {s['median']:.3f} "
                  f"({s['min']:.3f}-{s['max']:.3f}) | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) | "
                  f"{m['median']:.0f} | {g['max']:.1f} |")  # fmt: skip
        ratio = row["generate"]["seconds"]["median"] / row["vllm"]["seconds"]["median"]
        print(f"| {group} | HF / vLLM seconds (medians) | {ratio:.2f} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
