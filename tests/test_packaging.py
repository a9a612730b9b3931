"""environment.yml and pyproject.toml must describe the same environment.

pyproject.toml is the source of truth. Every package in ``[project].dependencies`` and in the
``test`` extra must appear in environment.yml's ``pip:`` list with the same specifier set (and
nothing else may appear there), names compared after PEP 503 normalisation. The conda-level
``python`` pin must lie inside ``requires-python``.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
ENVIRONMENT = ROOT / "environment.yml"

# Extras of pyproject whose packages environment.yml lists explicitly.
EXTRAS_IN_ENVIRONMENT = ("test",)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def normalize(name: str) -> str:
    """PEP 503 name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _describe(req: Requirement | None) -> str:
    return "<absent>" if req is None else repr(str(req))


def _parse(lines: list[str], source: str) -> tuple[dict[str, Requirement], list[str]]:
    reqs: dict[str, Requirement] = {}
    problems: list[str] = []
    for line in lines:
        req = Requirement(line)
        key = normalize(req.name)
        if key in reqs:
            problems.append(f"{key}: listed twice in {source}: {_describe(reqs[key])} and {_describe(req)}")
        reqs[key] = req
    return reqs, problems


def compare_requirements(pyproject_reqs: list[str], environment_reqs: list[str]) -> list[str]:
    """Return one message per package on which the two lists disagree (empty: they agree).

    Each message names the package and both specs (``<absent>`` where a side lacks it).
    """
    py, problems = _parse(pyproject_reqs, "pyproject.toml")
    env, env_problems = _parse(environment_reqs, "environment.yml")
    problems += env_problems
    for key in sorted(py.keys() | env.keys()):
        a, b = py.get(key), env.get(key)
        if (
            a is None
            or b is None
            or a.specifier != b.specifier
            or {normalize(e) for e in a.extras} != {normalize(e) for e in b.extras}
            or str(a.marker or "") != str(b.marker or "")
            or a.url != b.url
        ):
            problems.append(f"{key}: pyproject.toml has {_describe(a)}, environment.yml has {_describe(b)}")
    return problems


def pyproject_requirements(pyproject: dict) -> list[str]:
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    extras = project.get("optional-dependencies", {})
    for extra in EXTRAS_IN_ENVIRONMENT:
        reqs += extras.get(extra, [])
    return reqs


def split_environment(env: dict) -> tuple[list[str], list[str], list[str]]:
    """-> (conda specs, pip requirement lines, pip option lines such as ``-e .``)."""
    conda: list[str] = []
    pip_lines: list[str] = []
    for dep in env.get("dependencies") or []:
        if isinstance(dep, dict):
            assert set(dep) == {"pip"}, f"unexpected mapping in dependencies: {dep!r}"
            pip_lines += [str(x).strip() for x in dep["pip"] or []]
        else:
            conda.append(str(dep).strip())
    requirements = [x for x in pip_lines if not x.startswith("-")]
    options = [x for x in pip_lines if x.startswith("-")]
    return conda, requirements, options


def conda_python_specifier(conda_specs: list[str]) -> SpecifierSet:
    """Translate the conda ``python`` match spec into a PEP 440 specifier set.

    ``python=3.11`` (conda's fuzzy match) means ``3.11.*``; ``python==3.11.7`` is exact; other
    operators (``>=3.11,<3.12``) carry over as they are.
    """
    found = [s for s in conda_specs if re.match(r"^python(\s|[=<>!~]|$)", s)]
    assert len(found) == 1, f"environment.yml must list python exactly once, found {found!r}"
    spec = found[0][len("python") :].strip().replace(" ", "")
    if not spec:
        return SpecifierSet()
    if spec.startswith("=") and not spec.startswith("=="):
        version = spec[1:].rstrip("*").rstrip(".")
        return SpecifierSet(f"=={version}.*")
    if re.fullmatch(r"[0-9][0-9.]*\*?", spec):  # "python 3.11.*" form
        return SpecifierSet(f"=={spec}" if spec.endswith("*") else f"=={spec}.*")
    return SpecifierSet(spec)


def python_disagreements(requires_python: str, conda_spec: SpecifierSet) -> list[str]:
    """Versions conda may install that requires-python forbids (empty: they agree)."""
    requires = SpecifierSet(requires_python)
    probes = [f"3.{minor}.{patch}" for minor in range(6, 21) for patch in (0, 1, 7, 15, 99)]
    allowed_by_conda = [v for v in probes if v in conda_spec]
    if not allowed_by_conda or len(allowed_by_conda) == len(probes):
        return [
            f"python: environment.yml pins {str(conda_spec) or '<any>'!r}, which should select "
            f"one CPython 3 series; pyproject.toml requires-python is {requires_python!r}"
        ]
    outside = [v for v in allowed_by_conda if v not in requires]
    if outside:
        return [
            f"python: environment.yml allows {str(conda_spec)!r} (e.g. {outside[0]}), "
            f"pyproject.toml requires-python is {requires_python!r}"
        ]
    return []


def load() -> tuple[dict, dict]:
    with PYPROJECT.open("rb") as fh:
        pyproject = tomllib.load(fh)
    env = yaml.safe_load(ENVIRONMENT.read_text())
    return pyproject, env


# --------------------------------------------------------------------------------------------
# the real files
# --------------------------------------------------------------------------------------------


def test_environment_yml_shape():
    _, env = load()
    assert env["name"] == "papo_nb"
    assert env["channels"] == ["conda-forge"]
    conda, _, options = split_environment(env)
    assert "pip" in conda, "environment.yml must install pip at the conda level"
    assert any(re.fullmatch(r"-e\s+\.(\[[\w,\s-]*\])?", o) for o in options), (
        f"environment.yml must install the project itself with '-e .', pip options are {options!r}"
    )


def test_pip_requirements_agree_with_pyproject():
    pyproject, env = load()
    _, env_reqs, _ = split_environment(env)
    problems = compare_requirements(pyproject_requirements(pyproject), env_reqs)
    assert not problems, "environment.yml disagrees with pyproject.toml:\n" + "\n".join(problems)


def test_python_version_agrees_with_requires_python():
    pyproject, env = load()
    conda, _, _ = split_environment(env)
    requires_python = pyproject["project"]["requires-python"]
    problems = python_disagreements(requires_python, conda_python_specifier(conda))
    assert not problems, "\n".join(problems)


def test_running_interpreter_satisfies_requires_python():
    pyproject, _ = load()
    requires_python = pyproject["project"]["requires-python"]
    assert platform.python_version() in SpecifierSet(requires_python), (
        f"tests run on Python {platform.python_version()}, pyproject.toml requires-python is {requires_python!r}"
    )


def test_readme_and_ci_share_the_test_command():
    """README's test command and .ci/run must be the same script, so they cannot drift."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", readme, flags=re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    assert "bash scripts/test.sh" in commands, commands
    assert "bash scripts/smoke.sh" in commands, commands
    ci = ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK), ".ci/run must be executable"
    ci_lines = [line.strip() for line in ci.read_text().splitlines()]
    assert any(line == "bash scripts/test.sh" or line.startswith("bash scripts/test.sh ") for line in ci_lines), (
        ".ci/run must run README's test command `bash scripts/test.sh`"
    )
    for script in ("test.sh", "smoke.sh"):
        assert (ROOT / "scripts" / script).is_file(), script


def test_ci_lints_after_install_and_before_the_tests():
    """.ci/run installs (ruff is in the [test] extra), runs both ruff checks, then the tests; set -e fails it."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "set -euo pipefail" in lines
    order = [
        lines.index("bash scripts/test.sh --setup-only"),
        lines.index(".venv/bin/ruff check ."),
        lines.index(".venv/bin/ruff format --check ."),
        lines.index("bash scripts/test.sh"),
    ]
    assert order == sorted(order), order
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(req.startswith("ruff") for req in project["project"]["optional-dependencies"]["test"])
    assert project["tool"]["ruff"]["line-length"] == 119


# --------------------------------------------------------------------------------------------
# the checker itself
# --------------------------------------------------------------------------------------------


def test_compare_detects_a_changed_pin_in_a_modified_environment_yml(tmp_path):
    pyproject, _ = load()
    text = ENVIRONMENT.read_text()
    assert "torch==2.14.1" in text
    modified = tmp_path / "environment.yml"
    modified.write_text(text.replace("torch==2.14.1", "torch==2.13.0", 1))
    _, env_reqs, _ = split_environment(yaml.safe_load(modified.read_text()))
    problems = compare_requirements(pyproject_requirements(pyproject), env_reqs)
    assert len(problems) == 1, problems
    assert problems[0].startswith("torch:")
    assert "torch==2.14.1" in problems[0] and "torch==2.13.0" in problems[0]


def test_compare_detects_missing_extra_and_changed_packages():
    pyproject, env = load()
    py_reqs = pyproject_requirements(pyproject)
    _, env_reqs, _ = split_environment(env)
    modified = [r for r in env_reqs if normalize(Requirement(r).name) != "mlflow"]
    modified = [r.replace("peft>=0.21.2,<0.22", "peft>=0.21.2") for r in modified]
    modified.append("requests>=2")
    problems = compare_requirements(py_reqs, modified)
    by_name = {p.split(":", 1)[0]: p for p in problems}
    assert set(by_name) == {"mlflow", "peft", "requests"}, problems
    assert "<absent>" in by_name["mlflow"] and "mlflow" in by_name["mlflow"]
    assert "'peft<0.22,>=0.21.2'" in by_name["peft"] and "'peft>=0.21.2'" in by_name["peft"]
    assert "pyproject.toml has <absent>" in by_name["requests"]


def test_compare_normalises_names_and_ignores_specifier_order():
    assert (
        compare_requirements(
            ["PyYAML>=6.0,<7", "typing_extensions>=4", "Pillow==13.0.0", "zope.interface>=6"],
            ["pyyaml<7,>=6.0", "typing-extensions>=4", "pillow==13.0.0", "Zope-Interface>=6"],
        )
        == []
    )


def test_compare_flags_duplicates_extras_and_markers():
    problems = compare_requirements(
        ["a>=1", "b[x]>=1", "c>=1; python_version < '4'"],
        ["a>=1", "A>=2", "b>=1", "c>=1"],
    )
    joined = "\n".join(problems)
    assert "a: listed twice in environment.yml" in joined
    assert any(p.startswith("b:") for p in problems)
    assert any(p.startswith("c:") for p in problems)


@pytest.mark.parametrize(
    "conda, requires, ok",
    [
        ("python=3.11", ">=3.11,<3.12", True),
        ("python=3.11", ">=3.10", True),
        ("python==3.11.7", ">=3.11,<3.12", True),
        ("python 3.11.*", ">=3.11,<3.12", True),
        ("python=3.12", ">=3.11,<3.12", False),
        ("python=3.10", ">=3.11,<3.12", False),
        ("python>=3.11", ">=3.11,<3.12", False),
        ("python", ">=3.11,<3.12", False),
    ],
)
def test_python_check_detects_disagreement(conda, requires, ok):
    problems = python_disagreements(requires, conda_python_specifier(["pip", conda]))
    assert (problems == []) is ok, problems
    if not ok:
        assert requires in problems[0]


CONFLICT_MARKER = re.compile(r"^(<{7}|>{7}) ", re.MULTILINE)


def conflict_markers(text: str) -> list[int]:
    """The line numbers of a merge's conflict markers (``<<<<<<< ours`` / ``>>>>>>> theirs``) left in ``text``."""
    return [text.count("\n", 0, m.start()) + 1 for m in CONFLICT_MARKER.finditer(text)]


def test_no_tracked_file_keeps_a_merge_conflict():
    """A merge once left both sides of a README section between conflict markers, and every test still passed."""
    assert conflict_markers("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\n") == [2, 6]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    texts = [p for p in tracked if p.endswith((".md", ".py", ".ipynb", ".yaml", ".yml", ".toml", ".sh", ".txt"))]
    assert len(texts) > 100
    found = {p: lines for p in texts if (lines := conflict_markers((ROOT / p).read_text(encoding="utf-8")))}
    assert not found, f"merge conflict markers left in (file: lines): {found}"


def test_every_test_ci_deselects_exists():
    """pytest ignores a ``--deselect`` that names no test, so a renamed test would run again silently in CI's second
    stage; each one named in .ci/run must be a test function in its file."""
    nodes = re.findall(r"--deselect (tests/\S+\.py)::(\w+)", (ROOT / ".ci" / "run").read_text())
    assert len(nodes) >= 4
    missing = [f"{path}::{name}" for path, name in nodes if f"\ndef {name}(" not in (ROOT / path).read_text()]
    assert not missing, f".ci/run deselects tests that do not exist: {missing}"
