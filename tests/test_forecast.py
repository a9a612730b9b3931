"""The memory and time forecast from the configuration alone (papo_nb.workbook.recipe.forecast, forecast_report):
the parts' arithmetic, ``papo-nb preflight``, and the refusal ``papo-nb train`` / ``papo-nb run`` give on
``device: cuda`` before any weight loads (the GPU's memory simulated: no GPU here)."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.recipe.architectures import published_config, widths
from papo_nb.workbook.recipe.forecast import GIB, forecast, layer_bytes, memory_parts, peak, persistent_parts, setting
from papo_nb.workbook.recipe.forecast_report import GPU_MEMORY_ENV, as_dict, verdict

ROOT = Path(__file__).resolve().parents[1]
GPU_YAML = ROOT / "params" / "gpu.yaml"
PAPO_3B = ROOT / "params" / "recipes" / "papo_g_3b.yaml"
# papo_g_3b without its memory levers: FSDP2 on the GPU, TRL's fp32 reference, vLLM awake through training
NO_LEVERS = [
    "accelerate_config=configs/accelerate/fsdp.yaml",
    "reference_precision=fp32",
    "vllm_enable_sleep_mode=false",
    "vllm_gpu_memory_utilization=0.3",
]
W3B = widths(published_config("Qwen/Qwen2.5-VL-3B-Instruct"))


def test_lora_states_are_the_frozen_bf16_base_and_the_fp32_adapter():
    parts = forecast(load_params(GPU_YAML), 80 * GIB, W3B).parts
    adapter = 64 * W3B.lora_per_rank
    assert parts["weights"] == W3B.parameters * 2 + adapter * 4
    assert (parts["gradients"], parts["optimizer"]) == (adapter * 4, adapter * 8)
    assert parts["reference"] == 0  # LoRA: TRL disables the adapters for the reference


def test_full_fsdp2_shards_fp32_master_weights_and_an_fp32_reference():
    params = load_params(PAPO_3B, NO_LEVERS)
    two = forecast(params, 80 * GIB, W3B).parts
    assert two["weights"] == W3B.parameters * 4 / 2  # accelerate upcasts trainable weights to fp32 under FSDP2
    assert two["optimizer"] == 2 * two["gradients"] == W3B.parameters * 8 / 2
    assert two["reference"] == W3B.parameters * 4 / 2  # TRL's ref model in fp32 (model_init_kwargs unset)
    four = forecast(params.model_copy(update={"num_processes": 4}), 80 * GIB, W3B).parts
    assert four["weights"] == two["weights"] / 2
    no_kl = forecast(params.model_copy(update={"beta": 0.0}), 80 * GIB, W3B).parts
    assert no_kl["reference"] == 0


def test_generation_holds_the_rounds_kv_cache_in_one_generate_call():
    params = load_params(PAPO_3B, [*NO_LEVERS, "use_vllm=false"])  # TRL's model.generate (the recipe: vLLM)
    parts = forecast(params, 80 * GIB, W3B).parts
    rows = 5 * 192  # per_device_train_batch_size x steps_per_generation
    kv_per_token = 36 * 2 * 2 * 128 * 2  # layers x (k, v) x kv heads x head_dim x bf16
    assert kv_per_token == 36 * 1024  # the 36 KiB per token
    # the prefill's one-layer peak: every prompt token of the round through one MLP, or every image through one block
    prefill = max(rows * 4096 * (6 * 11008 + 4 * 2048), rows * 5120 * (6 * 3420 + 4 * 1280))
    assert parts["generation"] == rows * ((4096 + 2048) * kv_per_token + 151_936 * 10) + prefill
    s = replace(setting(params, W3B), use_vllm=True, vllm_share=0.3)
    assert memory_parts(s, W3B, 80 * GIB)["generation"] == 0.3 * 80 * GIB
    assert memory_parts(replace(s, vllm_mode="server"), W3B, 80 * GIB)["generation"] == 0  # on GPUs of its own


def test_a_colocated_vllm_engine_holds_its_share_through_training():
    fc = forecast(load_params(PAPO_3B, NO_LEVERS), 80 * GIB, W3B)  # vLLM colocated, no sleep mode
    assert fc.setting.use_vllm and fc.parts["generation"] == 0.3 * 80 * GIB
    held = sum(fc.parts[p] for p in ("weights", "gradients", "optimizer", "reference", "round_tensors", "generation"))
    train = sum(fc.parts[p] for p in ("activations", "recompute", "logprob_forward"))
    assert fc.peak_phase == "train" and fc.total == pytest.approx(held + train)
    asleep = forecast(load_params(PAPO_3B, [*NO_LEVERS, "vllm_enable_sleep_mode=true"]), 80 * GIB, W3B)
    assert asleep.setting.vllm_sleep and "generation" not in persistent_parts(asleep.setting)
    assert peak(asleep.parts, persistent_parts(asleep.setting))[0] == pytest.approx(fc.total - fc.parts["generation"])


def test_checkpointing_keeps_one_hidden_state_per_layer():
    s = setting(load_params(GPU_YAML), W3B)
    on = memory_parts(replace(s, checkpointing=True), W3B)["activations"]
    off = memory_parts(replace(s, checkpointing=False), W3B)["activations"]
    assert (s.micro_batch, s.tokens, s.patches_per_row) == (10, 4096 + 1024, 1003520 // 14**2)
    tokens = s.micro_batch * s.tokens
    assert off == tokens * (36 * layer_bytes(W3B, lora=True) + 4 * 2048)  # LoRA without checkpointing: no vision
    vision = s.micro_batch * s.patches_per_row * (32 * 2 * 1280 + 6 * 1280)  # each block's bf16 input (input grads)
    assert on == tokens * (36 * 2 * 2048 + 4 * 2048) + vision  # bf16 layer inputs, the final norm
    assert memory_parts(replace(s, checkpointing=True), W3B)["recompute"] == tokens * layer_bytes(W3B, lora=True)
    assert 95 * 1024 < layer_bytes(W3B, lora=True) < 110 * 1024  # the issue measured about 106 KiB at 3B widths


def test_verdict_names_the_largest_part_and_its_fix():
    fc = forecast(load_params(PAPO_3B, [*NO_LEVERS, "use_vllm=false"]), 80 * GIB, W3B)
    v = verdict(fc)
    assert v["fits"] is False and v["part"] == "generation" and "use_vllm" in v["change"]
    assert verdict(forecast(load_params(GPU_YAML), 80 * GIB, W3B))["fits"] is True
    step = as_dict(fc)["step"]
    assert step["train_s"] > 0 and step["generation_s"] > 0


def cli(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "papo_nb.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_preflight_command_prints_the_table_and_exits_by_the_verdict():
    fits = cli("preflight", str(GPU_YAML), "--gpu-memory", "80", "--json")
    assert fits.returncode == 0, fits.stderr
    out = json.loads(fits.stdout)
    assert out["verdict"]["fits"] is True and set(out["parts_gib"]) >= {"weights", "generation", "probe"}
    too_small = cli("preflight", str(PAPO_3B), "--gpu-memory", "80", *(a for o in NO_LEVERS for a in ("-p", o)))
    assert too_small.returncode == 1
    assert "does NOT fit on a 80 GiB GPU" in too_small.stdout and "the generation part needs" in too_small.stdout
    bad = cli("preflight", str(GPU_YAML), "-p", "model_name_or_path=org/unknown")
    assert bad.returncode == 2 and "parameter 'model_name_or_path' = 'org/unknown'" in bad.stderr


def test_train_refuses_before_loading_when_the_run_cannot_fit(tmp_path):
    args = ("train", "--params", str(GPU_YAML), "-p", "dataset=synthetic", "--output-dir", str(tmp_path / "run"))
    refused = cli(*args, "--gpu-memory", "24")
    assert refused.returncode == 2
    assert "the run does not fit in GPU memory" in refused.stderr
    assert "the logprob_forward part needs 14.5 GiB" in refused.stderr  # the part and its size
    assert "the GPU's 24.0 GiB" in refused.stderr and "lower per_device_train_batch_size" in refused.stderr
    assert "plan: " in refused.stderr and "-p vllm_enable_sleep_mode=True" in refused.stderr  # every change at once
    assert not (tmp_path / "run").exists()  # nothing written, nothing loaded
    enough = cli(*args, "--gpu-memory", "141")
    assert "does not fit" not in enough.stderr
    # past the memory check it reaches the machine's next check: no CUDA device here
    assert "parameter 'device' = 'cuda': no CUDA device on this machine" in enough.stderr


def test_run_checks_the_memory_too(monkeypatch):
    from papo_nb.workbook.config.machine_checks import preflight_problems

    params = load_params(PAPO_3B, [*NO_LEVERS, "use_vllm=false"])
    monkeypatch.setenv(GPU_MEMORY_ENV, "80")
    problems = preflight_problems(params)
    assert any("the generation part needs 475.7 GiB" in p and "use_vllm" in p for p in problems), problems
    monkeypatch.setenv(GPU_MEMORY_ENV, "4000")
    assert not any("does not fit" in p for p in preflight_problems(params))


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen3-VL-4B-Instruct", "tiny:qwen2_5_vl"])
def test_every_shipped_model_and_schema_is_forecast(model):
    params = load_params(GPU_YAML, [f"model_name_or_path={model}", "dataset_schema=official"])
    fc = forecast(params, 141 * GIB)
    assert fc.total > 0 and fc.widths.parameters > 0


def test_a_bf16_reference_halves_it_and_sleep_mode_makes_vllm_a_phase():
    fp32 = forecast(load_params(PAPO_3B, NO_LEVERS), 80 * GIB, W3B)
    bf16 = forecast(load_params(PAPO_3B, [*NO_LEVERS, "reference_precision=bf16"]), 80 * GIB, W3B)
    assert bf16.parts["reference"] == fp32.parts["reference"] / 2 == W3B.parameters * 2 / 2
    assert fp32.total - bf16.total == pytest.approx(fp32.parts["reference"] / 2)
    no_kl = forecast(load_params(PAPO_3B, ["beta=0.0"]), 80 * GIB, W3B)
    assert no_kl.parts["reference"] == 0  # beta 0: TRL builds no reference, whatever its precision


def test_a_relative_accelerate_config_is_read_from_the_cwd_or_the_root_the_caller_names(tmp_path, monkeypatch):
    """The package holds no path into the repository: the forecast looks a relative ``accelerate_config`` up as the
    launcher does, in the cwd, then in the project folder its caller passes (``papo-nb`` passes its checkout's)."""
    params = load_params(PAPO_3B, [*NO_LEVERS, "accelerate_config=configs/accelerate/fsdp_offload.yaml"])
    monkeypatch.chdir(tmp_path)  # no configs/ here
    unread = forecast(params, 80 * GIB, W3B)
    assert unread.setting.fsdp and not unread.setting.offload  # the file unread: FSDP from its name alone
    read = forecast(params, 80 * GIB, W3B, ROOT)
    assert read.setting.offload and read.root == ROOT
    monkeypatch.chdir(ROOT)
    assert forecast(params, 80 * GIB, W3B).setting.offload  # from the repository root, as before


def test_cpu_offload_keeps_the_resident_blocks_on_the_gpu_and_the_rest_on_the_cpu():
    from papo_nb.workbook.recipe import levers

    on_gpu = forecast(load_params(PAPO_3B, NO_LEVERS), 80 * GIB, W3B)
    off = forecast(load_params(PAPO_3B, [*NO_LEVERS, "accelerate_config=configs/accelerate/fsdp_offload.yaml"]),
                   80 * GIB, W3B, ROOT)  # fmt: skip
    assert off.setting.offload and off.setting.fsdp and not on_gpu.setting.offload
    resident = W3B.embedding_parameters + 2 * W3B.layer_parameters
    assert (off.parts["weights"], off.parts["gradients"]) == (resident * 2, resident * 2)
    assert off.parts["optimizer"] == off.parts["reference"] == 0
    assert off.host == W3B.parameters * 16 + W3B.parameters * 4  # master states and the fp32 reference, per node
    assert on_gpu.host == 0
    step_on, step_off = as_dict(on_gpu)["step"], as_dict(off)["step"]
    assert step_on["offload_s"] == 0
    shard = 4 * W3B.parameters / 2
    moved = 64 * (3 * shard + shard + shard + shard) + shard / 3  # micro-steps; old, masked, reference; vLLM sync
    adam = W3B.parameters / 2 * 28 / levers.CPU_ADAM_BYTES_PER_S
    assert step_off["offload_s"] == pytest.approx(moved / levers.PCIE_BYTES_PER_S + adam)
    assert step_off["total_s"] == pytest.approx(step_on["total_s"] + step_off["offload_s"])
