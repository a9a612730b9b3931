"""The rehearsal at K = 1 with short completions (issue 53's CI check): a random-weight model at true Qwen2.5-VL-3B
widths trained two optimizer steps on the CPU, the forecast within 15% of the measurement per part."""

from pathlib import Path

import pytest

from papo_nb.bench.rehearsal import TOLERANCE, describe, run_rehearsal
from papo_nb.workbook.config.params import load_params

ROOT = Path(__file__).resolve().parents[1]
HELD = ("weights", "gradients", "optimizer", "activations", "logprob_forward", "masked_forward", "generation",
        "round_tensors")  # fmt: skip


@pytest.mark.parametrize(
    ("file", "overrides"),
    [
        # each file's images at its smallest bound (256 merged tokens; gpu.yaml's prompts at 1024 tokens) keep this
        # test near a minute on one core; the full bounds: papo-nb rehearse FILE --layers 1 2 4 (docs/recipe.md)
        ("params/gpu.yaml", ["max_pixels=200704", "max_prompt_length=1024"]),
        ("params/recipes/papo_g_3b.yaml", ["max_pixels=200704"]),
    ],
)
def test_forecast_holds_against_the_rehearsal_at_one_layer(file, overrides):
    params = load_params(ROOT / file, overrides)
    result = run_rehearsal(params, layers=1, completion=8)
    text = describe(result)
    assert result["all_held"], text
    for part in HELD:
        row = result["parts"][part]
        assert row["measured_bytes"] > 0, f"{part} not measured\n{text}"
        assert abs(row["ratio"] - 1) <= TOLERANCE, text
    assert result["shortened"]["max_completion_length"]["rehearsal"] == 8
    if not result["lora"]:  # full fine-tuning with beta > 0: TRL's fp32 reference model
        assert result["parts"]["reference"]["measured_bytes"] == pytest.approx(
            2 * result["parts"]["weights"]["measured_bytes"]
        )
