"""Every notebook's parameters-cell defaults equal ``params/smoke.yaml``'s values (validated by WorkbookParams, so
a field it leaves out has the schema's default): a notebook run by hand in JupyterLab runs the smoke workbook's
settings, the ones its logged smoke run used. A markdown note just before the cell says papermill replaces it.

papermill parses the ``parameters`` cell (``name: type = default  # help``) exactly as it does before injecting
values, so this reads what a notebook run by hand in JupyterLab really starts with. The comments may say what a
parameter means in that notebook, but not contradict the schema's help: the official or paper values both cite
agree, and every option the help quotes is named (``comment_drift``).
"""

import ast
import re
from pathlib import Path

import nbformat
import papermill
import pytest

from papo_nb.infra.notebooks import RUNTIME_PARAMETERS
from papo_nb.infra.smoke_paths import SMOKE_PARAMS
from papo_nb.workbook.config.params import WorkbookParams, load_params

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def default_drift(notebook: Path) -> list[str]:
    """One line per parameter whose notebook default differs from ``params/smoke.yaml``'s (or is not a literal)."""
    schema = load_params(SMOKE_PARAMS).model_dump()
    problems = []
    for name, spec in papermill.inspect_notebook(notebook).items():
        if name not in schema:
            if name not in RUNTIME_PARAMETERS:
                problems.append(f"{notebook.name}: {name!r} is not a WorkbookParams field")
            continue
        try:
            value = ast.literal_eval(spec["default"])
        except (ValueError, SyntaxError):
            problems.append(f"{notebook.name}: {name!r} default {spec['default']!r} is not a literal")
            continue
        if value != schema[name] or type(value) is not type(schema[name]):
            problems.append(f"{notebook.name}: {name!r} notebook default {value!r} != smoke.yaml's {schema[name]!r}")
    return problems


CITED = re.compile(r"(?:official|paper)[^:;()]*:\s*(?:avg@)?([0-9][0-9.e-]*|[a-z_]+)")
QUOTED = re.compile(r"'([a-z0-9_]+)'")


def comment_drift(notebook: Path) -> list[str]:
    """One line per parameter whose comment contradicts the schema's help: an official/paper value that differs from
    the one the help cites, or an option the help quotes ('auto', 'none', ...) that the comment leaves out."""
    fields = WorkbookParams.model_fields
    problems = []
    for name, spec in papermill.inspect_notebook(notebook).items():
        if name not in fields:
            continue
        comment, help_text = spec["help"] or "", fields[name].description or ""
        if not comment.strip():
            problems.append(f"{notebook.name}: {name!r} has no comment")
            continue
        ours, theirs = set(CITED.findall(comment)), set(CITED.findall(help_text))
        if ours and theirs and not ours & theirs:
            problems.append(f"{notebook.name}: {name!r} comment cites {sorted(ours)}, the schema {sorted(theirs)}")
        missing = [option for option in QUOTED.findall(help_text) if not re.search(rf"\b{option}\b", comment)]
        if missing:
            problems.append(f"{notebook.name}: {name!r} comment leaves out the schema's options {missing}")
    return problems


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_comments_agree_with_the_schema_help(notebook):
    assert comment_drift(notebook) == []


def test_comment_drift_names_the_contradiction(tmp_path):
    book = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    cell = nbformat.v4.new_code_cell(
        "num_generations: int = 4  # rollouts per prompt (paper: 8)\n"
        'mask_type: str = "auto"  # auto or random\n'
        "seed: int = 0  # seed for sampling"
    )
    cell.metadata["tags"] = ["parameters"]
    book.cells.append(cell)
    path = tmp_path / "99_comments.ipynb"
    nbformat.write(book, path)
    assert comment_drift(path) == [
        "99_comments.ipynb: 'num_generations' comment cites ['8'], the schema ['5']",
        "99_comments.ipynb: 'mask_type' comment leaves out the schema's options ['merge_unit']",
    ]


def test_notebooks_found():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_contract_verification",
        "02_probe_calibration",
        "03_training_run",
        "04_method_study",
        "05_evaluation",
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_defaults_equal_the_smoke_params(notebook):
    assert default_drift(notebook) == []


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_visible_note_before_the_parameters_cell_says_papermill_replaces_it(notebook):
    cells = nbformat.read(notebook, as_version=4).cells
    (index,) = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
    note = cells[index - 1]
    assert note.cell_type == "markdown" and "papermill" in note.source and "replaces" in note.source
    assert "params/smoke.yaml" in note.source


def test_runtime_parameters_default_to_empty():
    """Run by hand, the runner's values are absent: each must default to '' (interactive run, temp folder)."""
    for notebook in NOTEBOOKS:
        declared = papermill.inspect_notebook(notebook)
        for name in RUNTIME_PARAMETERS:
            if name in declared:
                assert ast.literal_eval(declared[name]["default"]) == "", (notebook.name, name)


def test_drift_is_reported_with_notebook_key_and_both_values(tmp_path):
    book = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    cell = nbformat.v4.new_code_cell(
        "seed: int = 0  # ok\nmax_steps: int = 7  # drifted\nlearning_rate: float = 1  # an int, schema has a float"
    )
    cell.metadata["tags"] = ["parameters"]
    book.cells.append(cell)
    path = tmp_path / "99_drift.ipynb"
    nbformat.write(book, path)
    drift = default_drift(path)
    assert drift == [
        "99_drift.ipynb: 'max_steps' notebook default 7 != smoke.yaml's 6",
        "99_drift.ipynb: 'learning_rate' notebook default 1 != smoke.yaml's 0.005",
    ]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_parameters_cell_parses_without_a_papermill_warning(notebook, caplog):
    """papermill warns ``Unable to parse line`` (and drops the parameter) on a line with a second ``=`` (for example
    in its comment) at every run; every assignment line must come back as a parameter, with no warning."""
    (cell,) = [c for c in nbformat.read(notebook, as_version=4).cells if "parameters" in c.metadata.get("tags", [])]
    assigned = [line.split(":")[0].split("=")[0].strip() for line in cell.source.splitlines() if "=" in line]
    with caplog.at_level("WARNING", logger="papermill"):
        found = papermill.inspect_notebook(notebook)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("papermill")] == []
    assert list(found) == assigned


def test_parse_check_catches_a_second_equals_sign(tmp_path, caplog):
    notebook = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell('mask_type: str = "auto"  # auto (= patch)\nseed: int = 0  # seed')
    cell.metadata["tags"] = ["parameters"]
    notebook.cells = [cell]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "bad.ipynb"
    nbformat.write(notebook, path)
    with caplog.at_level("WARNING", logger="papermill"):
        assert list(papermill.inspect_notebook(path)) == ["seed"]
    assert any("Unable to parse line" in r.getMessage() for r in caplog.records)
