"""The rehearsal at K = 1 with short completions (issue 53's CI check): a random-weight model at true Qwen2.5-VL-3B
widths trained two optimizer steps on the CPU through the params file's own trainer (``trainer.train()``), the
forecast within 15% of the measurement for every part it forecasts."""

from pathlib import Path

import pytest

from papo_nb.bench.rehearsal import FORECAST_ONLY, TOLERANCE, describe, run_rehearsal
from papo_nb.workbook.config.params import load_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("file", "overrides"),
    [
        # each file's images at its smallest bound (256 merged tokens) keep this test near three minutes on one core;
        # the full bounds: papo-nb rehearse FILE --layers 1 2 4 (docs/recipe.md)
        ("params/gpu.yaml", ["max_pixels=200704"]),
        ("params/recipes/papo_g_3b.yaml", ["max_pixels=200704"]),
    ],
)
def test_forecast_holds_against_the_trainer_at_one_layer(file, overrides):
    params = load_params(ROOT / file, overrides)
    result = run_rehearsal(params, layers=1, completion=8)
    text = describe(result)
    assert result["all_held"], text
    forecast_parts = [
        part for part, row in result["parts"].items() if row["forecast_bytes"] and part not in FORECAST_ONLY
    ]
    assert {"weights", "activations", "logprob_forward", "masked_forward", "generation", "round_tensors"} <= set(
        forecast_parts
    ), text
    for part in forecast_parts:  # a part the trainer path stopped measuring fails here, not as a ratio of inf
        row = result["parts"][part]
        assert row["measured_bytes"] > 0, f"{part} not measured\n{text}"
        assert abs(row["ratio"] - 1) <= TOLERANCE, f"{part}\n{text}"
    assert result["shortened"]["max_completion_length"]["rehearsal"] == 8
    assert result["seconds"]["loss_forward"] > 0 and result["seconds"]["backward"] > 0, text
    if not result["lora"]:  # full fine-tuning with beta > 0: TRL's reference model, bf16 as the recipe sets it
        assert params.reference_precision == "bf16"
        assert result["parts"]["reference"]["measured_bytes"] == pytest.approx(
            result["parts"]["weights"]["measured_bytes"]
        )
