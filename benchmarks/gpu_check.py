"""GPU arm of the PAPO-G overhead benchmark and of the probe calibration (one H200, bf16; 170 s from gpu_check.sh).

What it does, offline (no hub, no network, installs nothing):
  1. builds (``papo_nb.bench.gpu_model``) a randomly initialised Qwen2.5-VL-shaped model from an explicit
     ``Qwen2_5_VLConfig``: the 3B text config (hidden 2048, MLP 11008, 16 heads / 2 KV heads, vocab 151936, tied
     embeddings) and the 3B vision tower (1280 wide), with ``--text-layers`` / ``--vision-depth`` (defaults 36 / 32:
     full 3B depth), in bf16, with LoRA on q_proj/v_proj (the notebooks' recipe), on the first CUDA device;
  2. makes a fixed ``_compute_loss`` batch without generation (``harness.synthetic_batch``: shapes-task
     prompts with ``--image-size`` px images through a Qwen2.5-VL processor, random completions);
  3. times interleaved rounds of a GRPO step, a PAPO-G step (masked branch no-grad), a PAPO-G step with gradient
     through the masked branch, the extra forward alone (the floor), masking alone and one probe evaluation, under
     bf16 autocast, with ``torch.cuda.synchronize`` around each, and reports medians, spreads, ratios, tokens/s
     and ``torch.cuda.max_memory_allocated`` per step variant (the check that the no-grad masked branch adds no
     full-vocabulary logits to the step's peak);
  4. measures the gamma-zero probe's evidence in real bf16 on ``--probe-batches`` batches: parent gradient norm,
     ||g_zero - g_parent|| and its relative size, tolerance, perception KL and gradient, and the difference an
     injected value-neutral leak produces (the fields of
     ``papo_nb.workbook.verification.calibration.CalibrationPoint``).
It writes ``OUT_DIR/gpu_check.json`` (and prints a summary). The number of timed rounds adapts to
``--time-budget`` (seconds for the whole script, default 420; ``gpu_check.sh`` gives it 170 and runs the paper
shapes, ``--paper-shapes-only`` with ``--prefix-repeats 3``, as a second process) after one measured warm-up round.

Environment (the GPU machine has no network): use a venv that already has this project and its pinned stack
(torch 2.14.1, torchvision 0.29.1, transformers 5.24, trl 1.9.1, peft 0.21.2), or build one from carried wheels:
    python -m venv /tmp/venv && /tmp/venv/bin/pip install --no-index --find-links WHEELS papo_nb[test]
    (WHEELS: a folder filled beforehand, where there is network, by ``pip download -d WHEELS . ``)
then ``PYTHON=/tmp/venv/bin/python benchmarks/gpu_check.sh OUT_DIR`` (or ``WHEELS=WHEELS benchmarks/gpu_check.sh
OUT_DIR``, which builds that venv itself). If papo_nb is not installed, the repository root is put on ``sys.path``.

Check it on a CPU first: ``python benchmarks/gpu_check.py --cpu-dry-run --out-dir /tmp/gpu_dry`` (tiny sizes,
same code path end to end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, if papo_nb is not installed

import torch  # noqa: E402

from papo_nb.bench import harness, timing  # noqa: E402
from papo_nb.bench.gpu_model import build_gpu_setup, build_processor, check_batch  # noqa: E402
from papo_nb.bench.report import environment as bench_environment  # noqa: E402


def log(message: str) -> None:
    print(f"[gpu_check {time.perf_counter() - START:6.1f}s] {message}", flush=True)


def leaking_assembly(trainer, scale: float = 1.0):
    """The trainer's assembly plus a value-neutral leak (0.0 in value, perception gradient in the backward)."""

    def assemble(parent_loss, terms, gamma, eta1, eta2):
        return trainer.assemble_loss(parent_loss, terms, gamma, eta1, eta2) + scale * (
            terms.perception_kl - terms.perception_kl.detach()
        )

    return assemble


def probe_evidence(setup: harness.BenchSetup, args, context, device) -> list[dict]:
    """The probe's numbers in real bf16 on ``--probe-batches`` batches (different seeds), clean and leaking."""
    from papo_nb.papo.probe import GammaZeroProbe, ProbeFailure, measure_gamma_zero

    papo = setup.trainers["papo"]
    points = []
    for b in range(args.probe_batches):
        batch = (
            setup.batch
            if b == 0
            else check_batch(
                setup.processor, args, setup.model.config.text_config.vocab_size, device, seed=args.seed + b
            )
        )
        setup.reset()
        with context():
            parent, terms = papo.papo_loss_parts(setup.model, batch)
            probe = GammaZeroProbe()
            with contextlib.suppress(ProbeFailure):
                probe.observe(papo, setup.model, parent, terms)
            leaky = measure_gamma_zero(papo, setup.model, parent, terms, assemble=leaking_assembly(papo))
        evidence = probe.evidence.to_dict()
        points.append(
            dict(
                phase="fresh",
                precision="bf16" if args.dtype == "bfloat16" else args.dtype,
                batch=b,
                status=evidence["status"],
                parent_grad_norm=evidence["parent_grad_norm"],
                grad_diff_norm=evidence["grad_diff_norm"],
                grad_diff_relative=evidence["grad_diff_relative"],
                tolerance=evidence["tolerance"],
                perception_grad_norm=evidence["perception_grad_norm"],
                injected_leak_diff=leaky["grad_diff_norm"],
                perception_kl=evidence["perception_kl"],
                loss_bit_equal=evidence["loss_bit_equal"],
                leak_detection_power=evidence["leak_detection_power"],
                dtype=evidence["dtype"],
                autocast_enabled=evidence["autocast_enabled"],
                autocast_dtype=evidence["autocast_dtype"],
                message=evidence["message"],
            )
        )
        del parent, terms
        log(
            f"probe batch {b}: {evidence['status']}, parent |g| {evidence['parent_grad_norm']:.3e}, "
            f"|g0-g| {evidence['grad_diff_norm']:.3e} (rel {evidence['grad_diff_relative']:.2e}), "
            f"leak {leaky['grad_diff_norm']:.3e}, tolerance {evidence['tolerance']:.3e}"
        )
    return points


def peak_memory(setup: harness.BenchSetup, context, device) -> dict:
    """``max_memory_allocated`` above the pre-step level, per step variant (CUDA only)."""
    from papo_nb.bench.memory import cuda_peak

    if device.type != "cuda":
        return {"skipped": "not on CUDA"}
    out = {}
    for name, variant in harness.make_variants(setup, harness.STEP_VARIANTS + ("extra_forward",), context).items():
        variant.prepare()
        peak = cuda_peak(variant.run)
        out[name] = dict(peak_above_start_mib=peak["peak_bytes"] / 2**20, peak_total_mib=peak["total_bytes"] / 2**20)
        variant.cleanup()
    batch = setup.batch
    vocab = setup.model.config.text_config.vocab_size
    out["one_logits_tensor_mib"] = batch["completion_ids"].numel() * vocab * 2 / 2**20  # bf16 (B, T, V)
    return out


def paper_shapes_check(setup: harness.BenchSetup, args, context, device) -> dict:
    """Issue 14 on this model: GRPO, PAPO-G with the full masked forward and with the shared prompt prefix, and the
    masked branch alone in both forms, on a G = 8 batch whose prompt (image + text) is >= 4x the completion."""
    import dataclasses

    from papo_nb.bench import paper_shapes

    processor = build_processor(args.prefix_image_size)
    sequences = 8 * args.prefix_prompts
    settings = harness.bench_params(args.seed, lora_r=args.lora_r, lora_alpha=2 * args.lora_r)
    overrides = dict(
        per_device_train_batch_size=sequences,
        num_generations=8,
        max_completion_length=args.prefix_completion_tokens,
        bf16=args.dtype == "bfloat16" and device.type == "cuda",
        use_cpu=device.type == "cpu",
    )
    prefix_setup = dataclasses.replace(setup, settings=settings, processor=processor)
    prefix_setup.trainers = paper_shapes.shape_trainers(prefix_setup, **overrides)
    prefix_setup.batch = harness.synthetic_batch(
        processor,
        sequences,
        args.prefix_completion_tokens,
        vocab_size=setup.model.config.text_config.vocab_size,
        image_size=args.prefix_image_size,
        group_size=8,
        seed=args.seed,
        device=device,
    )
    result = paper_shapes.measure(
        prefix_setup, repeats=args.prefix_repeats, warmup=1, device=device, context=context, log=log
    )
    result["shape"] = paper_shapes.shape_facts(prefix_setup)
    result["markdown"] = paper_shapes.markdown({"gpu": result})
    result["summary"] = paper_shapes.summary_lines({"gpu": result})
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=None)
    parser.add_argument("--out-dir", dest="out_dir_opt", type=Path, default=None)
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny sizes on the CPU: checks the script end to end"
    )
    parser.add_argument("--text-layers", type=int, default=None, help="default 36 (3B depth); dry run 2")
    parser.add_argument("--vision-depth", type=int, default=None, help="default 32 (3B depth); dry run 2")
    parser.add_argument("--sequences", type=int, default=None, help="sequences per step (default 16; dry run 8)")
    parser.add_argument("--completion-tokens", type=int, default=None, help="default 256; dry run 16")
    parser.add_argument(
        "--image-size", type=int, default=None, help="square image side in px (default 448; dry run 112)"
    )
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds at most (the time budget may lower it)")
    parser.add_argument("--probe-batches", type=int, default=3)
    parser.add_argument("--time-budget", type=float, default=420.0, help="seconds for the whole script")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--paper-shapes-only",
        action="store_true",
        help="only the issue-14 check (GRPO vs PAPO-G full vs shared prefix, G = 8), into gpu_paper_shapes.json",
    )
    parser.add_argument("--prefix-image-size", type=int, default=None, help="default 896 (1024 image tokens); dry 224")
    parser.add_argument("--prefix-completion-tokens", type=int, default=None, help="default 256; dry run 16")
    parser.add_argument("--prefix-prompts", type=int, default=2, help="prompts of 8 completions each")
    parser.add_argument("--prefix-repeats", type=int, default=5)
    args = parser.parse_args(argv)
    out_dir = args.out_dir_opt or args.out_dir
    if out_dir is None:
        parser.error("give OUT_DIR (positional or --out-dir)")
    tiny = args.cpu_dry_run
    defaults = dict(
        text_layers=(2, 36),
        vision_depth=(2, 32),
        sequences=(8, 16),
        completion_tokens=(16, 256),
        image_size=(112, 448),
        prefix_image_size=(224, 896),
        prefix_completion_tokens=(16, 256),
    )
    for key, (dry, real) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, dry if tiny else real)
    if tiny:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --cpu-dry-run to check the script on a CPU)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = getattr(torch, args.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    context = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if dtype == torch.bfloat16
        else contextlib.nullcontext
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    report: dict = dict(args={k: str(v) for k, v in vars(args).items()}, environment=bench_environment())
    if device.type == "cuda":
        report["environment"]["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="papo_gpu_check_") as work:
        setup = build_gpu_setup(args, device, dtype, Path(work), log)
        if args.paper_shapes_only:
            result = paper_shapes_check(setup, args, context, device)
            result["environment"], result["args"] = report["environment"], report["args"]
            (out_dir / "gpu_paper_shapes.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
            print(result["markdown"] + "\n" + "\n".join(result["summary"]))
            print(f"wrote {out_dir / 'gpu_paper_shapes.json'} in {time.perf_counter() - START:.0f}s")
            return 0
        report["model"] = dict(
            params=setup.n_params,
            trainable_params=setup.n_trainable,
            text_layers=args.text_layers,
            vision_depth=args.vision_depth,
            dtype=args.dtype,
            setup_s=setup.setup_s,
        )
        report["batch"] = harness.batch_shape(setup.batch, setup.model.config.text_config.vocab_size)
        tokens_per_step = int(setup.batch["prompt_mask"].sum() + setup.batch["completion_mask"].sum())
        report["batch"]["tokens_per_step"] = tokens_per_step
        log(f"batch: {report['batch']}")

        variants = harness.make_variants(setup, harness.VARIANTS, context)
        log("warm-up round ...")
        round_start = time.perf_counter()
        timing.time_interleaved(variants, repeats=1, warmup=0, sync=sync)
        round_s = time.perf_counter() - round_start
        reserve = 60.0 + round_s * (2 + args.probe_batches)  # memory pass, probe evidence, writing
        left = args.time_budget - (time.perf_counter() - START) - reserve
        repeats = max(2, min(args.repeats, int(left // round_s)))
        log(f"one round {round_s:.1f}s; timing {repeats} rounds")
        times = timing.time_interleaved(variants, repeats=repeats, warmup=0, sync=sync)
        report["timings"] = {name: timing.summarise(values) for name, values in times.items()}
        report["samples_s"] = times
        report["ratios"] = timing.ratios(times)
        report["tokens_per_s"] = {
            name: tokens_per_step / report["timings"][name]["median"]
            for name in harness.STEP_VARIANTS + ("extra_forward",)
        }
        report["completion_tokens_per_s"] = {
            name: report["batch"]["sequences"]
            * report["batch"]["completion_tokens"]
            / report["timings"][name]["median"]
            for name in harness.STEP_VARIANTS
        }
        log("peak memory per step variant ...")
        report["memory"] = peak_memory(setup, context, device)
        log("probe evidence ...")
        report["probe"] = probe_evidence(setup, args, context, device)
        report["probe_summary"] = dict(
            all_passed=all(p["status"] == "passed" for p in report["probe"]),
            max_roundoff_fraction_of_tolerance=max(p["grad_diff_norm"] / p["tolerance"] for p in report["probe"]),
            min_leak_multiple_of_tolerance=min(
                min(p["perception_grad_norm"], p["injected_leak_diff"]) / p["tolerance"] for p in report["probe"]
            ),
            max_grad_diff_relative=max(p["grad_diff_relative"] for p in report["probe"]),
        )
    report["total_s"] = time.perf_counter() - START
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    r = report["ratios"]
    print(f"\n{'variant':<48} {'median ms':>10} {'p25':>9} {'p75':>9}  tokens/s")
    for name in harness.VARIANTS:
        t = report["timings"][name]
        tps = report["tokens_per_s"].get(name)
        print(
            f"{harness.LABELS[name]:<48} {t['median'] * 1e3:10.1f} {t['p25'] * 1e3:9.1f} {t['p75'] * 1e3:9.1f}  "
            f"{'' if tps is None else f'{tps:,.0f}'}"
        )
    print(
        f"PAPO-G / GRPO {r['papo_over_grpo']:.3f}   floor ratio {r['floor_ratio']:.3f}   "
        f"PAPO-G (grad) / GRPO {r['papo_grad_over_grpo']:.3f}   "
        f"masking {r['masking_fraction_of_step'] * 100:.2f}% of a step   "
        f"probe {r['probe_fraction_of_100_steps'] * 100:.2f}% of 100 steps"
    )
    if "skipped" not in report["memory"]:
        print(
            "peak memory above start (MiB): "
            + ", ".join(
                f"{name} {report['memory'][name]['peak_above_start_mib']:.0f}"
                for name in harness.STEP_VARIANTS + ("extra_forward",)
            )
            + f"; one bf16 logits tensor {report['memory']['one_logits_tensor_mib']:.0f}"
        )
    print(f"probe: {report['probe_summary']}")
    print(f"wrote {out_dir / 'gpu_check.json'} in {report['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
