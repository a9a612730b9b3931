"""docs/performance.md's true-width table and its "In short" sentence are what
``papo_nb.bench.true_width_report`` makes of docs/in_loop/true_width.json; the JSON holds the required cell
(Qwen2.5-VL-3B, G 5, 1,003,520 pixels), measured under checkpointing, one thread, every number finite; the FLOP
model's step (``true_width_model``) reduces to what it must where sharing has nothing to share. Not a timed test: the
timings are the committed measurement's."""

import copy
from pathlib import Path

import pytest

from papo_nb.bench import true_width, true_width_model, true_width_report
from papo_nb.prefix_sharing import attention_cost
from papo_nb.workbook.recipe.architectures import published_config, with_depth

ROOT = Path(__file__).resolve().parents[1]
KEYS = (
    "family", "layers", "num_generations", "max_pixels", "completion_length", "shared_over_plain", "shared_over_grpo",
    "model_shared_over_plain", "auto_decision", "P", "R", "variants",
)  # fmt: skip


@pytest.fixture(scope="module")
def results():
    return true_width_report.load(ROOT)


def test_committed_page_is_the_renderers_output_of_the_committed_json(results):
    text = (ROOT / true_width_report.DOC).read_text()
    assert true_width_report.document(text, results) == text, (
        "docs/performance.md's true-width table is stale: python -m papo_nb.bench.true_width_report --write"
    )


def test_the_json_holds_the_required_cells_measured_as_the_issue_asks(results):
    assert results["threads"] == 1 and all(run["threads"] == 1 for run in results["runs"])
    assert true_width_report.finite(results)
    required = true_width_report.required_cells(results)
    assert sorted(r["completion_length"] for r in required) == [256, 1024]
    for record in results["cells"]:
        assert all(key in record for key in KEYS), record["cell"]
        assert record["gradient_checkpointing"] is True
        assert round(record["R"]) == record["completion_length"]  # completions forced to their full length
        for ratio in (record["shared_over_plain"], record["shared_over_grpo"]):
            assert ratio["min"] <= ratio["median"] <= ratio["max"]
            assert len(ratio["rounds"]) == record["repeats"]
        for variant in true_width_report.VARIANTS:
            assert record["variants"][variant]["peak_mib"] > 0
        assert record["variants"]["papo_rollout"]["packed"] == 0.0  # plain PAPO-G never packed
        if record["auto_decision"] == "shared":
            assert record["variants"]["papo_shared"]["packed"] == 1.0


def test_the_15_percent_column_follows_from_the_numbers(results):
    record = copy.deepcopy(results["cells"][0])
    record["model_shared_over_plain"] = record["shared_over_plain"]["median"] * 1.14
    assert true_width_report.within_model(record)
    record["model_shared_over_plain"] = record["shared_over_plain"]["median"] * 1.2
    assert not true_width_report.within_model(record)
    assert true_width_report.row(record).endswith("| NO |")


def test_the_step_model_at_one_completion_per_prompt_is_the_plain_step():
    config = with_depth(published_config(true_width.QWEN25_3B), 1)
    one = true_width_model.step(config, true_width.Cell(num_generations=1), 1308.0, 256.0)
    assert one["shared_over_plain"] == pytest.approx(1.0)
    five = true_width_model.step(config, true_width.Cell(), 1308.0, 256.0)
    widths = attention_cost.TextWidths.of(config.get_text_config())
    decoder = attention_cost.per_group(widths, 1308, 256, 5, padded=False)
    assert five["decoder_only_shared_over_plain"] == pytest.approx(decoder["grouped"] / decoder["plain"])
    # the head (same on both paths) pulls the step's ratio toward 1; sharing's one image pulls it down
    assert five["decoder_only_shared_over_plain"] < five["shared_over_plain"] < 1.0


def test_the_benchmark_refuses_a_malformed_cell(capsys):
    with pytest.raises(SystemExit):
        true_width.parse_args(["--cells", "1:5:1003520"])
    assert "--cells entry '1:5:1003520'" in capsys.readouterr().err


def test_readme_quotes_the_required_cells_as_the_table_has_them(results):
    readme = (ROOT / "README.md").read_text()
    required = sorted(true_width_report.required_cells(results), key=lambda r: r["completion_length"])
    assert [r["completion_length"] for r in required] == [256, 1024]
    for record in required:
        assert f"{record['shared_over_plain']['median']:.2f}x" in readme, record["cell"]
