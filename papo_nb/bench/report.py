"""The benchmark's verdicts and report: targets judged on one clock, markdown tables, the environment."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import torch

from papo_nb.bench.harness import LABELS, VARIANTS
from papo_nb.bench.memory import MALLOC_MODES

# The cost targets (PAPO-G's step against GRPO's, masking's and the probe's share), checked on the wide model.
TARGET_SIZE = "wide"
FLOOR_MARGIN = 0.05  # PAPO-G / GRPO <= floor ratio + 5% of a GRPO step
MASKING_MAX_FRACTION = 0.01  # masking under 1% of a step
PROBE_MAX_FRACTION = 0.03  # probe total <= 3% of a 100-step run


def targets(result: dict[str, Any], clock: str = "cpu") -> dict[str, Any]:
    """The targets above, judged on ``clock`` ("cpu": process CPU time, the default; "wall"). On a shared 2-core
    machine wall time also counts the time other processes hold the core, in bursts that land on one variant and
    not the next; CPU time of a 1-thread process does not (cache and memory-bandwidth sharing still add noise).
    The floor target uses the paired ratios: each round runs GRPO, PAPO-G and the extra forward back to back, so
    what remains of a slow spell lands on all three. Unpaired medians and fastest repeats are reported alongside."""
    r = result["cpu_ratios" if clock == "cpu" else "ratios"]
    checks = {
        "papo_within_floor_plus_5pct": dict(
            value=r["paired_papo_over_grpo"],
            limit=r["paired_floor_ratio"] + FLOOR_MARGIN,
            ok=r["paired_papo_over_grpo"] <= r["paired_floor_ratio"] + FLOOR_MARGIN,
            unpaired_medians=dict(value=r["papo_over_grpo"], limit=r["floor_ratio"] + FLOOR_MARGIN),
            fastest_repeats=dict(value=r["min_papo_over_grpo"], limit=r["min_floor_ratio"] + FLOOR_MARGIN),
        ),
        "masking_under_1pct_of_step": dict(
            value=r["masking_fraction_of_step"],
            limit=MASKING_MAX_FRACTION,
            ok=r["masking_fraction_of_step"] <= MASKING_MAX_FRACTION,
        ),
        "probe_eval_under_3pct_of_100_steps": dict(
            value=r["probe_fraction_of_100_steps"],
            limit=PROBE_MAX_FRACTION,
            ok=r["probe_fraction_of_100_steps"] <= PROBE_MAX_FRACTION,
        ),
    }
    training = result.get("probe_training")
    if training:
        calls = training["probe_off"]["probe_calls"]
        checks["no_probe_code_when_not_required"] = dict(
            value=calls,
            limit=dict.fromkeys(calls, 0),
            ok=not any(calls.values()) and not training["probe_off"]["probe_object"],
        )
        frac = training["probe_on"]["cpu_fraction_of_100_steps" if clock == "cpu" else "fraction_of_100_steps"]
        checks["in_training_probe_under_3pct_of_100_steps"] = dict(
            value=frac,
            limit=PROBE_MAX_FRACTION,
            ok=frac <= PROBE_MAX_FRACTION and training["probe_on"]["evaluations"] >= 1,
        )
    for check in checks.values():
        check["clock"] = clock
    return checks


def markdown_tables(report: dict[str, Any]) -> str:
    """The report's tables: timings, ratios and verdict figures, work (when measured) and memory (when measured)."""
    sizes = report["sizes"]
    tables = [timing_table(sizes), ratio_table(sizes)]
    work_rows = [(size, result["work"]) for size, result in sizes.items() if "work" in result]
    if work_rows:
        tables.append(work_table(work_rows))
    memory_rows = [(size, result) for size, result in sizes.items() if "memory" in result]
    if memory_rows:
        tables.append(memory_table(memory_rows))
    return "\n\n".join("\n".join(lines) for lines in tables)


def timing_table(sizes: dict[str, Any]) -> list[str]:
    lines = [
        "| model | variant | CPU median ms | min | p25 | p75 | max | wall median ms | wall p25-p75 | n |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, result in sizes.items():
        name = f"{size} ({result['params'] / 1e6:.2f}M)"
        for variant in VARIANTS:
            t, w = result["cpu_timings"][variant], result["timings"][variant]
            lines.append(
                f"| {name} | {LABELS[variant]} | {t['median'] * 1e3:.1f} | {t['min'] * 1e3:.1f} | "
                f"{t['p25'] * 1e3:.1f} | {t['p75'] * 1e3:.1f} | {t['max'] * 1e3:.1f} | {w['median'] * 1e3:.1f} | "
                f"{w['p25'] * 1e3:.1f}-{w['p75'] * 1e3:.1f} | {t['n']} |"
            )
    return lines


def ratio_table(sizes: dict[str, Any]) -> list[str]:
    """One row per size and clock: the ratios the targets judge, and the in-training probe's figures."""
    lines = [
        "| model | clock | PAPO-G / GRPO | floor ratio | PAPO-G - floor | paired PAPO-G / GRPO | paired floor | "
        "fastest PAPO-G / GRPO | fastest floor | PAPO-G (grad) / GRPO | overhead / floor | masking % of step | "
        "probe eval / step | probe % of 100 steps | in-training probe % of 100 steps | probe calls when off |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (size, result), clock in [(item, clock) for item in sizes.items() for clock in ("cpu", "wall")]:
        r = result["cpu_ratios" if clock == "cpu" else "ratios"]
        training = result.get("probe_training")
        fraction_key = "cpu_fraction_of_100_steps" if clock == "cpu" else "fraction_of_100_steps"
        in_train = (
            f"{training['probe_on'][fraction_key] * 100:.2f}% ({training['probe_on']['evaluations']} eval)"
            if training
            else "n/a"
        )
        off_calls = json.dumps(training["probe_off"]["probe_calls"]) if training else "n/a"
        lines.append(
            f"| {size} | {clock} | {r['papo_over_grpo']:.3f} | {r['floor_ratio']:.3f} | "
            f"{r['papo_over_grpo_minus_floor']:+.3f} | "
            f"{r['paired_papo_over_grpo']:.3f} | {r['paired_floor_ratio']:.3f} | {r['min_papo_over_grpo']:.3f} | "
            f"{r['min_floor_ratio']:.3f} | {r['papo_grad_over_grpo']:.3f} | "
            f"{r['overhead_over_floor']:.3f} | {r['masking_fraction_of_step'] * 100:.2f}% | "
            f"{r['probe_eval_over_step']:.2f} | "
            f"{r['probe_fraction_of_100_steps'] * 100:.2f}% | {in_train} | {off_calls} |"
        )
    return lines


WORK_HEADER = (
    "| model | GRPO step GFLOP | PAPO-G step GFLOP | extra forward GFLOP | PAPO-G - GRPO - forward GFLOP | "
    "PAPO-G (grad) - GRPO - forward GFLOP | PAPO-G - GRPO - forward aten ops |"
)


def work_table(work_rows: list[tuple[str, dict]]) -> list[str]:
    """Exact work per step (profiler FLOPs and aten op counts), free of timing noise."""
    return [WORK_HEADER, "|---|---:|---:|---:|---:|---:|---:|"] + [
        f"| {size} | {w['grpo_step']['gflop']:.2f} | {w['papo_step']['gflop']:.2f} | "
        f"{w['extra_forward']['gflop']:.2f} | {w['papo_extra_gflop']:+.3f} | "
        f"{w['papo_grad_extra_gflop_over_floor']:+.3f} | {w['papo_extra_aten_ops']:+d} |"
        for size, w in work_rows
    ]


def memory_table(memory_rows: list[tuple[str, dict]]) -> list[str]:
    lines = [
        "| model | variant | torch alloc peak MiB | lm_head logits alive at once | "
        "full-vocab bytes at peak (x one logits tensor) | whole-batch full-vocab tensors at once | "
        "peak RSS increase MiB (glibc default) | peak RSS increase MiB (mmap threshold 128 KiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size, result in memory_rows:
        for variant in [v for v in result["memory"] if isinstance(result["memory"][v], dict)]:
            m = result["memory"][variant]
            rss = result.get("rss", {}).get(variant, {})
            rss_text = " | ".join(
                f"{rss[mode]['step_rss_increase_mib']:.1f}" if "step_rss_increase_mib" in rss.get(mode, {}) else "n/a"
                for mode in MALLOC_MODES
            )
            lines.append(
                f"| {size} | {LABELS[variant]} | {m['alloc_peak_mib']:.2f} | {m['lm_head_logits_alive_peak']} | "
                f"{m['vocab_bytes_peak_logits_equiv']:.2f} | {m['full_logits_alive_peak']} | {rss_text} |"
            )
    return lines


def environment() -> dict[str, Any]:
    import transformers
    import trl

    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        trl=trl.__version__,
        threads=torch.get_num_threads(),
        machine=platform.machine(),
        processor=platform.processor(),
        cpu_count=os.cpu_count(),
    )


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """One PASS/MISS line per target on the target size, the exact work line, and the quick mode's caveat."""
    size = report["target_size"]
    lines = [
        f"{'PASS' if check['ok'] else 'MISS'}  {size}: {name}: {check['value']} "
        f"(limit {check['limit']}; {check['clock']} time)"
        for name, check in report["targets"].items()
    ]
    work = report["sizes"][size].get("work", {})
    if "papo_extra_gflop" in work:
        gflop = work["papo_extra_gflop"]
        # 0: the masked branch is one full forward; below 0: the shared prompt prefix (one prefill per prompt)
        meaning = (
            "PAPO-G's only extra matmul work is one full masked forward"
            if abs(gflop) < 1e-3
            else "PAPO-G's masked branch does less matmul work than one full forward (shared prompt prefix)"
            if gflop < 0
            else "PAPO-G does more matmul work than one extra forward"
        )
        lines.append(
            f"work ({size}): PAPO-G - GRPO - extra forward = {gflop:+.3f} GFLOP (exact, noise-free: {meaning})"
        )
    if report["mode"] == "quick":
        rounds = report["sizes"][size]["repeats"]
        lines.append(
            f"note: quick mode times {rounds} rounds on the {size} model; one step varies by about "
            "20% on a shared machine, so the floor verdict is within noise here. Judge it with the full mode."
        )
    return lines
