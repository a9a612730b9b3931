"""docs/recipe.md's forecast table is the output of its command (papo_nb.workbook.recipe.forecast_table)."""

from papo_nb.workbook.recipe import forecast_table


def test_committed_table_is_the_commands_output():
    text = forecast_table.DOC.read_text()
    assert forecast_table.document(text) == text, (
        "docs/recipe.md's forecast table is stale: python -m papo_nb.workbook.recipe.forecast_table --write"
    )


def test_table_covers_every_file_model_and_gpu_count():
    lines = forecast_table.table().splitlines()[2:]
    assert len(lines) == len(forecast_table.FILES) * 2 * 4 * 2
    papo_3b_two = [r for r in lines if r.startswith("| papo_g_3b.yaml | Qwen2.5-VL-3B | 2 | 80 GB |")]
    # the recipe colocates vLLM, whose share of the GPU is held through training: the change named is vLLM's
    assert len(papo_3b_two) == 1 and "**no**" in papo_3b_two[0] and "vllm_gpu_memory_utilization" in papo_3b_two[0]
