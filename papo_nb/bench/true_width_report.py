"""docs/performance.md's true-width table and its "In short" sentence, rendered from
docs/in_loop/true_width.json (``python -m papo_nb.bench.true_width``): one record per cell, the measured ratios with
their spread beside the FLOP model's (``true_width_model``), per phase, and auto's decision. Regenerate from the
repository root with ``python -m papo_nb.bench.true_width_report --write`` (``--root DIR`` for another checkout;
without ``--write``: print them); tests/test_true_width.py fails when the committed page differs from what this makes
of the committed JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from papo_nb.workbook.doc_blocks import block_command, replace_block

RESULTS = Path("docs") / "in_loop" / "true_width.json"  # under the repository root the caller names
DOC = Path("docs") / "performance.md"
TABLE_MARKERS = ("<!-- true-width table: begin -->", "<!-- true-width table: end -->")
SHORT_MARKERS = ("<!-- true-width in short: begin -->", "<!-- true-width in short: end -->")
TOLERANCE = 0.15  # the measured ratio within 15% of the FLOP model's
VARIANTS = ("papo_shared", "papo_rollout", "grpo")
FAMILY_NAMES = {"Qwen/Qwen2.5-VL-3B-Instruct": "Qwen2.5-VL-3B", "Qwen/Qwen3-VL-4B-Instruct": "Qwen3-VL-4B"}
REQUIRED = dict(family="Qwen/Qwen2.5-VL-3B-Instruct", num_generations=5, max_pixels=1003520, finetuning="lora")


def load(root: Path) -> dict[str, Any]:
    return json.loads((root / RESULTS).read_text())


def records(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells, by family, depth, G, pixels, fine-tuning and completion length."""
    key = ("family", "layers", "num_generations", "max_pixels", "finetuning", "completion_length")
    return sorted(results["cells"], key=lambda r: tuple(r[k] for k in key))


def required_cells(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells the table must hold: Qwen2.5-VL-3B, G 5, 1,003,520 pixels, LoRA, at the least depth measured."""
    found = [r for r in records(results) if all(r[k] == v for k, v in REQUIRED.items())]
    least = min((r["layers"] for r in found), default=None)
    return [r for r in found if r["layers"] == least]


def within_model(record: dict[str, Any]) -> bool:
    measured, model = record["shared_over_plain"]["median"], record["model_shared_over_plain"]
    return abs(measured / model - 1) <= TOLERANCE


def spread(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}]"


def row(r: dict[str, Any]) -> str:
    phases, model = r["phase_ratios"], r["model"]["step"]["phase_shared_over_plain"]
    peaks = " / ".join(f"{r['variants'][v]['peak_mib']:.0f}" for v in VARIANTS)
    cells = [
        FAMILY_NAMES.get(r["family"], r["family"]), str(r["layers"]), r["finetuning"], str(r["num_generations"]),
        f"{r['max_pixels']:,}", f"{r['P']:.0f}", f"{r['R']:.0f}", str(r["repeats"]),
        spread(r["shared_over_plain"]), f"{r['model_shared_over_plain']:.3f}",
        f"{phases['training']:.3f} / {model['training']:.3f}",
        f"{phases['round_logps']:.3f} / {model['reference']:.3f}",
        f"{phases['masked']:.3f} / {model['masked']:.3f}",
        spread(r["shared_over_grpo"]), f"{r['model']['step']['shared_over_grpo']:.3f}",
        f"{r['model']['full_depth']['shared_over_plain']:.3f} / {r['model']['full_depth']['shared_over_grpo']:.3f}",
        r["auto_decision"], peaks, "warm-up" if r["peak_source"].startswith("warm-up") else "timed",
        f"{r['variants']['papo_rollout']['no_sampling_cpu_s']:.1f}",
        "yes" if within_model(r) else "NO",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def header(results: dict[str, Any]) -> str:
    runs = results["runs"]
    loads = [x for run in runs for x in (*run["load_before"], *run.get("load_after", run["load_before"]))]
    return (
        f"{results['threads']} thread; per cell the interleaved timed rounds (column 'rounds'), one optimizer step "
        "each, after a warm-up; process CPU seconds per optimizer step without the sampling call; ratios are the "
        "median [min, max] of per-round ratios; phases shared / plain PAPO-G measured / modelled (training: the loss "
        "forward and the backward; reference: the round's log-probs beyond sampling and the masked branch); peak MiB "
        "is resident memory above the start of a `train()` (`memory.rss_peak`), column 'peaks': 'warm-up' where the "
        "warm-up round (one untimed `train()` per variant) measured it, 'timed' where only the shared variant warmed "
        "up (auto's first-batch check) and each peak is the median of the variant's timed calls, the 128 KiB mmap "
        f"threshold in force during all of them; {len(runs)} run(s) of {sum(run['wall_s'] for run in runs) / 60:.0f} "
        f"minutes in all at load average {min(loads):.2f} to {max(loads):.2f}."
    )


def table(results: dict[str, Any]) -> str:
    columns = (
        "model", "K", "tuning", "G", "max pixels", "P", "R", "rounds", "shared / plain PAPO-G", "FLOP model",
        "training phase measured / model", "reference phase measured / model", "masked branch measured / model",
        "shared / GRPO", "FLOP model shared / GRPO", "FLOP model at 36 layers: shared / plain, / GRPO",
        "auto's decision", "peak MiB shared / plain / GRPO", "peaks", "plain s/step", "within 15% of the model",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([header(results), "", *lines, *(row(r) for r in records(results))])


def in_short(results: dict[str, Any]) -> str:
    """The "In short" sentence on true widths, from the required cells' numbers."""
    parts = []
    for r in required_cells(results):
        peaks = ", ".join(f"{v} {r['variants'][v]['peak_mib']:.0f}" for v in VARIANTS)
        parts.append(
            f"at R {r['R']:.0f} shared PAPO-G costs {r['shared_over_plain']['median']:.2f}x plain PAPO-G "
            f"({r['shared_over_plain']['min']:.2f}x to {r['shared_over_plain']['max']:.2f}x; FLOP model "
            f"{r['model_shared_over_plain']:.2f}x) and {r['shared_over_grpo']['median']:.2f}x TRL's GRPO step "
            f"(model {r['model']['step']['shared_over_grpo']:.2f}x), auto chose {r['auto_decision']}, peak MiB "
            f"{peaks}"
        )
    held = sum(within_model(r) for r in results["cells"])
    first = required_cells(results)[0]
    return (
        f"At true Qwen2.5-VL-3B widths ({first['layers']} decoder layer(s) and vision block(s), LoRA, "
        f"checkpointing on, G 5, one 1,003,520-pixel image, P {first['P']:.0f}), "
        + "; ".join(parts)
        + f". The FLOP model is within 15% of the measurement in {held} of {len(results['cells'])} cells; at 36 "
        f"layers it predicts {first['model']['full_depth']['shared_over_plain']:.2f}x plain PAPO-G at R "
        f"{first['R']:.0f} (the decoder's share of the step grows with depth; the head and tower do not)."
    )


def finite(value: Any) -> bool:
    """Every number in ``value`` (nested dicts and lists) finite."""
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list):
        return all(finite(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return True


def document(text: str, results: dict[str, Any]) -> str:
    text = replace_block(text, f"{table(results)}\n", TABLE_MARKERS)
    return replace_block(text, f"{in_short(results)}\n", SHORT_MARKERS)


def main(argv: list[str] | None = None) -> int:
    description = "docs/performance.md's true-width table and its In short sentence from docs/in_loop/true_width.json"
    return block_command(
        argv, description, DOC, load, document, lambda results: f"{table(results)}\n\n{in_short(results)}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
