"""A bad parameter's error says where its value came from (the params file, ``-p``, a default), suggests the nearest
name for a typo (difflib, and the paper's symbols: gamma), lists no parameter names wholesale and carries no library
prefix ("Value error, ")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from papo_nb.workbook.config.params import ParamsError, WorkbookParams, load_params

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "params" / "gpu.yaml"


def error(path, *overrides: str) -> str:
    with pytest.raises(ParamsError) as info:
        load_params(path, list(overrides))
    return str(info.value)


def test_a_typo_given_with_p_is_blamed_on_p_with_the_nearest_name_and_no_list_of_names():
    message = error(GPU, "lerning_rate=0.1")
    assert (
        message == "-p lerning_rate=0.1: unknown parameter 'lerning_rate' (value 0.1); did you mean 'learning_rate'?"
    )
    assert sum(f"'{name}'" in message for name in WorkbookParams.model_fields) == 1  # not ~110 names
    assert "did you mean 'perception_loss_weight'?" in error(None, "gamma=0.1")  # the paper's symbol
    assert "no parameter has a similar name" in error(None, "zzzqq=1")


def test_a_bad_value_names_the_file_or_the_override_it_came_from(tmp_path):
    params_file = tmp_path / "mine.yaml"
    params_file.write_text("mask_ratio: 1.5\nlearning_rat: 0.1\n")
    lines = sorted(error(params_file, "seed=three").splitlines())
    assert len(lines) == 3, lines
    assert lines[0].startswith("-p seed=three: parameter 'seed' = 'three' is invalid: Input should be a valid int")
    assert lines[1] == f"{params_file}: parameter 'mask_ratio' = 1.5 is invalid: expected a number in (0, 1] " + (
        "(Fraction of the image blacked out, in (0, 1].)"
    )
    assert lines[2] == f"{params_file}: unknown parameter 'learning_rat' (value 0.1); did you mean 'learning_rate'?"
    assert error(None, "mask_ratio=1.5").startswith("-p mask_ratio=1.5: parameter 'mask_ratio'")


def test_no_library_prefix_and_a_check_across_fields_says_where_each_value_was_set():
    message = error(None, "mask_ratio=2", "recipe=nope")
    assert "Value error" not in message and "Assertion failed" not in message, message
    assert "-p recipe=nope: parameter 'recipe' = 'nope' is invalid: unknown recipe; allowed:" in message
    across = error(None, "reward=math", "reward_weights=[1.0]")  # checked once every field is valid
    assert across.startswith("parameter 'reward_weights' = [1.0]: one weight per reward function"), across
    assert "Value error" not in across
    assert across.endswith("(reward_weights from -p reward_weights=[1.0])"), across
    nested = error(None, "study_params={mask_ratio: 2}")
    assert "Value error" not in nested and "mask_ratio: expected a number in (0, 1]" in nested, nested


@pytest.mark.slow
def test_papo_nb_train_reports_a_p_typo_as_the_override_with_a_suggestion(tmp_path):
    done = subprocess.run(
        [str(Path(sys.executable).parent / "papo-nb"), "train", "--params", str(GPU), "-p", "max_step=3",
         "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "papo-nb train: error: -p max_step=3: unknown parameter 'max_step' (value 3); did you mean 'max_steps'?"
    )
    assert not (tmp_path / "run").exists()


def test_a_later_check_naming_a_parameter_is_led_by_where_it_was_set(tmp_path):
    from papo_nb.workbook.config.param_errors import where_set

    params = load_params(GPU, ["dataset=/no/such/rows"])
    assert params.origin("dataset") == "-p dataset=/no/such/rows" and params.origin("model_name_or_path") == str(GPU)
    assert params.origin("mask_fill") == "default"
    message = "parameter 'dataset' = '/no/such/rows': no such file or folder"
    assert where_set(message, params.origin) == f"-p dataset=/no/such/rows: {message}"
    assert where_set("the folder already holds a run", params.origin) == "the folder already holds a run"
    assert params.model_copy(update={"max_steps": 2}).origin("dataset") == "-p dataset=/no/such/rows"
