"""PAPO-G's cost measured inside ``trainer.train()`` (issue 22): real training loops, not a fixed batch.

Variants, at G = 5 and 8 completions per prompt and at 1 and 3 optimizer steps per generation round:

    grpo            TRL's GRPOTrainer
    papo_rollout    PAPOGTrainer, ``masked_branch="rollout"`` (the masked branch once per round, before the shuffle)
    papo_update     PAPOGTrainer, ``masked_branch="update"`` (the masked branch in every loss call)
    grpo_shared     PAPOGTrainer at gamma 0 (no masked branch: GRPO) with ``prefix_sharing=True`` (issue 34)
    papo_shared     PAPOGTrainer, ``masked_branch="rollout"``, ``prefix_sharing=True``

Each measurement is one ``trainer.train()`` of ``--steps`` optimizer steps on one shared LoRA model (the "wide"
tiny Qwen2-VL, 30.6M parameters), one thread, the variants interleaved round by round. Completions are forced to
their full length (``min_new_tokens``), so that the weights a variant leaves behind do not change the next one's
work. Per optimizer step it reports the wall time; the time without the sampling call itself (``model.generate``,
timed around the call) with the masked branch counted wherever it runs; the masked branch's own time
(``PAPOGTrainer.masked_branch.clock``); completions per prefill (``papo/masked_forward_share``); and the peak of
torch's CPU allocations (profiler; ``torch.cuda.max_memory_allocated`` on a GPU) in a separate, untimed run.

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
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from papo_nb.bench import harness
from papo_nb.papo.forward import attention_cost
from papo_nb.papo.forward.common import core_model
from papo_nb.papo.forward.grouped_attention import text_config

VARIANTS = ("grpo", "papo_rollout", "papo_update", "grpo_shared", "papo_shared")
FLOP_K = 3.0  # a training step's forward + backward, in forwards
TARGET_RATIO = 1.10  # PAPO-G (rollout) / GRPO without sampling, G = 5, 3 steps per round
SHARED_TARGET_RATIO = 0.60  # PAPO-G with prefix sharing / TRL's GRPO without sampling, G = 5 (issue 34)
FLOP_SLACK = 0.05


@dataclass(frozen=True)
class Layout:
    group_size: int
    steps_per_round: int

    @property
    def name(self) -> str:
        return f"G{self.group_size}_k{self.steps_per_round}"


LAYOUTS = tuple(Layout(g, k) for g in (5, 8) for k in (1, 3))


class GenerateClock:
    """Wall and process CPU seconds spent inside ``model.generate`` (an instance attribute wrapping the method)."""

    def __init__(self, model):
        self.seconds = self.cpu_seconds = 0.0
        inner = model.generate

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - wall
                self.cpu_seconds += time.process_time() - cpu

        model.generate = timed


def build(
    layout: Layout,
    *,
    n_prompts: int,
    steps: int,
    image_px: int,
    completion: int,
    seed: int,
    work: Path,
    cache_dir,
    device: str,
    variants: tuple[str, ...] = VARIANTS,
    bf16: bool = False,
):
    """The shared LoRA model, its processor and one trainer per variant of ``variants`` for ``layout``."""
    from trl import GRPOTrainer

    from papo_nb.papo import PAPOGTrainer

    rows = n_prompts * layout.group_size
    settings = harness.bench_params(
        seed,
        n_prompts,
        num_generations=layout.group_size,
        per_device_train_batch_size=rows,
        max_completion_length=completion,
        max_steps=steps,
        learning_rate=1e-5,
    )
    setup = harness.tiny_setup(
        settings,
        "wide",
        seed=seed,
        cache_dir=cache_dir,
        work_dir=work,
        n_dataset=max(16, n_prompts * steps * layout.steps_per_round),
        started=time.perf_counter(),
    )
    model, processor = setup.model, setup.processor
    # the shapes images are 56 px: resized to image_px, so the prompt is mostly image tokens, as in the paper
    processor.image_processor.size = {"shortest_edge": image_px**2, "longest_edge": image_px**2}
    model.to(device)
    common = dict(
        steps_per_generation=layout.steps_per_round,
        logging_steps=1,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=bf16,
    )
    gamma_zero = dict(perception_loss_weight=0.0, original_entropy_weight=0.0, masked_entropy_weight=0.0)
    overrides = {
        "grpo": (GRPOTrainer, {}),
        "papo_rollout": (PAPOGTrainer, dict(masked_branch="rollout")),
        "papo_update": (PAPOGTrainer, dict(masked_branch="update")),
        "grpo_shared": (PAPOGTrainer, dict(prefix_sharing=True, **gamma_zero)),
        "papo_shared": (PAPOGTrainer, dict(masked_branch="rollout", prefix_sharing=True)),
    }
    trainers = {name: setup.trainer(name, overrides[name][0], **overrides[name][1], **common) for name in variants}
    for trainer in trainers.values():  # full-length completions: the same work whatever the weights
        trainer.generation_kwargs["min_new_tokens"] = completion
        trainer.generation_config.min_new_tokens = completion
    return model, processor, trainers, setup.n_params


def one_run(trainer, clock: GenerateClock, device: str, steps: int) -> dict[str, Any]:
    """One ``train()`` of ``steps`` optimizer steps; per-step numbers from its wall and process CPU time, the
    generate clock and the trainer's masked-branch clock (``*_cpu_s``: CPU seconds, robust to a shared machine)."""
    from papo_nb.papo.forward import prefill as shared_prefix

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    branch = getattr(getattr(trainer, "masked_branch", None), "clock", None)
    before = (
        clock.seconds,
        clock.cpu_seconds,
        branch.seconds if branch else 0.0,
        branch.cpu_seconds if branch else 0.0,
    )
    trainer.args.max_steps = steps
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    sync()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = trainer.state.global_step
    shares = [
        row[shared_prefix.SHARE_METRIC] for row in trainer.state.log_history if shared_prefix.SHARE_METRIC in row
    ]
    generate, generate_cpu = clock.seconds - before[0], clock.cpu_seconds - before[1]
    masked = (branch.seconds - before[2]) if branch else 0.0
    masked_cpu = (branch.cpu_seconds - before[3]) if branch else 0.0
    return dict(
        total_s=wall / n,
        no_sampling_s=(wall - generate) / n,
        masked_s=masked / n,
        generate_s=generate / n,
        total_cpu_s=cpu / n,
        no_sampling_cpu_s=(cpu - generate_cpu) / n,
        masked_cpu_s=masked_cpu / n,
        share=statistics.fmean(shares) if shares else None,
        steps=n,
    )


def token_shape(trainer, dataset, n_prompts: int) -> dict[str, float]:
    """Mean prompt (image tokens included) and completion tokens of one generated round of ``n_prompts`` (a whole
    round: TRL's chunked log-prob pass indexes past a batch smaller than its chunk)."""
    from papo_nb.workbook.rollouts import rollout_batch

    batch = rollout_batch(trainer, dataset, n_prompts, seed=0)
    return dict(
        P=float(batch["prompt_mask"].sum(1).float().mean()), R=float(batch["completion_mask"].sum(1).float().mean())
    )


def flop_bound(P: float, R: float, G: int, k: float = FLOP_K) -> float:
    return 1.0 + (P + G * R) / (k * G * (P + R))


def flop_ratio(variant: str, P: float, R: float, G: int, steps_per_round: int, widths=None) -> float:
    """The FLOP model's ratio of ``variant`` to TRL's GRPO step without sampling: forward 1, backward 2, plus the
    old-log-prob forward at several steps per round (one device batch per step: TRL computes it then); the masked
    branch one shared forward; prefix sharing one grouped forward per prompt in every forward, not G plain rows.
    A shared forward costs ``rho`` plain ones: ``(P + G*R) / (G * (P + R))`` counting tokens, or with ``widths``
    (``attention_cost.TextWidths``) the text model's FLOPs, attention pairs included (``attention_cost.per_group``)."""
    forwards = FLOP_K + (1.0 if steps_per_round > 1 else 0.0)
    if widths is None:
        rho = (P + G * R) / (G * (P + R))
    else:
        cost = attention_cost.per_group(widths, round(P), round(R), G)
        rho = cost["grouped"] / cost["plain"]
    return {
        "grpo": 1.0,
        "papo_rollout": 1.0 + rho / forwards,
        "papo_update": 1.0 + rho / forwards,
        "grpo_shared": rho,
        "papo_shared": rho * (1.0 + 1.0 / forwards),
    }[variant]


def peak_mib(trainer, device: str, steps: int) -> float:
    """Peak allocation above the start of a ``train()`` of ``steps`` steps (one round: the rollout pass included)."""
    from papo_nb.bench.memory import allocation_peak, cuda_peak

    trainer.args.max_steps = steps
    peak = cuda_peak if device == "cuda" else allocation_peak
    return peak(trainer.train)["peak_bytes"] / 2**20


def interleaved_runs(trainers: dict, clock: GenerateClock, layout: Layout, args) -> dict[str, list[dict[str, Any]]]:
    """``args.repeats`` rounds of one ``train()`` per variant, the order rotated each round, after ``args.warmup``
    short untimed rounds (first-call costs off the clock)."""
    names = tuple(trainers)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(args.warmup):
        for name in names:
            one_run(trainers[name], clock, args.device, layout.steps_per_round)
    for round_index in range(args.repeats):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            runs[name].append(one_run(trainers[name], clock, args.device, args.steps))
    return runs


MEDIAN_KEYS = (
    "total_s",
    "no_sampling_s",
    "masked_s",
    "generate_s",
    "total_cpu_s",
    "no_sampling_cpu_s",
    "masked_cpu_s",
)


def median_run(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each timing over a variant's runs, and the mean masked-branch share where one was measured."""
    row: dict[str, Any] = {key: statistics.median(s[key] for s in samples) for key in MEDIAN_KEYS}
    shares = [s["share"] for s in samples if s["share"] is not None]
    row["share"] = statistics.fmean(shares) if shares else None
    return row


def measure_layout(layout: Layout, args, work: Path) -> dict[str, Any]:
    model, processor, trainers, n_params = build(
        layout,
        n_prompts=args.prompts,
        steps=args.steps,
        image_px=args.image_px,
        completion=args.completion,
        seed=args.seed,
        work=work,
        cache_dir=args.cache_dir,
        device=args.device,
        variants=args.variants,
        bf16=args.bf16,
    )
    clock = GenerateClock(model)
    papo = next(trainers[name] for name in args.variants if name != "grpo")
    shape = token_shape(papo, trainers["grpo"].train_dataset, args.prompts * layout.steps_per_round)
    runs = interleaved_runs(trainers, clock, layout, args)
    steps = layout.steps_per_round
    peaks = {name: peak_mib(trainers[name], args.device, steps) for name in args.variants} if args.memory else {}
    out: dict[str, Any] = dict(
        layout=layout.name,
        G=layout.group_size,
        steps_per_round=layout.steps_per_round,
        rows_per_step=args.prompts * layout.group_size,
        n_params=n_params,
        **shape,
    )
    out["flop_bound"] = flop_bound(shape["P"], shape["R"], layout.group_size)
    widths = attention_cost.TextWidths.of(text_config(core_model(model)))
    for name in args.variants:
        out[name] = median_run(runs[name])
        out[name]["peak_mib"] = peaks.get(name)
        out[name]["flop_ratio"] = flop_ratio(name, shape["P"], shape["R"], layout.group_size, steps, widths)
        out[name]["flop_ratio_tokens"] = flop_ratio(name, shape["P"], shape["R"], layout.group_size, steps)
    stored = args.prompts * layout.group_size * layout.steps_per_round * shape["R"] * 4
    out["stored_branch_kib_per_round"] = stored / 1024  # rows x completion tokens fp32, what the rollout path keeps
    pairs = [(name, "grpo") for name in args.variants if name != "grpo"]
    if {"papo_shared", "papo_rollout"} <= set(args.variants):
        pairs.append(("papo_shared", "papo_rollout"))  # shared against plain PAPO-G, round by round
    for name, base in pairs:
        for key in ("total_s", "no_sampling_s", "total_cpu_s", "no_sampling_cpu_s"):
            per_round = [a[key] / b[key] for a, b in zip(runs[name], runs[base], strict=True)]
            out[f"{name}/{base}_{key}"] = dict(
                median=statistics.median(per_round), min=min(per_round), max=max(per_round)
            )
    return out


def markdown(results: dict[str, Any]) -> str:
    c = "_cpu" if results["clock"] == "cpu" else ""
    lines = [
        f"In-loop benchmark ({results['device']}, {results['threads']} thread(s), load average "
        f"{results['load_before']} before, {results['load_after']} after; {results['repeats']} interleaved "
        f"rounds after {results['warmup']} warm-up, {results['prompts']} prompts per step, {results['steps']} "
        f"optimizer steps per train(); times are {results['clock']} seconds per optimizer step)",
        "",
        "| layout | P | R | variant | total s/step | no-sampling s/step | masked s/step | completions/prefill |"
        " peak MiB | ratio total | ratio no-sampling [min, max] | FLOP bound + 0.05 | FLOP model (tokens) |"
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
    """PAPO-G with prefix sharing against plain PAPO-G (issue 42: never slower, within 15% of its FLOP model; peak
    memory at most plain PAPO-G's)."""
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


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.prompts = 2, 1, 1
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
    torch.set_num_threads(1)
    results: dict[str, Any] = dict(
        clock=args.clock,
        device=args.device,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        warmup=args.warmup,
        prompts=args.prompts,
        steps=args.steps,
        load_before=[round(x, 2) for x in os.getloadavg()],
        layouts=[],
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="papo_in_loop_") as work:
        for layout in chosen:
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
