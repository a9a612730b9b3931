"""The study pages under docs/study/ name the policy they ran: a page's card carries the SHA-256 of its weights, and
that hash and card must be the shipped testbed's, so a change that moves the shipped weights fails here until the pages
are regenerated (commands in docs/study.md). Pages written before the weights were shipped say so on the page."""

import json
from pathlib import Path

import pytest

from papo_nb.testbed import policy as testbed_policy

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED_CARDS = sorted((ROOT / "docs" / "study").glob("*/testbed_card.json"))


def test_every_study_page_publishes_its_testbed_card():
    pages = sorted((ROOT / "docs" / "study").glob("*/results.md"))
    assert len(pages) >= 2 and len(PUBLISHED_CARDS) == len(pages), (pages, PUBLISHED_CARDS)
    assert {json.loads(card.read_text())["testbed"] for card in PUBLISHED_CARDS} >= {"shapes", "shapes_prior"}


@pytest.mark.parametrize("published", PUBLISHED_CARDS, ids=lambda path: path.parent.name)
def test_each_page_ran_the_shipped_weights_or_says_it_predates_them(published):
    card = json.loads(published.read_text())
    page = (published.parent / "results.md").read_text()
    row = next(line for line in (ROOT / "docs" / "study" / "summary.md").read_text().splitlines() if
               f"[{published.parent.name}]" in line)  # fmt: skip
    if "weights_sha256" not in card:  # written from a fresh build before the weights were shipped: the table says so
        assert row.endswith("| not pinned |"), row
        return
    assert row.endswith(f"| `{card['weights_sha256'][:12]}` |"), row
    shipped = testbed_policy.read_card(testbed_policy.pinned_testbed(card["testbed"]))
    assert card == {k: v for k, v in shipped.items() if k != "build_seconds"}, (
        f"{published} ran other weights than the shipped testbed:{card['testbed']}: regenerate it (docs/study.md)"
    )
    assert f"SHA-256 `{shipped['weights_sha256']}`" in page


def test_the_summary_and_the_readme_table_are_the_pages_verdicts():
    from papo_nb.workbook.study.publish import README_MARKERS, SUMMARY_TARGETS, summary_markdown

    root = ROOT / "docs" / "study"
    regenerate = "regenerate with: python -m papo_nb.workbook.study.publish"
    assert (root / "summary.md").read_text() == summary_markdown(root), regenerate
    for page, prefix in SUMMARY_TARGETS:
        text = (ROOT / page).read_text()
        block = text.split(README_MARKERS[0], 1)[1].split(README_MARKERS[1], 1)[0]
        assert block == "\n" + summary_markdown(root, link_prefix=prefix), f"{page}: {regenerate}"


def test_the_readme_block_is_replaced_in_place():
    from papo_nb.workbook.study.publish import README_MARKERS, replace_block

    start, end = README_MARKERS
    assert replace_block(f"a\n{start}\nold\n{end}\nb\n", "new\n") == f"a\n{start}\nnew\n{end}\nb\n"
    with pytest.raises(ValueError, match="study-summary"):
        replace_block("no markers", "new\n")


CALIBRATED_PAGES = sorted(path.parent for path in (ROOT / "docs" / "study").glob("*/start_scores.json"))


def test_a_calibrated_page_exists_and_its_verdict_is_recomputed_from_its_own_files():
    from papo_nb.workbook.study.drift import PRIMARY
    from papo_nb.workbook.study.publish import SUMMARY, page_tables

    assert CALIBRATED_PAGES, "no calibrated study page (params/study_shortcut.yaml, docs/study.md)"
    for page in CALIBRATED_PAGES:
        drift, verdicts, claim = page_tables(page)
        summary = json.loads((page / SUMMARY).read_text())
        assert summary["counteract"] == claim["verdict"], page
        assert f"**{claim['verdict']}.**" in (page / "results.md").read_text(), page
        # what the page found about GRPO, pinned so that it cannot change silently: it drifted off the image by
        # 5 points or more, its 95% CI clear of 0, on the prior-breaking items
        grpo = next(row for row in drift if row["arm"] == "grpo" and row["metric"] == PRIMARY)
        assert grpo["drift"] <= -0.05 and grpo["drift"] + grpo["drift_ci95"] < 0, grpo
        assert {row["arm"] for row in verdicts} >= {"papo_g", "papo_g_eighth", "papo_g_quarter", "papo_g_half"}
