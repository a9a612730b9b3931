"""Paper-like shapes: GRPO, PAPO-G with the full masked forward, PAPO-G with the shared prompt prefix, and
the masked branch alone in both forms, side by side in one run.

The paper's setting has hundreds to thousands of image and prompt tokens per prompt and G = 5 to 8 rollouts; here the
prompt (image tokens + text) is at least 4x the completion and G = 8. Each shape is a fixed ``_compute_loss`` batch
(``harness.synthetic_batch``: real shapes-task prompts and images through the processor, random completions), one
model with LoRA, and these variants, interleaved round by round (``timing.time_interleaved``):

    grpo_step           a GRPOTrainer optimizer step (loss + backward + clip + AdamW)
    papo_full_step      the same with PAPOGTrainer, ``masked_forward="full"`` (one full forward per completion)
    papo_shared_step    the same with ``masked_forward="shared_prefix"`` (one prefill per prompt)
    masked_full         ``PAPOGTrainer.masked_forward`` alone, full form (masking + forward)
    masked_shared       the same, shared-prefix form (masking + grouping + prefill + completions)

Peak memory of each: torch's CPU allocation peak (profiler) or ``torch.cuda.max_memory_allocated`` above the start.
``python -m papo_nb.bench.paper_shapes --out FILE.json --markdown FILE.md`` runs the CPU shapes on the ``wide``
tiny-family model with 1 thread; ``benchmarks/gpu_check.py`` runs the same variants on its GPU model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from papo_nb.bench import harness, timing

VARIANTS = ("grpo_step", "papo_full_step", "papo_shared_step", "masked_full", "masked_shared")
LABELS = {
    "grpo_step": "GRPO step",
    "papo_full_step": "PAPO-G step, full masked forward",
    "papo_shared_step": "PAPO-G step, shared prefix",
    "masked_full": "masked branch alone, full",
    "masked_shared": "masked branch alone, shared prefix",
}


@dataclass(frozen=True)
class Shape:
    image_px: int  # square image side: (px/14)^2 patches, a quarter of them image tokens
    completion_tokens: int
    n_prompts: int
    group_size: int = 8


# CPU shapes for the 30.6M-parameter "wide" model; prompt tokens (image + text) / completion tokens in the name.
SHAPES = {
    "img224_c16": Shape(224, 16, 2),  # 87 prompt tokens (64 image), 16 completion: 5.4x
    "img448_c64": Shape(448, 64, 2),  # 279 prompt tokens (256 image), 64 completion: 4.4x
}


def shape_trainers(setup: harness.BenchSetup, **overrides) -> dict[str, Any]:
    """GRPO and PAPO-G in both masked-forward forms on ``setup``'s model; ``overrides`` are config fields."""
    from trl import GRPOTrainer

    return {
        "grpo": setup.trainer("grpo", GRPOTrainer, **overrides),
        "papo_full": setup.trainer("papo_full", masked_forward="full", masked_branch="update", **overrides),
        "papo_shared": setup.trainer(
            "papo_shared", masked_forward="shared_prefix", masked_branch="update", **overrides
        ),
    }


def cpu_setup(
    shape: Shape, *, family: str, seed: int, cache_dir, work_dir: Path, size: str = "wide"
) -> harness.BenchSetup:
    """The tiny-family model of ``size`` with LoRA, its processor taking images up to ``shape.image_px``, the
    trainers and the batch."""
    started = time.perf_counter()
    sequences = shape.n_prompts * shape.group_size
    settings = harness.bench_params(
        seed,
        shape.n_prompts,
        model_name_or_path=f"tiny:{family}",
        num_generations=shape.group_size,
        per_device_train_batch_size=sequences,
        max_completion_length=shape.completion_tokens,
    )
    setup = harness.tiny_setup(
        settings,
        size,
        seed=seed,
        cache_dir=cache_dir,
        work_dir=work_dir,
        n_dataset=max(8, shape.n_prompts),
        started=started,
    )
    setup.processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": shape.image_px**2}
    setup.trainers = shape_trainers(setup)
    batch = harness.synthetic_batch(
        setup.processor,
        sequences,
        shape.completion_tokens,
        vocab_size=setup.model.get_output_embeddings().weight.shape[0],
        image_size=shape.image_px,
        group_size=shape.group_size,
        seed=seed,
    )
    return setup.ready(batch)


def make_variants(setup: harness.BenchSetup, context=contextlib.nullcontext) -> dict[str, harness.Variant]:
    s = setup

    def wrapped(fn):
        def run():
            with context():
                return fn()

        return run

    def step(name):
        trainer = s.trainers[name]
        return wrapped(lambda: harness.optimizer_step(trainer, s.model, s.batch, s.params, s.optimizer))

    def masked(name):
        return wrapped(lambda: s.trainers[name].masked_forward(s.model, s.batch))

    return {
        "grpo_step": harness.Variant(step("grpo"), s.reset),
        "papo_full_step": harness.Variant(step("papo_full"), s.reset),
        "papo_shared_step": harness.Variant(step("papo_shared"), s.reset),
        "masked_full": harness.Variant(masked("papo_full"), s.reset),
        "masked_shared": harness.Variant(masked("papo_shared"), s.reset),
    }


def peak_memory(setup: harness.BenchSetup, variants: dict[str, harness.Variant], device) -> dict[str, float]:
    """MiB above the level at the start of each variant: CUDA's allocator peak, or torch's CPU allocation peak."""
    from papo_nb.bench.memory import allocation_peak, cuda_peak

    out = {}
    for name, variant in variants.items():
        variant.prepare()
        peak = cuda_peak if device.type == "cuda" else allocation_peak
        out[name] = peak(variant.run)["peak_bytes"] / 2**20
        variant.cleanup()
    return out


def equivalence(setup: harness.BenchSetup, context=contextlib.nullcontext) -> dict[str, float]:
    """Max |difference| of the masked log-probs and of the loss between the two forms on the timed batch."""
    s = setup
    with torch.no_grad(), context():
        s.reset()
        full = s.trainers["papo_full"].masked_forward(s.model, s.batch)[0].float()
        s.reset()
        shared = s.trainers["papo_shared"].masked_forward(s.model, s.batch)[0].float()
        losses = []
        for name in ("papo_full", "papo_shared"):
            s.reset()
            losses.append(s.trainers[name].compute_loss(s.model, s.batch).float().item())
    mask = s.batch["completion_mask"].bool()
    return dict(
        masked_logp_max_abs_diff=(full - shared)[mask].abs().max().item(),
        loss_abs_diff=abs(losses[0] - losses[1]),
        loss_full=losses[0],
    )


def measure(
    setup: harness.BenchSetup, *, repeats: int, warmup: int, device, context=contextlib.nullcontext, log=print
) -> dict[str, Any]:
    """Timing (interleaved; CPU time and wall), spread, paired ratios to GRPO, peak memory and the equivalence."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = make_variants(setup, context)
    log(f"timing {repeats} interleaved rounds (+{warmup} warm-up) of {', '.join(variants)} ...")
    cpu: dict[str, list[float]] = {}
    wall = timing.time_interleaved(variants, repeats, warmup, sync=sync, cpu_out=cpu)
    clock = "wall" if device.type == "cuda" else "cpu"  # CPU time of a 1-thread process; a GPU step is wall time
    samples = wall if clock == "wall" else cpu
    grpo = samples["grpo_step"]
    result: dict[str, Any] = dict(
        clock=clock,
        repeats=repeats,
        samples_s=samples,
        wall_samples_s=wall,
        timings={name: timing.summarise(values) for name, values in samples.items()},
        wall_timings={name: timing.summarise(values) for name, values in wall.items()},
        # paired: each round's variants ran back to back, so a slow spell of the shared machine lands on all
        paired_over_grpo={
            name: statistics.median(v / g for v, g in zip(values, grpo)) for name, values in samples.items()
        },
    )
    med = {name: t["median"] for name, t in result["timings"].items()}
    result["breakdown_s"] = dict(
        grpo_step=med["grpo_step"],
        masked_full=med["masked_full"],
        masked_shared=med["masked_shared"],
        full_step_minus_grpo=med["papo_full_step"] - med["grpo_step"],
        shared_step_minus_grpo=med["papo_shared_step"] - med["grpo_step"],
        shared_step_rest=med["papo_shared_step"] - med["grpo_step"] - med["masked_shared"],
    )
    log("peak memory of each variant ...")
    result["peak_mib"] = peak_memory(setup, variants, device)
    result["equivalence"] = equivalence(setup, context)
    return result


def shape_facts(setup: harness.BenchSetup) -> dict[str, Any]:
    batch = setup.batch
    prompt = int(batch["prompt_mask"][0].sum())
    image_tokens = int(batch["image_grid_thw"][0].prod()) // 4
    return dict(
        sequences=int(batch["completion_ids"].shape[0]),
        group_size=setup.trainers["papo_shared"].num_generations,
        prompt_tokens=prompt,
        image_tokens=image_tokens,
        completion_tokens=int(batch["completion_ids"].shape[1]),
        prompt_over_completion=prompt / batch["completion_ids"].shape[1],
        params=setup.n_params,
    )


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| shape | variant | median ms | p25-p75 | min-max | / GRPO (paired median) | peak MiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        f = r["shape"]
        label = (
            f"{name}: {f['sequences']} seq (G = {f['group_size']}), {f['prompt_tokens']} prompt tokens "
            f"({f['image_tokens']} image) / {f['completion_tokens']} completion = {f['prompt_over_completion']:.1f}x"
        )
        for variant in VARIANTS:
            t = r["timings"][variant]
            lines.append(
                f"| {label} | {LABELS[variant]} | {t['median'] * 1e3:.0f} | {t['p25'] * 1e3:.0f}-{t['p75'] * 1e3:.0f} "
                f"| {t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f} | {r['paired_over_grpo'][variant]:.3f} "
                f"| {r['peak_mib'][variant]:.1f} |"
            )
            label = ""
    return "\n".join(lines)


def summary_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, r in results.items():
        p, b, e = r["paired_over_grpo"], r["breakdown_s"], r["equivalence"]
        out.append(
            f"{name}: PAPO-G/GRPO full {p['papo_full_step']:.3f}, shared {p['papo_shared_step']:.3f} (target <= 1.25: "
            f"{'met' if p['papo_shared_step'] <= 1.25 else 'NOT met'}); masked branch shared/full "
            f"{b['masked_shared'] / b['masked_full']:.3f}; "
            f"shared step - GRPO = {b['shared_step_minus_grpo'] * 1e3:.0f} ms "
            f"of which masked branch {b['masked_shared'] * 1e3:.0f} ms, rest {b['shared_step_rest'] * 1e3:.0f} ms; "
            f"peak MiB shared {r['peak_mib']['papo_shared_step']:.1f} vs full {r['peak_mib']['papo_full_step']:.1f}; "
            f"masked log-prob max diff {e['masked_logp_max_abs_diff']:.2e}, loss diff {e['loss_abs_diff']:.2e}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paper_shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--family", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        raise SystemExit(f"--shapes: unknown {unknown}; allowed: {list(SHAPES)}")
    torch.set_num_threads(args.threads)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    results: dict[str, dict[str, Any]] = {}
    device = torch.device("cpu")
    for name in names:
        with tempfile.TemporaryDirectory(prefix="papo_paper_shapes_") as work:
            log(f"[{name}] building ...")
            setup = cpu_setup(
                SHAPES[name], family=args.family, seed=args.seed, cache_dir=args.cache_dir, work_dir=Path(work)
            )
            result = measure(setup, repeats=args.repeats, warmup=args.warmup, device=device, log=log)
            result["shape"] = shape_facts(setup)
            results[name] = result
    from papo_nb.bench.report import environment

    report = dict(command=" ".join(sys.argv), environment=environment(), threads=args.threads, shapes=results)
    table = markdown(results)
    print(table)
    for line in summary_lines(results):
        print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table + "\n\n" + "\n".join(summary_lines(results)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
