"""The study pages under docs/study/ are what the code on main builds: every published build card equals a fresh
build's, so a change that moves a testbed fails here until the pages are regenerated (commands in docs/study.md)."""

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


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("published", PUBLISHED_CARDS, ids=lambda path: path.parent.name)
def test_a_fresh_build_matches_the_published_card(published, testbed_path, prior_testbed_path):
    card = json.loads(published.read_text())
    folder = {"shapes": testbed_path, "shapes_prior": prior_testbed_path}[card["testbed"]]
    built = {k: v for k, v in testbed_policy.read_card(folder).items() if k != "build_seconds"}
    assert built == card, f"{published} is stale: regenerate the study pages (docs/study.md)"


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
