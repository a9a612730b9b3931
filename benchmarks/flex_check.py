"""GPU check of prefix sharing's grouped attention kernels (issue 55 item 5): one FlexAttention call with the layout's
block mask (``papo_nb/prefix_sharing/flex_grouped.py``) against the batched SDPA calls (``grouped_attention.py``).

On a flat packed row of ``--groups`` prompt groups (prompt ``--prompt`` tokens, ``--completions`` completions of
``--completion`` tokens; Qwen2.5-VL-3B's attention: 16 query heads, 2 KV heads, head dim 128) it:
  1. checks exactness in fp32: outputs and the gradients of query, key and value of a fixed random weighting, flex
     against SDPA (the CPU cannot: torch has no FlexAttention backward there, so this is the check of flex's
     gradients);
  2. times forward + backward of each kernel in ``--dtype`` (default bf16), interleaved, ``torch.cuda.synchronize``
     around each, after one warm-up each (flex's compile), and reports medians, spreads and the ratio flex / SDPA,
     with ``torch.cuda.max_memory_allocated`` per kernel.
Writes ``OUT`` (JSON) and prints a summary. ``--cpu-dry-run``: tiny sizes on the CPU, forward only (no CPU backward),
the same code path otherwise. Offline; installs nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, if papo_nb is not installed

import torch  # noqa: E402

from papo_nb.prefix_sharing import flex_grouped, grouped_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128  # Qwen2.5-VL-3B's text attention


def flat_row(groups: int, prompt: int, completions: int, completion: int, device):
    """``(token_groups, segments)`` of a flat row of ``groups`` groups, completions of 1 to ``completion`` tokens."""
    lengths = torch.linspace(1, completion, completions).round().long().tolist()
    token_groups, segments = [], []
    for group in range(groups):
        sizes = torch.tensor([prompt, *lengths])
        segments.append(torch.repeat_interleave(torch.arange(len(sizes)), sizes))
        token_groups.append(torch.full((int(sizes.sum()),), group))
    return torch.cat(token_groups).to(device), torch.cat(segments).to(device)


def layout_of(kernel, token_groups, segments):
    layout = grouped_attention.build_layout(token_groups, segments)
    layout.kernel = kernel
    return layout


def run_kernel(layout, query, key, value, weights, backward: bool):
    """One layer's grouped attention with ``layout`` (its kernel; flex's block mask built on the first call and
    kept, as a packed forward keeps it across layers), and q, k, v gradients where ``backward``."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = HEADS // KV_HEADS, True
    inputs = [t.detach().requires_grad_(backward) for t in (query, key, value)]
    output = grouped_attention.grouped_attention_forward(module, *inputs, layout, scaling=HEAD_DIM**-0.5)[0]
    if not backward:
        return output.detach(), None
    (output.float() * weights).sum().backward()
    return output.detach(), [t.grad for t in inputs]


def exactness(row, device, backward: bool) -> dict:
    """fp32 outputs and gradients of flex against SDPA: max abs errors and the largest relative gradient error."""
    generator = torch.Generator(device=device).manual_seed(0)
    width = len(row[1])
    query = torch.randn(1, HEADS, width, HEAD_DIM, device=device, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, width, HEAD_DIM, device=device, generator=generator) for _ in range(2))
    weights = torch.randn(1, width, HEADS, HEAD_DIM, device=device, generator=generator)
    (sdpa, sdpa_grads), (flex, flex_grads) = (
        run_kernel(layout_of(kernel, *row), query, key, value, weights, backward)
        for kernel in (flex_grouped.SDPA, flex_grouped.FLEX)
    )
    result = {"output_max_abs_error": (flex - sdpa).abs().max().item()}
    if backward:
        result["grad_relative_errors"] = {
            name: ((f - s).norm() / s.norm()).item() for name, f, s in zip("qkv", flex_grads, sdpa_grads)
        }
    return result


def timings(row, device, dtype, backward: bool, repeats: int) -> dict:
    """Median and spread (seconds) of each kernel's forward (+ backward), interleaved, and its peak memory."""
    width = len(row[1])
    query = torch.randn(1, HEADS, width, HEAD_DIM, device=device, dtype=dtype)
    key, value = (torch.randn(1, KV_HEADS, width, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
    weights = torch.randn(1, width, HEADS, HEAD_DIM, device=device)
    kernels = (flex_grouped.SDPA, flex_grouped.FLEX)
    seconds = {kernel: [] for kernel in kernels}
    peaks = {}
    layouts = {kernel: layout_of(kernel, *row) for kernel in kernels}
    for kernel in kernels:  # warm-up: flex compiles here
        run_kernel(layouts[kernel], query, key, value, weights, backward)
    start = time.perf_counter()
    flex_grouped.block_mask(*row)
    mask_seconds = time.perf_counter() - start
    for _ in range(repeats):
        for kernel in kernels:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            run_kernel(layouts[kernel], query, key, value, weights, backward)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks[kernel] = torch.cuda.max_memory_allocated()
            seconds[kernel].append(time.perf_counter() - start)
    result = {
        kernel: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s), "peak_bytes": peaks.get(kernel)}
        for kernel, s in seconds.items()
    }
    result["flex_over_sdpa"] = result["flex"]["median_s"] / result["sdpa"]["median_s"]
    result["block_mask_build_s"] = mask_seconds  # once per packed forward, shared by its layers
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=1100)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU, forward only")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        args.groups, args.prompt, args.completions, args.completion, args.repeats = 2, 40, 3, 12, 2
        device = torch.device("cpu")
        args.dtype = "float32"  # the CPU's compiled flex: fp32/fp16/bf16; fp32 keeps the dry run's numbers exact
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("flex_check.py: no CUDA device (use --cpu-dry-run on a CPU)")
    backward = device.type == "cuda"
    report = {"torch": torch.__version__, "device": str(device), "args": {k: str(v) for k, v in vars(args).items()}}
    rows = {"P_first": (args.prompt, args.completion), "R_first": (args.completion, args.prompt // 2)}
    for name, (prompt, completion) in rows.items():  # a long prompt (split form wins) and a short one (stacked)
        row = flat_row(args.groups, prompt, args.completions, completion, device)
        report[name] = {
            "prompt": prompt,
            "completion": completion,
            "width": len(row[1]),
            "exactness_fp32": exactness(row, device, backward),
            "timing": timings(row, device, getattr(torch, args.dtype), backward, args.repeats),
        }
        timing = report[name]["timing"]
        print(
            f"flex_check {name}: W={len(row[1])} P={prompt} R={completion} flex/sdpa {timing['flex_over_sdpa']:.2f} "
            f"(sdpa {timing['sdpa']['median_s'] * 1e3:.2f} ms, flex {timing['flex']['median_s'] * 1e3:.2f} ms); "
            f"fp32 exactness {report[name]['exactness_fp32']}",
            flush=True,
        )
        args.out.write_text(json.dumps(report, indent=2))  # rewritten per row: a timeout keeps what was measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
