"""The rehearsal at K = 1 with short completions, CI's check of the memory forecast: a random-weight model at true
Qwen2.5-VL-3B widths trained two optimizer steps on the CPU through the params file's own trainer
(``trainer.train()``), the forecast within 15% of the measurement for every part it forecasts. Those runs take about
three minutes each on one core, so they sit in the slow tier; the committed rehearsal files are read back in the
fast one."""

from pathlib import Path

import pytest

from papo_nb.bench.rehearsal import FORECAST_ONLY, TOLERANCE, describe, run_rehearsal
from papo_nb.workbook.config.params import load_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


def test_the_bf16_reference_saving_measured_through_the_trainer_is_the_forecasts():
    """docs/rehearsal/papo_g_3b_max_pixels_200704_reference_{bf16,fp32}_K1_2.json (papo-nb rehearse
    params/recipes/papo_g_3b.yaml -p max_pixels=200704 -p reference_precision=... --layers 1 2 --json ...): the
    lever's saving, fp32 reference less bf16, measured within 15% of its forecast at each depth."""
    import json

    def runs(precision):
        name = f"papo_g_3b_max_pixels_200704_reference_{precision}_K1_2.json"
        return json.loads((ROOT / "docs" / "rehearsal" / name).read_text())

    for bf16, fp32 in zip(runs("bf16"), runs("fp32"), strict=True):
        assert bf16["layers"] == fp32["layers"] and bf16["all_held"] and fp32["all_held"]
        measured, forecast = (
            fp32["parts"]["reference"][key] - bf16["parts"]["reference"][key]
            for key in ("measured_bytes", "forecast_bytes")
        )
        assert measured > 0 and abs(forecast / measured - 1) <= TOLERANCE
        assert measured == pytest.approx(bf16["parts"]["reference"]["measured_bytes"])  # the fp32 copy halved
