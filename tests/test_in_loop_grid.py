"""docs/performance.md's in-loop table of issue 55 (item 7) is what ``papo_nb.bench.in_loop_grid`` makes of the JSON
kept in docs/in_loop/: the whole grid, measured under checkpointing with sharing really on, each cell with a verdict
that follows from its numbers. Not a timed test: the timings are the committed measurement's."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from papo_nb.bench import in_loop, in_loop_grid

ROOT = Path(__file__).resolve().parents[1]
RELEASES, FAMILIES, GROUPS, COMPLETIONS = ("1.9.1", "1.16.0"), ("qwen2_5_vl", "qwen3_vl"), (5, 8), (256, 1024)


@pytest.fixture(scope="module")
def runs():
    return in_loop_grid.load(ROOT)


def test_committed_table_is_the_renderers_output_of_the_committed_json(runs):
    text = (ROOT / in_loop_grid.DOC).read_text()
    assert in_loop_grid.document(text, runs) == text, (
        "docs/performance.md's in-loop table is stale: python -m papo_nb.bench.in_loop_grid --write"
    )


def test_the_grid_is_whole_and_measured_where_sharing_ran_under_checkpointing(runs):
    cells = in_loop_grid.cells(runs)
    measured = sorted((run["trl"], run["family"], layout["G"], run["completion"]) for run, layout in cells)
    expected = sorted((t, f, g, r) for t in RELEASES for f in FAMILIES for g in GROUPS for r in COMPLETIONS)
    assert measured == expected
    for run, layout in cells:
        assert layout["gradient_checkpointing"] is True, (run["trl"], run["family"], layout["layout"])
        assert round(layout["R"]) == run["completion"]  # completions forced to their full length
        assert in_loop_grid.sharing_ran(layout) is None, (run["trl"], run["family"], layout["layout"])
        assert "gradient checkpointing on" in layout["papo_shared"]["forward_plan"]
        assert in_loop_grid.row(run, layout).endswith(f"| {in_loop_grid.verdict(run, layout)} |")
        assert in_loop_grid.verdict(run, layout).startswith(("met", "NOT met: "))


def test_a_verdict_follows_from_the_numbers(runs):
    run, layout = in_loop_grid.cells(runs)[0]
    key = "papo_shared/papo_rollout_no_sampling_cpu_s"
    faster = copy.deepcopy(layout)
    faster[key] = dict(median=0.9, min=0.85, max=0.95)
    faster["papo_shared"]["peak_mib"] = faster["papo_rollout"]["peak_mib"]
    assert in_loop_grid.verdict(run, faster) == "met"
    slower_once = copy.deepcopy(faster)
    slower_once[key]["max"] = 1.01
    assert in_loop_grid.verdict(run, slower_once).startswith("NOT met: slower in some round (max 1.010, median 0.900")
    slower = copy.deepcopy(faster)
    slower[key] = dict(median=1.02, min=0.99, max=1.1)
    assert in_loop_grid.verdict(run, slower).startswith("NOT met: slower at the median (")
    higher = copy.deepcopy(faster)
    higher["papo_shared"]["peak_mib"] += 3
    higher["papo_shared"]["peak_mib_runs"] = [max(faster["papo_rollout"]["peak_mib_runs"]) + 1]
    assert in_loop_grid.verdict(run, higher).startswith("NOT met: peak +3.0 MiB over plain, beyond the runs' spread")
    fell_back = copy.deepcopy(faster)
    fell_back["papo_shared"]["packed"] = 0.5
    assert in_loop_grid.verdict(run, fell_back).startswith("not a measurement of sharing: the shared variant ran")
    plain_packed = copy.deepcopy(faster)
    plain_packed["papo_rollout"]["forward_plan"] = faster["papo_shared"]["forward_plan"]
    assert in_loop_grid.verdict(run, plain_packed).startswith("not a measurement of sharing: the plain variant")


def test_the_benchmark_refuses_a_wide_build_that_does_not_exist(capsys):
    with pytest.raises(SystemExit):
        in_loop.parse_args(["--family", "qwen3_vl", "--size", "wide"])
    assert "--size=wide --family=qwen3_vl" in capsys.readouterr().err


TABLE_COMMANDS = (
    "papo_nb.bench.in_loop_grid",
    "papo_nb.bench.true_width_report",
    "papo_nb.workbook.recipe.forecast_table",
)


@pytest.mark.slow  # three interpreters
def test_the_table_commands_refuse_a_root_without_their_page_and_end_quietly_on_a_closed_pipe(tmp_path):
    for module in TABLE_COMMANDS:
        refused = subprocess.run(
            [sys.executable, "-m", module, "--root", str(tmp_path)], capture_output=True, text=True
        )
        assert refused.returncode == 2 and f"--root {str(tmp_path)!r} has no docs/" in refused.stderr, refused.stderr
    piped = subprocess.run(
        f"{sys.executable} -m papo_nb.bench.in_loop_grid | head -c 20", shell=True, cwd=ROOT, capture_output=True,
        text=True,
    )  # fmt: skip
    assert len(piped.stdout) == 20 and "Traceback" not in piped.stderr, piped.stderr
