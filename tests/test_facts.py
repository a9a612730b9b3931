"""Counts, times and paths that README and docs/ state, each checked against its source, so a page cannot keep a
number after what it counts has moved: the fresh builds (docs/study.md's table), the smoke workbook's time (the
measured run in docs/smoke_report/), the training completions table's path, the params files docs/layout.md lists,
README's decimal numbers (each in a page its section links) and README's length."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

from papo_nb.workbook.training.completions import TABLE_FILE

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 120
NUMBER = re.compile(r"(?<![\w.])[+-]?\d+(?:\.\d+)+x?")  # versions (two dots) are left out below
LINK = re.compile(r"\]\(([^)\s#]+)[^)]*\)")


def read(path: str) -> str:
    return (ROOT / path).read_text()


def builds_table_rows() -> int:
    section = read("docs/study.md").split("## The testbeds", 1)[1].split("\n## ", 1)[0]
    return len([line for line in section.splitlines() if re.match(r"\| shapes\w* \| \d+ \| `", line)])


def test_the_build_counts_are_the_rows_of_the_builds_table():
    rows = builds_table_rows()
    assert rows >= 45
    assert f"All {rows} builds met their goal" in read("docs/study.md")
    assert f"all {rows} fresh builds" in read("docs/smoke.md")
    for page in ["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        for found in re.findall(r"(\d+) of (\d+) fresh builds", read(page)):
            assert found == (str(rows), str(rows)), (page, found)


def measured_smoke_seconds() -> int:
    index = read("docs/smoke_report/README.md")
    per_notebook = [int(s) for s in re.findall(r"^\| 0\d_\w+ \| FINISHED \| (\d+) \|", index, flags=re.M)]
    whole = int(re.search(r"Whole run: (\d+) s wall", index).group(1))
    assert len(per_notebook) == 5 and sum(per_notebook) <= whole, (per_notebook, whole)
    return whole


def test_every_page_that_times_the_smoke_workbook_quotes_the_measured_run():
    seconds = measured_smoke_seconds()
    for page in ("docs/smoke.md", "notebooks/README.md", "params/smoke.yaml"):
        text = read(page)
        assert f"{seconds} s" in text, page
        assert not re.search(r"about (four|4|7-9) min", text, flags=re.I), page
    for notebook in sorted((ROOT / "notebooks").glob("0*.ipynb")):
        assert (ROOT / "docs" / "smoke_report" / notebook.with_suffix(".html").name).is_file(), notebook.name


def test_every_notebook_ends_on_what_its_run_showed():
    for path in sorted((ROOT / "notebooks").glob("0*.ipynb")):
        last = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"][-1]
        assert "run_report(mlflow.active_run().info.run_id)" in last.source, path.name
        html = (ROOT / "docs" / "smoke_report" / path.with_suffix(".html").name).read_text()
        assert f"What {path.stem} showed" in html, path.name


def test_the_completions_table_is_named_where_it_is_logged():
    assert TABLE_FILE == "completions.json"
    for page in ("README.md", "docs/guide.md"):
        text = read(page)
        assert f"`{TABLE_FILE}` at the" in text, page
        assert "(`completions/`" not in text, page


def test_the_layout_page_lists_every_params_file():
    listed = set(re.findall(r"`(params/[\w/]+\.yaml)`", read("docs/layout.md").split("## Parameter files", 1)[1]))
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "params").rglob("*.yaml")}
    assert listed == on_disk, (sorted(on_disk - listed), sorted(listed - on_disk))


def readme_sections() -> list[str]:
    text = re.sub(r"<!-- study-verdict:start -->.*?<!-- study-verdict:end -->", "", README.read_text(), flags=re.S)
    return re.split(r"^## ", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)


def test_every_decimal_number_in_readme_is_in_a_page_its_section_links():
    for section in readme_sections():
        prose = LINK.sub("]", re.sub(r"\[[^\]]*\]\(https?:[^)]*\)", "", section))  # web links: their own
        prose = re.sub(r"`[^`]*`", "", prose)
        numbers = {n for n in NUMBER.findall(prose) if n.count(".") == 1}
        pages = [README.parent / target for target in LINK.findall(section) if (README.parent / target).is_file()]
        sources = "\n".join(page.read_text() for page in pages)
        missing = sorted(n for n in numbers if n not in sources)
        assert not missing, f"README section {section.splitlines()[0]!r}: {missing} in none of {pages}"


def test_readme_fits_two_screens_and_keeps_its_generated_verdict():
    from publish_study import VERDICT_MARKERS

    from papo_nb.workbook.study.pooled_summary import verdict_sentences

    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    block = text.split(VERDICT_MARKERS[0], 1)[1].split(VERDICT_MARKERS[1], 1)[0]
    assert block == "\n" + verdict_sentences(ROOT / "docs" / "study", "docs/study/"), (
        "regenerate with: python scripts/publish_study.py"
    )
    assert not re.search(r"issue \d+|no GPU was lent", text, flags=re.I)


def test_the_commands_readme_shows_parse_as_written():
    """README's `papo-nb` lines (its own model and data, the MLflow UI on a fixed port) are the CLI's arguments."""
    import shlex

    from papo_nb.cli import build_parser

    blocks = re.findall(r"```text\n(.*?)```", README.read_text(), flags=re.S)
    commands = [shlex.split(block.replace("\\\n", " ")) for block in blocks if "papo-nb" in block]
    assert {command[1] for command in commands} == {"train", "ui"}
    for command in commands:
        args, unknown = build_parser().parse_known_args(command[1:])
        assert unknown == [], command
    ui = next(build_parser().parse_args(c[1:]) for c in commands if c[1] == "ui")
    assert (ui.port, ui.host) == (5000, "127.0.0.1")


def test_readme_names_the_weights_each_smoke_notebook_runs():
    """Issue 61: README said every smoke notebook ran `c5244a15f6ab...` (shapes_boxed); 04's study runs
    shapes_shortcut's weights. Each testbed and hash README names is params/smoke.yaml's and the manifest's."""
    import json

    import yaml

    from papo_nb.testbed.policy import PINNED_MANIFEST

    smoke = yaml.safe_load(read("params/smoke.yaml"))
    manifest = json.loads(PINNED_MANIFEST.read_text())
    sentence = read("README.md").split("The CPU smoke workbook:", 1)[1].split("```", 1)[0]
    for notebooks, model in (
        ("01, 02, 03 and 05", smoke["model_name_or_path"]),
        ("04's study", smoke["study_params"]["model_name_or_path"]),
    ):
        sha = manifest[model.removeprefix("testbed:")]["sha256"]["model.safetensors"][:12]
        assert f"{notebooks} run{'s' if notebooks.startswith('04') else ''} `{model}`, `{sha}...`" in " ".join(
            sentence.split()
        ), (notebooks, model, sha)


def test_the_smoke_page_quotes_what_the_executed_notebooks_said():
    """docs/smoke.md's table quotes 04's verdict, 05's sentence on the base model and 03's baseline; each is what the
    executed notebook in docs/smoke_report/ printed (issue 61: the page kept "recovers +0.072 of GRPO's drift")."""
    import html

    rows = {line.split("|")[1].strip(): line for line in read("docs/smoke.md").splitlines() if line.startswith("| 0")}
    for notebook, pattern in (("04", r'"(holds: [^"]+)"'), ("05", r'"(The checkpoint [^"]+)"')):
        quoted = re.search(pattern, rows[notebook]).group(1)
        page = html.unescape(
            read(f"docs/smoke_report/{notebook}_{'method_study' if notebook == '04' else 'evaluation'}.html")
        )
        assert quoted in page, (notebook, quoted)
    page = html.unescape(read("docs/smoke_report/03_training_run.html"))
    before = re.search(r"before training ([\d.]+) / ([\d.]+)\)", page).groups()
    assert f"before training, on the same items and masks, {before[0]} and {before[1]}" in rows["03"]
