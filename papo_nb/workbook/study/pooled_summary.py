"""The study summary's pooled verdicts: the pages ``warm_starts.write_page`` wrote (one design on several
independently built warm starts, paired by seed), which lead the summary table, qualify each one-warm-start row whose
claim they do not reproduce, and give README its three sentences (``verdict_sentences``)."""

from __future__ import annotations

from pathlib import Path

from papo_nb.workbook.study import warm_starts

PAGE = warm_starts.PAGE_FILE
FINETUNING_WORDS = {"lora": "LoRA", "full": "full fine-tuning"}


def pooled(root: Path) -> list[tuple[Path, dict, dict]]:
    """(folder, data, ``warm_starts.pooled_line``) of each pooled page under ``root``, LoRA pages first."""
    pages = [(folder, data, warm_starts.pooled_line(data)) for folder, data in warm_starts.pooled_pages(root)]
    return sorted(pages, key=lambda page: (warm_starts.finetuning_of(page[1], root) != "lora", page[0].name))


def pooled_table(root: Path, pooled: list[tuple[Path, dict, dict]], link_prefix: str) -> list[str]:
    """The pooled pages' verdicts (every warm start of a design, paired by seed), which lead the summary."""
    if not pooled:
        return []
    lines = [
        "Pooled over independently built warm starts (these verdicts generalise; each row of the second table is one "
        "warm start):",
        "",
        "| pooled page | finetuning | warm starts | pairs | GRPO's drift off the image, vision avg@k | PAPO-G - GRPO, "
        "vision avg@k | PAPO-G - its KL-matched placebo | perception-specific |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for folder, data, line in pooled:
        lines.append(
            f"| [{folder.name}]({link_prefix}{folder.name}/{PAGE}) | {warm_starts.finetuning_of(data, root)} | "
            f"{line['warm_starts']} | {line['pairs']} | {line['drift']} | {line['papo_g']} | {line['placebo']} | "
            f"{line['specific']} |"
        )
    return [*lines, "", "Each page, one warm start (the shipped build) unless its row says otherwise:", ""]


def overturned(summary: dict, key: str, claim: str, pooled, root: Path, link_prefix: str) -> str:
    """What the pooled pages of the same finetuning say where a one-warm-start row's ``key`` claims ``claim``
    ("holds", "beats") and the pooled contrast does not detect a gain; "" otherwise."""
    if not str(summary.get(key, "")).startswith(claim):
        return ""
    said = [
        f"pooled over {line['warm_starts']} warm starts ([{folder.name}]({link_prefix}{folder.name}/{PAGE})): "
        f"{line['papo_g' if key == 'counteract' else 'placebo']}"
        for folder, data, line in pooled
        if warm_starts.finetuning_of(data, root) == summary["finetuning"]
        and not line["papo_g_holds" if key == "counteract" else "placebo_holds"]
    ]
    if not said:
        return ""
    return f" (this warm start only; {'; '.join(said)})"


def verdict_sentences(root: str | Path, link_prefix: str = "") -> str:
    """Three sentences from the pooled pages under ``root`` (LoRA first): GRPO's drift, PAPO-G against GRPO, and
    whether the gain is perception-specific, each with its page's numbers."""
    root = Path(root)
    pages = pooled(root)
    if not pages:
        return "No pooled study page yet.\n"
    said = [(f"[{folder.name}]({link_prefix}{folder.name}/{PAGE})", warm_starts.finetuning_of(data, root),
             line) for folder, data, line in pages]  # fmt: skip
    drift = "; ".join(f"{FINETUNING_WORDS[ft]}, {line['warm_starts']} warm starts ({link}): {line['drift']}"
                      for link, ft, line in said)  # fmt: skip
    # each page by its finetuning and name: two designs may share a finetuning (LoRA: one gamma, each its own)
    names = [f"{FINETUNING_WORDS[ft]}, {folder.name}" for (folder, _, _), (_, ft, _) in zip(pages, said)]
    papo = "; ".join(f"{name}: {line['papo_g']}" for name, (_, _, line) in zip(names, said))
    placebo = "; ".join(f"{name}: {line['specific']} ({line['placebo']})" for name, (_, _, line) in zip(names, said))
    return (
        f"GRPO drifts off the image on `testbed:shapes_shortcut`, pooled over independently built warm starts: "
        f"{drift}.\nPAPO-G at half a searched collapse gamma against GRPO, pooled: {papo}.\n"
        f"That its gain works through perception (it beats every matched control and the placebo): {placebo}.\n"
    )
