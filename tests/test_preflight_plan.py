"""The one preflight (papo_nb.workbook.recipe.check, ``papo-nb preflight``): every change that makes a run fit as one
plan, each departure from the recipe and each batch change marked; the data and batch refusals offline, in time."""

import os
import subprocess
import sys
import time
from pathlib import Path

from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.recipe.check import plan_lines, preflight
from papo_nb.workbook.recipe.forecast import GIB

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "params" / "recipes"
NO_LEVERS = [
    "accelerate_config=configs/accelerate/fsdp.yaml",
    "reference_precision=fp32",
    "vllm_enable_sleep_mode=false",
]


def test_the_plan_lists_every_lever_at_once_and_marks_what_departs_from_the_recipe():
    result = preflight(load_params(RECIPES / "papo_g_3b.yaml", NO_LEVERS), 80 * GIB, read_data=False, root=ROOT)
    assert result.fits is False
    assert [c.parameter for c in result.plan] == ["vllm_enable_sleep_mode", "reference_precision", "accelerate_config"]
    assert result.planned.total <= 0.92 * 80 * GIB  # the three together fit; none alone did before
    text = "\n".join(plan_lines(result, "papo_g_3b"))
    assert "departs from recipe" not in text  # each change goes back to the recipe file's value
    moved_params = load_params(RECIPES / "papo_g_3b.yaml", [*NO_LEVERS, "recipe="])
    moved = preflight(moved_params, 80 * GIB, read_data=False, root=ROOT)
    assert "departs" not in "\n".join(plan_lines(moved, ""))


def test_a_batch_change_is_said_and_keeps_the_completions_per_step_and_round():
    overrides = ["per_device_train_batch_size=16", "gradient_accumulation_steps=8", "steps_per_generation=24"]
    result = preflight(load_params(RECIPES / "vppo_7b.yaml", overrides), 80 * GIB, read_data=False, root=ROOT)
    (change,) = result.plan
    assert change.batch and (change.old, change.new) == (16, 8)
    assert change.also == {"gradient_accumulation_steps": 16, "steps_per_generation": 48}
    line = plan_lines(result, "vppo_7b")[1]
    assert "BATCH CHANGE" in line and "departs from recipe" not in line  # 8 is the shipped file's micro-batch
    assert "-p gradient_accumulation_steps=16 -p steps_per_generation=48" in line


def test_preflight_refuses_offline_and_in_time_a_dataset_without_answer_and_a_split_prompt_group(tmp_path):
    from papo_nb.testbed.official_schema import make_official_schema_dataset

    make_official_schema_dataset(8, seed=0).remove_columns("answer").save_to_disk(str(tmp_path / "rows"))
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "papo_nb.cli", "preflight", str(RECIPES / "tiny_cpu.yaml"),
         "-p", f"dataset={tmp_path / 'rows'}", "-p", "per_device_train_batch_size=7"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    assert time.monotonic() - started < 30
    assert out.returncode == 1, out.stderr
    batch = "problem: parameter 'per_device_train_batch_size' = 7: must be a multiple of num_generations = 5"
    assert batch in out.stdout and "missing column(s) ['answer']" in out.stdout
    assert f"parameter 'dataset' = '{tmp_path / 'rows'}'" in out.stdout


def test_preflight_counts_the_optimizer_steps_an_epoch_of_the_rows_read_gives(tmp_path):
    from papo_nb.testbed.official_schema import make_official_schema_dataset

    make_official_schema_dataset(9, seed=0).save_to_disk(str(tmp_path / "rows"))
    params = load_params(RECIPES / "tiny_cpu.yaml", [f"dataset={tmp_path / 'rows'}", "n_train_prompts=9"])
    result = preflight(params, None)
    assert result.problems == [] and result.fits is None  # no GPU memory given: no verdict
    # 4 prompts per round, 2 optimizer steps each: 9 rows give 2 whole rounds, 4 steps; max_steps 2 covers half
    assert result.estimates == {
        "rows": 9,
        "optimizer_steps_per_epoch": 4,
        "epochs_at_max_steps": 0.5,
        "completion_tokens_at_most": 2 * 10 * 16,
    }  # fmt: skip (steps x completions x tokens)
