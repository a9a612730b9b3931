"""PAPO-G's cost measured inside ``trainer.train()``: real training loops, not a fixed batch.

Variants, at G = 5 and 8 completions per prompt and at 1 and 3 optimizer steps per generation round:

    grpo            TRL's GRPOTrainer
    papo_rollout    PAPOGTrainer, ``masked_branch="rollout"`` (the masked branch once per round, before the shuffle)
    papo_update     PAPOGTrainer, ``masked_branch="update"`` (the masked branch in every loss call)
    grpo_shared     PAPOGTrainer at gamma 0 (no masked branch: GRPO) with ``prefix_sharing=True``
    papo_shared     PAPOGTrainer, ``masked_branch="rollout"``, ``prefix_sharing=True``

Each measurement is one ``trainer.train()`` of ``--steps`` optimizer steps on one shared LoRA model (by default the
"wide" tiny Qwen2-VL, 30.6M parameters; ``--family`` and ``--size`` pick another testbed build), one thread, with TRL's
default gradient checkpointing (recorded per layout), the variants interleaved round by round. Completions are forced
to their full length (``min_new_tokens``), so that the weights a variant leaves behind do not change the next one's
work. Per optimizer step it reports the wall time; the time without the sampling call itself (``model.generate``, timed
around the call) with the masked branch counted wherever it runs; the masked branch's own time
(``PAPOGTrainer.masked_branch.clock``); completions per prefill (``papo/masked_forward_share``); and the peak of
resident memory above the start of a separate, untimed ``train()`` (``memory.rss_peak``; the CUDA allocator's peak on a
GPU).

The FLOP model of the no-sampling step: GRPO costs ``k * G * (P + R)`` per prompt (forward and backward, k = 3),
the masked branch ``P + G * R`` (one prefill of the prompt and image, G completions); its bound on the ratio is
``1 + (P + G*R) / (k * G * (P + R))``, with P and R the mean prompt (image included) and completion tokens. With
prefix sharing every forward costs ``P + G * R`` per prompt instead of ``G * (P + R)``: GRPO's ratio is
``rho = (P + G*R) / (G * (P + R))`` and PAPO-G's ``rho * (1 + 1/k')``, k' = k plus the old-log-prob forward TRL adds
at several steps per round (``flop_ratio``).

    python -m papo_nb.bench.in_loop --quick --out FILE.json --markdown FILE.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trl

from papo_nb.bench.in_loop_measure import LAYOUTS, VARIANTS, measure_layout

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # the families prefix sharing runs on (docs/families.md)
WIDE_FAMILIES = ("qwen2_vl", "qwen2_5_vl")  # testbed/models.py's two sizes; the others have the tiny build only

TARGET_RATIO = 1.10  # PAPO-G (rollout) / GRPO without sampling, G = 5, 3 steps per round
SHARED_TARGET_RATIO = 0.60  # PAPO-G with prefix sharing / TRL's GRPO without sampling, G = 5
FLOP_SLACK = 0.05


def markdown(results: dict[str, Any]) -> str:
    c = "_cpu" if results["clock"] == "cpu" else ""
    checkpointing = sorted({"on" if layout["gradient_checkpointing"] else "off" for layout in results["layouts"]})
    lines = [
        f"In-loop benchmark (TRL {results['trl']}, {results['size']} {results['family']}, gradient checkpointing "
        f"{'/'.join(checkpointing)}; {results['device']}, {results['threads']} thread(s), load average "
        f"{results['load_before']} before, {results['load_after']} after; {results['repeats']} interleaved "
        f"rounds after {results['warmup']} warm-up, {results['prompts']} prompts per step, {results['steps']} "
        f"optimizer steps per train(); times are {results['clock']} seconds per optimizer step)",
        "",
        "| layout | P | R | variant | total s/step | no-sampling s/step | masked s/step | completions/prefill |"
        f" peak MiB ({'allocator' if results['device'] == 'cuda' else 'RSS'}) | ratio total |"
        " ratio no-sampling [min, max] | FLOP bound + 0.05 | FLOP model (tokens) |"
        " FLOP model (attention) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout in results["layouts"]:
        for name in (n for n in VARIANTS if n in layout):
            v = layout[name]
            ratio_total = ratio_ns = ""
            if name != "grpo":
                t, n = layout[f"{name}/grpo_total{c}_s"], layout[f"{name}/grpo_no_sampling{c}_s"]
                ratio_total = f"{t['median']:.3f}"
                ratio_ns = f"{n['median']:.3f} [{n['min']:.3f}, {n['max']:.3f}]"
            share = "" if v["share"] is None else f"{v['share']:.2f}"
            peak = "" if v["peak_mib"] is None else f"{v['peak_mib']:.0f}"
            lines.append(
                f"| {layout['layout']} | {layout['P']:.0f} | {layout['R']:.0f} | {name} | {v[f'total{c}_s']:.3f} | "
                f"{v[f'no_sampling{c}_s']:.3f} | {v[f'masked{c}_s']:.3f} | {share} | {peak} | {ratio_total} | "
                f"{ratio_ns} | "
                f"{layout['flop_bound'] + FLOP_SLACK:.3f} | {v['flop_ratio_tokens']:.3f} | {v['flop_ratio']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def verdicts(results: dict[str, Any]) -> list[str]:
    c = "_cpu" if results["clock"] == "cpu" else ""
    lines = []
    for layout in results["layouts"]:
        if "papo_rollout" in layout:
            ratio = layout[f"papo_rollout/grpo_no_sampling{c}_s"]["median"]
            bound = layout["flop_bound"] + FLOP_SLACK
            line = f"{layout['layout']}: rollout/GRPO without sampling {ratio:.3f} (FLOP bound + 0.05: {bound:.3f})"
            if layout["G"] == 5 and layout["steps_per_round"] == 3:
                line += f"; target <= {TARGET_RATIO}: {'met' if ratio <= min(TARGET_RATIO, bound) else 'NOT met'}"
            lines.append(line)
        if "papo_shared" in layout:
            lines.append(shared_verdict(layout, c))
        if f"papo_shared/papo_rollout_no_sampling{c}_s" in layout:
            lines.append(shared_against_plain_verdict(layout, c))
    return lines


def shared_against_plain_verdict(layout: dict[str, Any], c: str) -> str:
    """PAPO-G with prefix sharing against plain PAPO-G. It meets its target when it is never slower, its median
    ratio is within 15% of its FLOP model, and its peak memory is at most plain PAPO-G's."""
    ratio = layout[f"papo_shared/papo_rollout_no_sampling{c}_s"]
    model = layout["papo_shared"]["flop_ratio"] / layout["papo_rollout"]["flop_ratio"]
    peaks = layout["papo_shared"]["peak_mib"], layout["papo_rollout"]["peak_mib"]
    peak = "not measured" if None in peaks else f"{peaks[0]:.0f} vs {peaks[1]:.0f} MiB"
    met = ratio["max"] <= 1.0 and ratio["median"] <= 1.15 * model and (None in peaks or peaks[0] <= peaks[1])
    return (
        f"{layout['layout']} P {layout['P']:.0f} R {layout['R']:.0f}: PAPO-G shared/plain PAPO-G without sampling "
        f"{ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}] (FLOP model with attention {model:.3f}), "
        f"peak {peak}; never slower, within 15% of the model, peak <= plain: "
        f"{'met' if met else 'NOT met'}"
    )


def shared_verdict(layout: dict[str, Any], c: str) -> str:
    """PAPO-G with prefix sharing against TRL's GRPO: the no-sampling ratio with its spread and FLOP model, and
    (G = 5) the issue-34 targets: ratio <= 0.60, peak memory at most GRPO's."""
    ratio = layout[f"papo_shared/grpo_no_sampling{c}_s"]
    line = (
        f"{layout['layout']}: PAPO-G shared/GRPO without sampling {ratio['median']:.3f} [{ratio['min']:.3f}, "
        f"{ratio['max']:.3f}] (FLOP model {layout['papo_shared']['flop_ratio']:.3f})"
    )
    peaks = layout["papo_shared"]["peak_mib"], layout["grpo"]["peak_mib"]
    if None not in peaks:
        line += f", peak {peaks[0]:.0f} vs {peaks[1]:.0f} MiB"
    if layout["G"] == 5:
        met = ratio["median"] <= SHARED_TARGET_RATIO and (None in peaks or peaks[0] <= peaks[1])
        line += f"; target <= {SHARED_TARGET_RATIO} and peak <= GRPO's: {'met' if met else 'NOT met'}"
    return line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: the layouts and variants chosen (grpo, the baseline, always among them), the
    clock, and ``--quick``'s short settings applied."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 prompt per step, 2 timed rounds after 1 short warm-up (~10-25 min)"
    )
    parser.add_argument("--clock", choices=("cpu", "wall"), default=None, help="default: cpu on the CPU, wall on cuda")
    parser.add_argument("--layouts", default=",".join(layout.name for layout in LAYOUTS))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="grpo and any of the others, comma-separated")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (on cuda)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per train() call")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--image-px", type=int, default=224, help="image side: (px/28)^2 image tokens")
    parser.add_argument("--completion", type=int, default=16, help="completion tokens")
    parser.add_argument("--family", default="qwen2_vl", choices=FAMILIES, help="the testbed's tiny build")
    parser.add_argument("--size", default="wide", choices=("tiny", "wide"), help="wide: Qwen2-VL and Qwen2.5-VL only")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--memory-repeats", type=int, default=1, help="peak measurements per variant (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.prompts = 2, 1, 1
    if args.size == "wide" and args.family not in WIDE_FAMILIES:
        parser.error(f"--size=wide --family={args.family}: the wide build exists for {', '.join(WIDE_FAMILIES)}")
    args.clock = args.clock or ("wall" if args.device == "cuda" else "cpu")
    known = {layout.name: layout for layout in LAYOUTS}
    chosen = [known[name] for name in args.layouts.split(",") if name in known]
    unknown = [name for name in args.layouts.split(",") if name not in known]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; allowed: {', '.join(known)}")
    asked = args.variants.split(",")
    if [n for n in asked if n not in VARIANTS] or "grpo" not in asked or len(set(asked)) < 2:
        parser.error(f"--variants={args.variants!r}: 'grpo' and at least one other of {', '.join(VARIANTS)}")
    args.variants = tuple(name for name in VARIANTS if name in asked)
    args.layouts = chosen
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, Any] = dict(
        trl=trl.__version__,
        family=args.family,
        size=args.size,
        completion=args.completion,
        image_px=args.image_px,
        clock=args.clock,
        device=args.device,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        warmup=args.warmup,
        memory_repeats=args.memory_repeats if args.memory else 0,
        prompts=args.prompts,
        steps=args.steps,
        load_before=[round(x, 2) for x in os.getloadavg()],
        layouts=[],
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="papo_in_loop_") as work:
        for layout in args.layouts:
            results["layouts"].append(measure_layout(layout, args, Path(work) / layout.name))
            if args.out:  # after every layout: a run cut short keeps what it measured
                args.out.write_text(json.dumps(results, indent=2))
            print(f"{layout.name} done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = time.perf_counter() - started
    table = markdown(results)
    print(table)
    print("\n".join(verdicts(results)))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text(table + "\n" + "\n".join(verdicts(results)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
