"""docs/recipe.md's forecast tables are the output of their command (papo_nb.workbook.recipe.forecast_table), and
params/gpu.yaml's figures are the forecast's."""

import re
from pathlib import Path

from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.recipe import forecast_table
from papo_nb.workbook.recipe.forecast import GIB, forecast

ROOT = Path(__file__).resolve().parents[1]


def test_committed_table_is_the_commands_output():
    text = (ROOT / forecast_table.DOC).read_text()
    assert forecast_table.document(text, ROOT) == text, (
        "docs/recipe.md's forecast table is stale: python -m papo_nb.workbook.recipe.forecast_table --write"
    )


def test_the_authors_gpus_come_first_before_and_after_and_every_file_scales():
    lines = [line for line in forecast_table.table(ROOT).splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line for line in lines if not line.startswith("| file |")]
    authors, scale = rows[: 2 * len(forecast_table.RECIPES)], rows[2 * len(forecast_table.RECIPES) :]
    assert len(scale) == len(forecast_table.FILES) * 4 * 2
    assert authors[0].startswith("| grpo_3b.yaml before | 2 | 80 GB | none | **no** |")
    assert authors[3].startswith("| papo_g_3b.yaml | 2 | 80 GB | vLLM sleep, bf16 reference, CPU offload | yes |")
    assert all("| yes |" in r for r in authors[1::2]) and all("| **no** |" in r for r in authors[::2])
    # each 'before' row's plan is the levers the shipped file sets
    assert "-p accelerate_config=configs/accelerate/fsdp_offload.yaml" in authors[2]
    assert "-p per_device_train_batch_size=8" in authors[8]


def test_gpu_yaml_quotes_the_forecasts_peak():
    path = ROOT / "params" / "gpu.yaml"
    pattern = r"forecast's peak is ([\d.]+) GiB per GPU beside colocated vLLM's ([\d.]+) GiB"
    quoted = re.search(pattern, path.read_text())
    fc = forecast(load_params(path), 80 * GIB)
    assert quoted, "params/gpu.yaml no longer quotes the forecast"
    assert (float(quoted[1]), float(quoted[2])) == (round(fc.total / GIB, 1), round(fc.parts["generation"] / GIB, 1))
