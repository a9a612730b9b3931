"""The package's layers, read from every module's imports (``ast``; lazy imports inside functions count too).

Bottom to top: prefix_sharing (a feature of any GRPOTrainer) < papo (the PAPO-G adapter, built on it) < vppo (the
second masked-branch method, on PAPO-G's) < testbed < workbook < infra < train < bench < cli. A module imports its
own layer and the layers below, never one above, so data flows down the tree. The three method packages may import
only the standard library, torch, transformers, trl and peft: they are what a TRL user lifts into their own
project.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "papo_nb"
LAYERS = ("prefix_sharing", "papo", "vppo", "testbed", "workbook", "infra", "train", "bench", "cli")
METHOD_LAYERS = ("prefix_sharing", "papo", "vppo")
ADAPTER_THIRD_PARTY = frozenset({"torch", "transformers", "trl", "peft"})
# vLLM: only inside a function, so that only the vLLM path imports it (papo_nb/papo/vllm_rollouts.py)
ADAPTER_LAZY = frozenset({"vllm"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    """``papo_nb.<layer>[...]`` -> layer; the root package (only its version) belongs to none."""
    parts = module.split(".")
    return parts[1] if parts[0] == "papo_nb" and len(parts) > 1 else None


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, relative ones resolved against ``module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((node.lineno, name))
    return found


def function_import_lines(source: str) -> set[int]:
    """The lines of the imports that run only when a function is called."""
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return {n.lineno for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Why ``module`` (with this ``source``) breaks the layering; empty when it does not."""
    own = layer(module)
    if own is None:
        return []
    problems = []
    lazy = function_import_lines(source)
    for line, name in imported_modules(source, module, is_package):
        top = name.split(".")[0]
        target = layer(name)
        allowed = sys.stdlib_module_names | ADAPTER_THIRD_PARTY | (ADAPTER_LAZY if line in lazy else set())
        if own in METHOD_LAYERS and top != "papo_nb" and top not in allowed:
            problems.append(
                f"{module}:{line} imports {name}: the adapter may import only the standard library, "
                f"{', '.join(sorted(ADAPTER_THIRD_PARTY))}"
            )
        if target is not None and LAYERS.index(target) > LAYERS.index(own):
            problems.append(
                f"{module}:{line} imports {name}: layer {own!r} is below {target!r} ({' < '.join(LAYERS)})"
            )
    return problems


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_layer():
    assert {layer(module_name(p)) for p in MODULES} - {None} == set(LAYERS)
    assert [p for p in PACKAGE.iterdir() if p.suffix == ".py"] and all(
        p.stem in ("__init__", "cli") for p in PACKAGE.iterdir() if p.suffix == ".py"
    ), "a module directly under papo_nb/ other than cli.py: put it in its layer's subpackage"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_imports_respect_the_layers(path):
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("papo_nb.papo.x", "import mlflow", "imports mlflow: the adapter may import only"),
        ("papo_nb.papo.x", "from vllm import LLM", "imports vllm: the adapter may import only"),
        ("papo_nb.papo.x", "def f():\n    import papermill.utils", "imports papermill.utils: the adapter"),
        ("papo_nb.papo.x", "from matplotlib.figure import Figure", "imports matplotlib.figure"),
        ("papo_nb.papo.x", "from papo_nb.workbook import params", "layer 'papo' is below 'workbook'"),
        (
            "papo_nb.testbed.x",
            "def f():\n    from papo_nb.workbook.study.stats import m",
            "'testbed' is below 'workbook'",
        ),
        ("papo_nb.workbook.x", "from papo_nb.infra.tracking import log_evidence", "'workbook' is below 'infra'"),
        ("papo_nb.infra.x", "import papo_nb.train.runner", "'infra' is below 'train'"),
        ("papo_nb.train.x", "from papo_nb.bench.harness import make_trainer", "'train' is below 'bench'"),
        ("papo_nb.bench.x", "from papo_nb.cli import main", "'bench' is below 'cli'"),
        ("papo_nb.workbook.x", "from ..infra import tracking", "imports papo_nb.infra: layer 'workbook'"),
    ],
)
def test_a_violation_is_caught_and_named(module, source, expected):
    found = violations(source, module)
    assert len(found) == 1 and expected in found[0], found


CORE = "papo_nb.papo"
PROBE = "papo_nb.papo.probe"


def core_imports_of_the_probe(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports by which a module of the adapter's core (``papo/`` outside ``papo/probe/``) reaches the probe."""
    if not module.startswith(CORE) or module == PROBE or module.startswith(PROBE + "."):
        return []
    return [
        f"{module}:{line} imports {name}: the core reaches the probe only through loss_observer.training_observer"
        for line, name in imported_modules(source, module, is_package)
        if name == PROBE or name.startswith(PROBE + ".")
    ]


@pytest.mark.parametrize("path", [p for p in MODULES if module_name(p).startswith(CORE)], ids=lambda p: p.name)
def test_the_core_never_imports_the_probe(path):
    assert core_imports_of_the_probe(path.read_text(), module_name(path), path.name == "__init__.py") == []


def test_a_core_import_of_the_probe_is_caught():
    lazy = "def f():\n    from .probe import GammaZeroProbe\n"
    assert len(core_imports_of_the_probe(lazy, "papo_nb.papo.papo_trainer")) == 1
    assert core_imports_of_the_probe("from ..fsdp import sharded\n", "papo_nb.papo.probe.reduce") == []


def test_allowed_imports_pass():
    adapter = (
        "import torch\nfrom trl import GRPOTrainer\nfrom peft import PeftModel\nimport json\nfrom . import masking"
    )
    assert violations(adapter, "papo_nb.papo.x") == []
    assert violations("from papo_nb.papo import PAPOGConfig\nimport mlflow", "papo_nb.infra.x") == []
    assert violations("from papo_nb.cli import main", "papo_nb.cli") == []


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the package modules it imports; ``from pkg import mod`` names the submodule, not ``pkg``."""
    graph = {}
    for module, (source, is_package) in sources.items():
        targets = set()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = [name for _, name in imported_modules(ast.unparse(node), module, is_package)]
            if isinstance(node, ast.ImportFrom):
                submodules = {f"{names[0]}.{alias.name}" for alias in node.names} & sources.keys()
                targets |= submodules or ({names[0]} & sources.keys())
            else:
                targets |= set(names) & sources.keys()
        graph[module] = targets - {module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycle_inside_the_package():
    sources = {module_name(p): (p.read_text(), p.name == "__init__.py") for p in MODULES}
    assert import_cycles(import_graph(sources)) == []


def test_a_lazy_import_cycle_is_caught():
    sources = {
        "papo_nb.workbook.a": ("from papo_nb.workbook import b\n", False),
        "papo_nb.workbook.b": ("def f():\n    from papo_nb.workbook.c import x\n", False),
        "papo_nb.workbook.c": ("def g():\n    from .a import y\n", False),
        "papo_nb.workbook": ("", True),
    }
    assert import_cycles(import_graph(sources)) == [["papo_nb.workbook.a", "papo_nb.workbook.b", "papo_nb.workbook.c"]]


# "Functions near one screen, modules near 400 lines": the ceilings a change must not cross without a split.
FUNCTION_MAX_LINES = 60
MODULE_MAX_LINES = 450


def long_functions(source: str, limit: int = FUNCTION_MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function in ``source`` longer than ``limit`` lines, decorators and docstring included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if node.end_lineno - start + 1 > limit:
                found.append((node.name, node.end_lineno - start + 1))
    return found


def test_every_function_fits_one_screen_and_every_module_stays_near_400_lines():
    too_long = [
        f"{module_name(p)}.{name}: {lines} lines" for p in MODULES for name, lines in long_functions(p.read_text())
    ]
    assert too_long == [], f"split these functions (over {FUNCTION_MAX_LINES} lines): {too_long}"
    big = {module_name(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES}
    assert big == {}, f"split these modules (over {MODULE_MAX_LINES} lines): {big}"


def test_a_long_function_is_caught():
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_MAX_LINES))
    assert long_functions(f"@decorator\ndef f():\n{body}\ndef g():\n    return 1\n") == [("f", FUNCTION_MAX_LINES + 2)]
