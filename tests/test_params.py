"""The workbook's PAPO-G parameters are derived from PAPOGConfig: every field reachable, same defaults and rules."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from papo_nb.papo.papo_config import FIELD_RULES, PAPOGConfig, papo_fields
from papo_nb.workbook.config.params import (
    DERIVED_PAPO_FIELDS,
    PAPO_PARAM_FIELDS,
    WORKBOOK_PAPO_DEFAULTS,
    ParamsError,
    WorkbookParams,
    load_params,
    validate_params,
)

ROOT = Path(__file__).resolve().parents[1]


def test_every_papo_field_is_a_parameter_with_the_configs_default_and_help():
    own = {f.name for f in dataclasses.fields(PAPOGConfig)} - {
        f.name for f in dataclasses.fields(PAPOGConfig.__mro__[1])
    }
    assert own <= set(FIELD_RULES), "every field PAPOGConfig adds has a rule"
    for f in papo_fields():
        if f.name in DERIVED_PAPO_FIELDS:
            assert f.name not in WorkbookParams.model_fields
            continue
        schema = WorkbookParams.model_fields[f.name]
        assert schema.default == WORKBOOK_PAPO_DEFAULTS.get(f.name, f.default), f.name
        assert schema.description == f.metadata["help"], f.name
    assert set(PAPO_PARAM_FIELDS) == {f.name for f in papo_fields()} - set(DERIVED_PAPO_FIELDS)
    assert {"perception_loss_weight_final", "perception_annealing_ratio", "perception_kl_clamp"} <= set(
        PAPO_PARAM_FIELDS
    )
    assert {"mask_sharing", "entropy_estimator", "probe_max_degenerate_batches"} <= set(PAPO_PARAM_FIELDS)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("mask_ratio", 1.5, "expected a number in (0, 1]"),
        ("perception_kl_clamp", 0.0, "expected None or a finite number > 0"),
        ("perception_annealing_ratio", 0.0, "expected a number in (0, 1]"),
        ("mask_sharing", "batch", "'prompt' or 'completion'"),
        ("mask_fill", "grey", "'black' or 'mean'"),
        ("mask_excluded_column", "", "expected None or the name of a dataset column"),
        ("entropy_estimator", "exact", "'sampled' or 'full'"),
        ("loss_type", "ppo", "'grpo'"),
        ("perception_loss_weight_final", -1.0, "expected a finite number >= 0"),
        ("perception_loss_wieght", 0.1, "did you mean 'perception_loss_weight'?"),
    ],
)
def test_bad_papo_parameters_name_key_value_and_allowed(key, value, allowed):
    with pytest.raises(ParamsError) as info:
        validate_params({key: value}, "test.yaml")
    message = str(info.value)
    assert f"'{key}'" in message and repr(value) in message and allowed in message, message


def _other_value(name, default):
    field = next(f for f in papo_fields() if f.name == name)
    choices = field.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return not default
    if default is None:  # an optional number, or an optional name (mask_excluded_column)
        return "a_column" if str(field.type).startswith("str") else 0.2
    if isinstance(default, int):
        return default + 1
    return round(default + 0.01, 6)


@pytest.mark.model
def test_every_papo_parameter_reaches_the_config(tiny_vlm_path, tmp_path):
    from papo_nb.testbed.models import load_vlm
    from papo_nb.workbook.training.builder import papo_config

    _, processor = load_vlm(str(tiny_vlm_path))
    changed = {name: _other_value(name, WorkbookParams.model_fields[name].default) for name in PAPO_PARAM_FIELDS}
    params = validate_params({**changed, "device": "cpu", "seed": 7})
    args = papo_config(params, tmp_path, processor)
    for name, value in changed.items():
        assert getattr(args, name) == value, name
    assert args.mask_seed == 7, "mask_seed follows the workbook seed"


def test_existing_params_files_still_validate():
    assert load_params(ROOT / "params" / "smoke_fast.yaml").loss_type == "grpo"
    gpu = load_params(ROOT / "params" / "gpu.yaml")
    assert (gpu.original_entropy_weight, gpu.masked_entropy_weight, gpu.loss_type) == (0.0, 0.0, "bnpo")


@pytest.mark.slow
@pytest.mark.model
def test_linear_schedule_from_a_params_file_ends_at_the_final_weight(tmp_path):
    from papo_nb.workbook.training.builder import prepare_training

    path = tmp_path / "linear.yaml"
    settings = yaml.safe_load((ROOT / "params" / "smoke_fast.yaml").read_text())
    settings.update(
        max_steps=4,
        perception_loss_weight=0.04,
        perception_loss_schedule="linear",
        perception_loss_weight_final=0.01,
        perception_annealing_ratio=0.5,
        require_gpu_contract_probe=False,
    )
    path.write_text(yaml.safe_dump(settings))
    trainer, _, _ = prepare_training(load_params(path), tmp_path / "run", save_strategy="no")
    trainer.train()
    gammas = [h["perception_gamma"] for h in trainer.state.log_history if "perception_gamma" in h]
    assert gammas == pytest.approx([0.04, 0.025, 0.01, 0.01]), "anneals over half the run, then holds the final"
