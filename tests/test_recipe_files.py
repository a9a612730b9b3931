"""The recipe files validate, agree with the PAPO-G presets, reproduce the official batches, and the preflight
names the parameter to change when a run cannot fit."""

from pathlib import Path

import pytest

from papo_nb.papo.recipes import RECIPES
from papo_nb.testbed.models import build_tiny_processor
from papo_nb.workbook.config.batch_layout import batch_deviations, batch_layout, check_batches
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.recipe import check
from papo_nb.workbook.recipe import data as rd
from papo_nb.workbook.recipe.presets import config_fields, recipe_deviations, recipe_fields

ROOT = Path(__file__).resolve().parents[1]
GPU_RECIPES = ("papo_g_3b", "grpo_3b", "papo_g_7b", "grpo_7b")
GIB = 1024**3


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_validates_and_matches_its_preset(name):
    params = load_params(ROOT / "params" / "recipes" / f"{name}.yaml")
    assert params.recipe == name
    assert recipe_deviations(params) == {}  # every exposed preset field is in the file, unchanged
    assert params.dataset == rd.TRAIN_DATASET and params.validation_dataset == rd.VALIDATION_DATASET
    assert params.dataset_schema == "official" and params.format_prompt == "math_perception"
    assert (params.min_pixels, params.max_pixels, params.max_prompt_length) == (200704, 1003520, 4096)
    assert params.finetuning == "full" and not params.freeze_vision_tower
    assert params.use_vllm and params.vllm_mode == "colocate"  # the official runs generate with vLLM
    layout = batch_layout(params)
    assert layout["prompts_per_generation"] == 384 and layout["prompts_per_optimizer_step"] == 128
    assert layout["optimizer_steps_per_generation"] == 3
    assert check_batches(params, layout) == [] and batch_deviations(params, layout) == []
    assert params.eval_samples == 8 and len(params.eval_benchmarks) == 8
    assert params.model_name_or_path == f"Qwen/Qwen2.5-VL-{name[-2:].upper()}-Instruct"


def test_baselines_switch_the_perception_terms_off_and_papo_keeps_them():
    assert recipe_fields("grpo_3b")["perception_loss_weight"] == 0.0
    assert recipe_fields("grpo_7b")["original_entropy_weight"] == 0.0
    assert recipe_fields("papo_g_3b")["perception_loss_weight"] == RECIPES["papo_g_3b"]["perception_loss_weight"]
    assert recipe_fields("papo_g_7b")["masked_entropy_weight"] == 0.05
    # fields the params do not expose reach the config from the preset
    params = load_params(ROOT / "params" / "recipes" / "papo_g_3b.yaml")
    hidden = config_fields(params)
    assert hidden["epsilon_high"] == 0.3 and hidden["top_p"] == 0.99 and hidden["weight_decay"] == 0.01
    assert hidden["delta"] == 3.0 and hidden["lr_scheduler_type"] == "constant"


def test_tiny_recipe_reports_its_deviations():
    params = load_params(ROOT / "params" / "recipes" / "tiny_cpu.yaml")
    assert set(recipe_deviations(params)) == {"learning_rate", "max_completion_length"}
    assert len(batch_deviations(params, batch_layout(params))) == 2


def test_unknown_recipe_is_refused_naming_the_choices():
    from papo_nb.workbook.config.params import ParamsError

    with pytest.raises(ParamsError, match=r"'recipe' = 'papo_g_13b'.*allowed: '', 'papo_g_3b'"):
        load_params(ROOT / "params" / "recipes" / "papo_g_3b.yaml", ["recipe=papo_g_13b"])


def official_rows(n: int):
    """``n`` rows of the official schema's columns (the run-length and column checks read no image)."""
    import datasets

    return datasets.Dataset.from_dict({"problem": ["<image>x"] * n, "answer": ["1"] * n, "images": [[]] * n})


def test_preflight_counts_the_official_epochs_and_names_too_few_rows():
    params = load_params(ROOT / "params" / "recipes" / "papo_g_3b.yaml")
    estimates = check.run_length(params, official_rows(38_870))
    assert estimates["optimizer_steps_per_epoch"] == 303  # 38870 // 384 = 101 whole rounds x 3
    assert estimates["epochs_at_max_steps"] == 2.0  # the file's 606 steps are the official 2 epochs
    assert estimates["completion_tokens_at_most"] == 606 * 128 * 5 * 2048
    assert check.data_problems(params, official_rows(38_870)) == []
    too_few = check.data_problems(params, official_rows(6))
    assert too_few == [
        "parameter 'dataset' = 'PAPOGalaxy/PAPO_ViRL39K_train': 6 rows, fewer than one rollout round of 384 prompts; "
        "use more rows or lower steps_per_generation"
    ]


def test_preflight_names_what_to_change():
    params = load_params(ROOT / "params" / "recipes" / "papo_g_7b.yaml", ["accelerate_config=''"])
    assert check.gpu_problems(params, here=1) == [
        "parameter 'num_processes' = 4: 1 GPU(s) here; set num_processes <= 1 (and raise gradient_accumulation_steps "
        "and steps_per_generation to keep the batches)"
    ]
    result = check.preflight(params, 80 * GIB, read_data=False)  # DDP: every process holds the whole model
    assert result.fits is False and not result.forecast.setting.fsdp
    lines = check.plan_lines(result, params.recipe)
    assert lines[0].startswith("plan: 1 change(s) are not enough, peak 119.2 GiB")  # no offload without FSDP
    assert "-p vllm_gpu_memory_utilization=0.3" in lines[1] and "fsdp_offload" not in "\n".join(lines)


def test_preflight_checks_columns_and_image_tokens():
    import datasets

    params = load_params(ROOT / "params" / "recipes" / "tiny_cpu.yaml", ["max_prompt_length=20", "n_train_prompts=1"])
    bad = datasets.Dataset.from_dict({"problem": ["q"], "images": [[None, None]]})
    text = "\n".join(check.data_problems(params.model_copy(update={"steps_per_generation": 2}), bad))
    assert "parameter 'dataset' = 'synthetic': missing column(s) ['answer']" in text
    assert "parameter 'max_pixels' = 12544: 2 image(s) of that size take 32 tokens" in text
    layout_problem = load_params(ROOT / "params" / "recipes" / "tiny_cpu.yaml", ["steps_per_generation=3"])
    assert "must be a multiple of gradient_accumulation_steps" in "\n".join(check.batch_problems(layout_problem))


def test_runner_preflight_refuses_split_optimizer_steps_before_anything_runs():
    from papo_nb.workbook.config.machine_checks import preflight_problems

    assert preflight_problems(load_params(ROOT / "params" / "recipes" / "tiny_cpu.yaml")) == []
    problems = preflight_problems(
        load_params(ROOT / "params" / "recipes" / "tiny_cpu.yaml", ["steps_per_generation=3"])
    )
    assert problems == [
        "parameter 'steps_per_generation' = 3: must be a multiple of gradient_accumulation_steps = 2 "
        "(whole optimizer steps per rollout)"
    ]


def test_a_real_dataset_needs_its_validation_set_named(tmp_path):
    params = load_params(ROOT / "params" / "recipes" / "tiny_cpu.yaml", [f"dataset={tmp_path}"])
    with pytest.raises(rd.RecipeDataError, match="parameter 'validation_dataset' is empty"):
        rd.official_datasets(params, "unused: the check comes first")


# The official batches, per recipe: (GPUs, completions per optimizer step, prompts per round, optimizer steps per
# round). PAPO: *_grpo_papo.sh:5-6 N_GPU, :14 GLOBAL_BATCH_SIZE 128 prompts, :15 ROLLOUT_BATCH_SIZE 384 prompts,
# config_grpo_papo.yaml:83 rollout.n 5; VPPO: train_vppo_7b.sh:8-9 N_GPU 8, :14 128, :15 384, :18 rollout 8.
OFFICIAL = {
    "papo_g_3b": (2, 128 * 5, 384, 3),
    "grpo_3b": (2, 128 * 5, 384, 3),
    "papo_g_7b": (4, 128 * 5, 384, 3),
    "grpo_7b": (4, 128 * 5, 384, 3),
    "vppo_7b": (8, 128 * 8, 384, 3),
}


@pytest.mark.parametrize("name", OFFICIAL)
def test_every_recipe_fits_its_authors_gpus_at_its_official_batch(name):
    from papo_nb.workbook.recipe.forecast import forecast
    from papo_nb.workbook.recipe.forecast_table import GPUS

    gpus, completions, prompts, steps = OFFICIAL[name]
    params = load_params(ROOT / "params" / "recipes" / f"{name}.yaml")
    layout = batch_layout(params)
    assert params.num_processes == gpus
    assert layout["completions_per_optimizer_step"] == completions
    assert (layout["prompts_per_generation"], layout["optimizer_steps_per_generation"]) == (prompts, steps)
    fc = forecast(params, GPUS["80 GB"])
    assert fc.total <= 0.92 * GPUS["80 GB"], f"{name}: {fc.total / GIB:.1f} GiB, over 92% of 79.6 GiB"
    # the levers that make it fit, as the official configs set them (config_grpo_papo.yaml:79-80,87,98,100)
    assert fc.setting.offload and fc.setting.vllm_sleep
    assert fc.setting.reference_bytes == 2 or params.beta == 0
    assert params.vllm_gpu_memory_utilization == (0.7 if name == "vppo_7b" else 0.6)


def test_reference_precision_bf16_builds_trls_reference_model_in_bf16(tmp_path):
    import torch

    from papo_nb.workbook.training.builder import prepare_training

    tiny = ROOT / "params" / "recipes" / "tiny_cpu.yaml"
    trainer, _, _ = prepare_training(load_params(tiny, ["reference_precision=bf16"]), tmp_path / "bf16")
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # the policy keeps its own dtype
    default, _, _ = prepare_training(load_params(tiny), tmp_path / "fp32")
    assert {p.dtype for p in default.ref_model.parameters()} == {torch.float32}  # TRL's default


@pytest.mark.parametrize("name", OFFICIAL)
def test_the_levers_reach_trls_config(name):
    from papo_nb.workbook.training.builder import papo_config

    params = load_params(ROOT / "params" / "recipes" / f"{name}.yaml").model_copy(update={"device": "cpu"})
    args = papo_config(params, "unused", build_tiny_processor("qwen2_vl"))
    assert args.vllm_enable_sleep_mode and args.vllm_gpu_memory_utilization == params.vllm_gpu_memory_utilization
    assert args.model_init_kwargs == ({"dtype": "bfloat16"} if params.beta > 0 else None)


def test_the_offload_config_gives_accelerate_fsdp2_cpu_offload_policy():
    """What configs/accelerate/fsdp_offload.yaml hands accelerate: an FSDP2 plugin whose cpu_offload is torch's
    CPUOffloadPolicy, the object accelerate's fsdp2_prepare_model and TRL's prepare_fsdp pass to fully_shard (the
    policy pins host memory, so placing a step's shards needs a GPU; fsdp.yaml gives none)."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    def plugin(name):
        config = yaml.safe_load((ROOT / "configs" / "accelerate" / name).read_text())
        assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
        return FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=config["fsdp_config"]["fsdp_offload_params"])

    assert isinstance(plugin("fsdp_offload.yaml").cpu_offload, CPUOffloadPolicy)
    assert not isinstance(plugin("fsdp.yaml").cpu_offload, CPUOffloadPolicy)
    on_disk = yaml.safe_load((ROOT / "configs/accelerate/fsdp.yaml").read_text())
    offload = yaml.safe_load((ROOT / "configs/accelerate/fsdp_offload.yaml").read_text())
    on_disk["fsdp_config"] = {**on_disk["fsdp_config"], "fsdp_offload_params": True}
    assert offload == on_disk  # the same file but for the offload
