"""The in-loop table of docs/performance.md: shared PAPO-G (``prefix_sharing=True``) against plain PAPO-G and
TRL's GRPO inside ``trainer.train()``, one row per TRL release, family, G and R, with a verdict from the numbers. It
renders the benchmark's JSON kept in ``docs/in_loop/`` (written by ``benchmarks/in_loop_grid.sh``, one file per
release, family and completion length) into docs/performance.md between its markers. Regenerate from the
repository root with ``python -m papo_nb.bench.in_loop_grid --write`` (``--root DIR`` for another checkout; without
``--write``: print the table); tests/test_in_loop_grid.py fails when the committed table differs from what this makes
of the committed JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from papo_nb.workbook.doc_blocks import block_command, replace_block

RESULTS = Path("docs") / "in_loop"  # under the repository root the caller names
DOC = Path("docs") / "performance.md"
BEGIN, END = "<!-- in-loop grid: begin -->", "<!-- in-loop grid: end -->"
SHARED, PLAIN = "papo_shared", "papo_rollout"
FAMILY_NAMES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL", "qwen2_vl": "Qwen2-VL"}


def load(root: Path) -> list[dict[str, Any]]:
    """Every benchmark run kept in ``root``'s docs/in_loop/ (the tiny-width grid; not the true-width cells), by
    release, family and completion length."""
    runs = [json.loads(path.read_text()) for path in (root / RESULTS).glob("trl*.json")]
    return sorted(runs, key=lambda r: (tuple(int(x) for x in r["trl"].split(".")), r["family"], r["completion"]))


def cells(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(run, layout)`` per grid cell: release, family, R, then G."""
    return [(run, layout) for run in runs for layout in sorted(run["layouts"], key=lambda lay: lay["G"])]


def sharing_ran(layout: dict[str, Any]) -> str | None:
    """Why ``layout`` is not a measurement of sharing (the shared variant not packed in every log-prob call, or the
    plain one packed in any), or None."""
    shared, plain = layout[SHARED], layout[PLAIN]
    if shared["packed"] != 1.0 or "packed per prompt group" not in shared["forward_plan"]:
        return f"the shared variant ran packed in {shared['packed']:.0%} of its log-prob calls"
    if plain["packed"] != 0.0 or "plain per completion" not in plain["forward_plan"]:
        return f"the plain variant ran packed in {plain['packed']:.0%} of its log-prob calls"
    return None


def verdict(run: dict[str, Any], layout: dict[str, Any]) -> str:
    """``met`` where shared PAPO-G was faster than plain PAPO-G in every round (no-sampling time) and its median peak
    no higher; otherwise what was not met and what the measurements say of it: a slower round against the rounds'
    own spread (plain PAPO-G / GRPO in the same rounds), a slower median split into the masked branch and the rest,
    a higher peak against the runs' spread."""
    if (reason := sharing_ran(layout)) is not None:
        return f"not a measurement of sharing: {reason}"
    c = "_cpu" if run["clock"] == "cpu" else ""
    ratio = layout[f"{SHARED}/{PLAIN}_no_sampling{c}_s"]
    shared, plain = layout[SHARED], layout[PLAIN]
    noise = layout[f"{PLAIN}/grpo_no_sampling{c}_s"]
    rounds = f"plain / GRPO in the same rounds {noise['min']:.3f} to {noise['max']:.3f}"
    missed = []
    if ratio["median"] > 1.0:
        extra = shared[f"no_sampling{c}_s"] - plain[f"no_sampling{c}_s"]
        masked = shared[f"masked{c}_s"] - plain[f"masked{c}_s"]
        model = shared["flop_ratio"] / plain["flop_ratio"]
        missed.append(
            f"slower at the median ({ratio['median']:.3f}; median times {extra:+.3f} s/step, of which the masked "
            f"branch {masked:+.3f} s; FLOP model {model:.3f}; {rounds})"
        )
    elif ratio["max"] > 1.0:
        missed.append(f"slower in some round (max {ratio['max']:.3f}, median {ratio['median']:.3f}; {rounds})")
    if shared["peak_mib"] > plain["peak_mib"]:
        missed.append(f"peak {shared['peak_mib'] - plain['peak_mib']:+.1f} MiB over plain, {peak_spread(layout)}")
    return "met" if not missed else "NOT met: " + "; ".join(missed)


def peak_spread(layout: dict[str, Any]) -> str:
    """Whether shared PAPO-G's peak runs overlap plain PAPO-G's, with both ranges (MiB)."""
    shared, plain = layout[SHARED]["peak_mib_runs"], layout[PLAIN]["peak_mib_runs"]
    overlap = min(shared) <= max(plain) and min(plain) <= max(shared)
    return (
        f"{'within' if overlap else 'beyond'} the runs' spread ({min(shared):.0f}-{max(shared):.0f} vs "
        f"{min(plain):.0f}-{max(plain):.0f})"
    )


def row(run: dict[str, Any], layout: dict[str, Any]) -> str:
    c = "_cpu" if run["clock"] == "cpu" else ""
    shared, plain, grpo = layout[SHARED], layout[PLAIN], layout["grpo"]

    def spread(base: str) -> str:
        r = layout[f"{SHARED}/{base}_no_sampling{c}_s"]
        return f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]"

    cells = [
        run["trl"], FAMILY_NAMES[run["family"]], str(layout["G"]), f"{layout['P']:.0f}", f"{layout['R']:.0f}",
        spread(PLAIN), spread("grpo"), f"{shared['flop_ratio'] / plain['flop_ratio']:.3f}",
        f"{plain[f'no_sampling{c}_s']:.3f}", f"{plain[f'masked{c}_s']:.3f} / {shared[f'masked{c}_s']:.3f}",
        f"{shared['peak_mib']:.1f} / {plain['peak_mib']:.1f} / {grpo['peak_mib']:.1f}",
        f"{shared['packed']:.0%} / {plain['packed']:.0%}", verdict(run, layout),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def header(runs: list[dict[str, Any]]) -> str:
    """What every cell shares, read from the runs (checkpointing as the timed calls left the model)."""
    checkpointing = {layout["gradient_checkpointing"] for run in runs for layout in run["layouts"]}
    keys = ("size", "repeats", "warmup", "prompts", "steps", "threads", "clock", "image_px", "memory_repeats")
    settings = {tuple(run[key] for key in keys) for run in runs}
    if len(settings) != 1:
        raise ValueError(f"the runs differ in their settings {keys}: {sorted(settings)}")
    size, repeats, warmup, prompts, steps, threads, clock, image_px, memory = settings.pop()
    loads = [x for r in runs for x in (*r["load_before"], *r["load_after"])]
    on = {frozenset({True}): "on in every cell", frozenset({False}): "off"}.get(frozenset(checkpointing), "mixed")
    return (
        f"Gradient checkpointing {on} (TRL's default), {size} builds, LoRA, {prompts} prompts per optimizer step, "
        f"{image_px}-px images, {steps} optimizer step per `train()` and per generation round, {threads} thread, "
        f"{repeats} interleaved rounds after {warmup} warm-up per cell, {clock} seconds per optimizer step without "
        f"the sampling call; ratios are the median [min, max] of per-round ratios; peak MiB is resident memory "
        f"above the start of a separate untimed `train()`, the median of {memory} runs per variant; load average "
        f"{min(loads):.2f} to {max(loads):.2f} at the start and end of each run."
    )


def table(runs: list[dict[str, Any]]) -> str:
    columns = (
        "TRL", "family", "G", "P", "R", "shared / plain PAPO-G", "shared / GRPO", "FLOP model shared / plain",
        "plain s/step", "masked branch s/step plain / shared", "peak MiB shared / plain / GRPO",
        "packed calls shared / plain", "never slower, peak <= plain",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join([header(runs), "", *lines, *(row(run, layout) for run, layout in cells(runs))])


def document(text: str, runs: list[dict[str, Any]]) -> str:
    """``text`` (docs/performance.md) with the table between its markers replaced by the one ``runs`` make."""
    return replace_block(text, f"{table(runs)}\n", (BEGIN, END))


def main(argv: list[str] | None = None) -> int:
    description = "docs/performance.md's in-loop table from docs/in_loop/trl*.json"
    return block_command(argv, description, DOC, load, document, table)


if __name__ == "__main__":
    raise SystemExit(main())
