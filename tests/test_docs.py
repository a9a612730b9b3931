"""docs/FIDELITY.md cites this project's code by symbol, and every symbol it cites exists; every relative link in the
markdown pages lands on a file.

A citation is a backticked dotted name whose first part is a module of the adapter (``papo_trainer.PAPOGTrainer``,
resolved under ``papo_nb.papo``) or ``papo_nb`` itself (``papo_nb.testbed.raw_masks.mask_pil_squares``); it is
imported and then read attribute by attribute. ``tests/<file>.py::<test>`` names a test that must exist.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIDELITY = ROOT / "docs" / "FIDELITY.md"
ADAPTER = ROOT / "papo_nb" / "papo"
# Its modules and subpackages (``probe.projection.power_shortfall`` resolves under papo_nb.papo too).
ADAPTER_MODULES = frozenset(p.stem for p in ADAPTER.glob("*.py") if p.stem != "__init__") | frozenset(
    p.parent.name for p in ADAPTER.glob("*/__init__.py")
)
PACKAGE_MODULES = frozenset(p.stem for p in (ROOT / "papo_nb").rglob("*.py") if p.stem != "__init__")
FILE_SUFFIXES = ("py", "sh", "yaml", "md", "json", "png", "ipynb", "safetensors")
# Rows another change rewrites (the masked branch's timing and cost); until then they may still cite by line.
ROWS_CITING_LINES: tuple[str, ...] = ()  # every row cites this project by symbol

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
LINE_CITATION = re.compile(r"`(?:[\w./]*/)?(\w+)\.py`:\d")


def cited_symbols(text: str) -> list[str]:
    symbols = []
    for token in re.findall(r"`([^`\n]+)`", text):
        if not DOTTED.fullmatch(token) or token.rsplit(".", 1)[1] in FILE_SUFFIXES:
            continue
        first = token.split(".")[0]
        if first == "papo_nb" or first in ADAPTER_MODULES:
            symbols.append(token)
    return symbols


def resolve(symbol: str):
    """The object ``symbol`` names: the longest importable module prefix, then attributes."""
    name = symbol if symbol.startswith("papo_nb.") else f"papo_nb.papo.{symbol}"
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                raise AttributeError(f"{symbol}: {'.'.join(parts[:cut])} has no {attribute!r} on the way")
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(symbol)


TEXT = FIDELITY.read_text()
SYMBOLS = sorted(set(cited_symbols(TEXT)))


def test_fidelity_cites_the_project_by_symbol():
    # The table cites the trainer, config, terms, masking and the masked branch throughout: 56 distinct symbols,
    # and the VPPO section 21 more (a row that cites another symbol or drops one changes this count on purpose).
    assert len(SYMBOLS) == 77, SYMBOLS


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_every_cited_symbol_exists(symbol):
    resolve(symbol)


def test_no_project_module_is_cited_by_line():
    by_line = [
        (number, match.group(0))
        for number, line in enumerate(TEXT.splitlines(), 1)
        if not line.startswith(ROWS_CITING_LINES)
        for match in LINE_CITATION.finditer(line)
        if match.group(1) in PACKAGE_MODULES
    ]
    assert by_line == [], "cite papo_nb code by symbol, not by line"


def test_every_cited_test_exists():
    references = TEST_REFERENCE.findall(TEXT)
    assert references
    for path, name in references:
        tree = ast.parse((ROOT / path).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, (path, name)


def test_a_missing_symbol_and_a_line_citation_are_caught():
    with pytest.raises(AttributeError, match="has no 'no_such_method'"):
        resolve("papo_trainer.PAPOGTrainer.no_such_method")
    with pytest.raises(AttributeError, match="papo_nb has no 'no_such_module'"):
        resolve("papo_nb.no_such_module.thing")
    assert cited_symbols("`terms.bounded_k3`, `masking.py`, `state.max_steps`, `papo_nb.testbed.raw_masks`") == [
        "terms.bounded_k3",
        "papo_nb.testbed.raw_masks",
    ]
    assert [m.group(1) for m in LINE_CITATION.finditer("(`papo_nb/papo/terms.py`:17-27, `dp`:329)")] == ["terms"]


# Issue 46: the workbook's one word for the family PAPO-G and VPPO belong to, and the words it replaces.
FAMILY = "masked-branch method"
NOT_FAMILY = re.compile(r"perception[- ]aware methods?|perception methods?|PAPO[- ]family|PAPO-like methods?", re.I)
FAMILY_PAGES = ("README.md", "docs/masked_branch.md", "docs/FIDELITY.md", "docs/study.md", "docs/recipe.md")


def test_the_family_of_methods_has_one_name_used_everywhere():
    from papo_nb.workbook.config.params import WorkbookParams

    assert f"*{FAMILY}s*" in (ROOT / "README.md").read_text()  # defined where VPPO is introduced
    assert FAMILY in WorkbookParams.model_fields["method"].description
    for page in FAMILY_PAGES[:4]:
        assert FAMILY in (ROOT / page).read_text(), page
    texts = [ROOT / p for p in FAMILY_PAGES] + sorted((ROOT / "papo_nb").rglob("*.py"))
    stray = [f"{path.relative_to(ROOT)}: {m[0]}" for path in texts for m in NOT_FAMILY.finditer(path.read_text())]
    assert not stray, stray


# README keeps the two commands and links the detail into docs/; every such link must land on a file.
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def broken_links(page: Path) -> list[str]:
    """The relative link targets in ``page`` (anchors dropped) that name no file or folder beside it."""
    targets = [t for t in MARKDOWN_LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]
    return [t for t in targets if not (page.parent / t.split("#")[0]).exists()]


def test_every_relative_link_in_the_markdown_pages_resolves(tmp_path):
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"]
    pages = subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert {"README.md", "docs/trl_releases.md", "docs/families.md", "docs/vppo.md", "docs/tests.md"} <= set(pages)
    broken = {page: links for page in pages if (links := broken_links(ROOT / page))}
    assert not broken, f"links to no file (page: targets): {broken}"
    (tmp_path / "page.md").write_text("[ok](page.md#top) [web](https://x.org) [gone](docs/none.md) [a](#b)")
    assert broken_links(tmp_path / "page.md") == ["docs/none.md"]
