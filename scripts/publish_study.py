"""The study's summary tables and README's verdict, rewritten from the pages under ``docs/study``: run it after a
study page is regenerated (notebook 04 with ``study_report_dir``, or a page builder in
``docs/measurements/``).

    .venv/bin/python scripts/publish_study.py

It redraws each page's dose-response figure and rewrites its contrasts from its data (``publish.write_contrasts``,
``publish.refresh_verdicts``), then ``docs/study/summary.md``, the summary and archive tables of ``docs/study.md``
and README's three-sentence verdict (``pooled_summary.verdict_sentences``). ``main``'s paths are relative to the
working directory (the tests run it on a copy); run as a script, it works in the checkout it sits in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from papo_nb.workbook.doc_blocks import replace_block
from papo_nb.workbook.study import dose, pooled_summary, warm_starts
from papo_nb.workbook.study.publish import (
    CARD,
    DOSE_ROWS,
    PAGE,
    RUNS,
    START,
    SUMMARY,
    refresh_verdicts,
    write_contrasts,
)


def policy_hash(page: Path) -> str:
    """The first 12 hex digits of the weights a page ran, or "not pinned" for a page written before they were."""
    card = page / CARD
    sha = json.loads(card.read_text()).get("weights_sha256") if card.exists() else None
    return f"`{sha[:12]}`" if sha else "not pinned"


def summary_markdown(root: str | Path, link_prefix: str = "") -> str:
    """One row per results page under ``root``: PAPO-G - GRPO on the headline metrics with its MDE and verdict,
    and the collapse arm's gamma; pages are linked as ``<link_prefix><page>/results.md``."""
    root = Path(root)
    pooled = pooled_summary.pooled(root)
    lines = [
        *pooled_summary.pooled_table(root, pooled, link_prefix),
        "| page | testbed | finetuning | seeds | GRPO vision avg@k | PAPO-G - GRPO, vision avg@k | "
        "PAPO-G - GRPO, reliance gap | collapse gamma | GRPO's drift off the image, and PAPO-G against it | "
        "PAPO-G against its placebo | VPPO against GRPO's drift | weights |",
        "|---|---|---|---|---:|---|---|---:|---|---|---|---|",
    ]
    for path in sorted(root.glob(f"*/{SUMMARY}")):
        summary = json.loads(path.read_text())
        effects = summary["papo_g_vs_grpo"]
        collapse = f"{summary['collapse_gamma']:g}" + ("" if summary["collapse_found"] else " (none collapsed)")
        lines.append(
            f"| [{path.parent.name}]({link_prefix}{path.parent.name}/{PAGE}) | {summary['testbed']} | "
            f"{summary['finetuning']} | "
            f"{summary['seeds']} | {summary['grpo']['avg_at_k/original/vision']:.3f} | "
            f"{effects['avg_at_k/original/vision']['verdict']} | {effects['avg_at_k/gap/vision']['verdict']} | "
            f"{collapse} | {summary.get('counteract', 'not measured (sweep design)')}"
            f"{pooled_summary.overturned(summary, 'counteract', 'holds', pooled, root, link_prefix)} | "
            f"{summary.get('placebo', 'not run')}"
            f"{pooled_summary.overturned(summary, 'placebo', 'beats', pooled, root, link_prefix)}"
            f" | {summary.get('vppo', 'not run')} | {policy_hash(path.parent)} |"
        )
    return "\n".join(lines) + "\n"


SUMMARY_PAGE = "summary.md"
README_MARKERS = ("<!-- study-summary:start -->", "<!-- study-summary:end -->")
# The pages kept for the record but out of the summary: the 2025 sweep design, run from a warm start that
# no longer exists and whose weights were not kept ("not pinned"), so no number on them is comparable with a pinned
# page's. docs/study.md's archive section carries their table between these markers.
ARCHIVE = "archive"
ARCHIVE_MARKERS = ("<!-- study-archive:start -->", "<!-- study-archive:end -->")
ARCHIVE_TARGET = ("docs/study.md", "study/archive/")


# the pages that carry the summary table between README_MARKERS, and how each links to docs/study/
SUMMARY_TARGETS = (("docs/study.md", "study/"),)
# README carries the pooled verdicts in three sentences between these markers (``verdict_sentences``)
VERDICT_MARKERS = ("<!-- study-verdict:start -->", "<!-- study-verdict:end -->")
VERDICT_TARGET = ("README.md", "docs/study/")


def main(root: str | Path = "docs/study", targets=SUMMARY_TARGETS) -> None:
    """Redraw each page's dose-response figure and rewrite its contrasts from its data, then ``<root>/summary.md``
    and the study table of every ``targets`` page (path, link prefix) from the pages' ``summary.json``, and README's
    three-sentence verdict (``VERDICT_MARKERS``) from the pooled pages."""
    root = Path(root)
    for rows in sorted(root.glob(f"*/{DOSE_ROWS}")):
        start = json.loads((rows.parent / START).read_text()) if (rows.parent / START).is_file() else None
        dose.plot_dose_response(json.loads(rows.read_text()), start=start).savefig(rows.with_suffix(".png"), dpi=80)
    pooled = {
        folder for folder, _ in warm_starts.pooled_pages(root)
    }  # their pages: docs/measurements/warm_starts_page.py
    for runs in [*sorted(root.glob(f"*/{RUNS}")), *sorted((root / ARCHIVE).glob(f"*/{RUNS}"))]:
        if runs.parent not in pooled:
            write_contrasts(runs.parent)
            if (runs.parent / SUMMARY).is_file():
                refresh_verdicts(runs.parent)
    (root / SUMMARY_PAGE).write_text(summary_markdown(root))
    for target, prefix in targets:
        path = Path(target)
        path.write_text(replace_block(path.read_text(), summary_markdown(root, link_prefix=prefix), README_MARKERS))
    readme, prefix = Path(VERDICT_TARGET[0]), VERDICT_TARGET[1]  # only from a root that has pooled pages
    if pooled_summary.pooled(root) and readme.is_file() and VERDICT_MARKERS[0] in readme.read_text():
        readme.write_text(
            replace_block(readme.read_text(), pooled_summary.verdict_sentences(root, prefix), VERDICT_MARKERS)
        )
    if (root / ARCHIVE).is_dir() and Path(ARCHIVE_TARGET[0]).exists():
        path, archive = Path(ARCHIVE_TARGET[0]), summary_markdown(root / ARCHIVE, link_prefix=ARCHIVE_TARGET[1])
        path.write_text(replace_block(path.read_text(), archive, ARCHIVE_MARKERS))
    print(f"wrote {root / SUMMARY_PAGE} and the study table of {', '.join(str(t) for t, _ in targets)}")


if __name__ == "__main__":  # python scripts/publish_study.py: the paths are the checkout's this script sits in
    os.chdir(Path(__file__).resolve().parents[1])
    main()
