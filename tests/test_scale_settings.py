"""The settings a GPU run needs to start, fit and finish (issue 53, item 3): gradient checkpointing as TRL's default
has it (LoRA too), each process's model on its own device, the probe's memory refused before work under full
fine-tuning at scale, and a bound on the checkpoints kept."""

import os

import pytest
import torch
from tiny_trainers import tiny_trainer, unit_params

from papo_nb.testbed.models import build_tiny_tokenizer, load_vlm
from papo_nb.train.integrity import find_resume_checkpoint
from papo_nb.train.run_folder import TRAINER_STATE_FILE
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.builder import build_trainer, papo_config
from papo_nb.workbook.training.checkpoints import checkpoint_folders


def test_checkpointing_is_on_by_default_for_lora_as_in_trl(tmp_path):
    from dataclasses import fields

    from trl import GRPOConfig

    tokenizer = build_tiny_tokenizer()  # papo_config reads only the vision token ids off the processor
    trl_default = next(f.default for f in fields(GRPOConfig) if f.name == "gradient_checkpointing")
    assert WorkbookParams().gradient_checkpointing is trl_default is True
    for finetuning in ("lora", "full"):
        args = papo_config(WorkbookParams(finetuning=finetuning, device="cpu"), tmp_path, tokenizer)
        # transformers 5 reads activation_checkpointing; gradient_checkpointing mirrors it (TRL reads that one)
        assert args.activation_checkpointing is True and args.gradient_checkpointing is True, finetuning
    off = papo_config(WorkbookParams(gradient_checkpointing=False, device="cpu"), tmp_path, tokenizer)
    assert off.activation_checkpointing is False and off.gradient_checkpointing is False


@pytest.mark.model
@pytest.mark.slow
def test_lora_trains_under_checkpointing_and_its_weights_get_gradients(tiny_vlm_path, shapes_dataset, tmp_path):
    model, processor = load_vlm(tiny_vlm_path)
    # the entropy term gives every completion a gradient, whatever the random policy's rewards
    trainer = tiny_trainer(
        model, processor, shapes_dataset, tmp_path / "ckpt", max_steps=1, original_entropy_weight=0.1
    )
    lora = {name: p for name, p in trainer.model.named_parameters() if "lora_" in name}
    gradients = {}  # each LoRA weight's largest gradient, read when the backward has accumulated it

    def record(parameter):
        gradients[names[parameter]] = parameter.grad.detach().abs().max().item()

    names = {parameter: name for name, parameter in lora.items()}
    for parameter in lora.values():
        parameter.register_post_accumulate_grad_hook(record)
    attention = trainer.model.get_base_model().model.language_model.layers[0].self_attn
    recomputed = []  # whether the first layer's attention runs inside a backward: checkpointing's recomputation
    # (a submodule's pre-hook: transformers checkpoints the layer's forward, inside its own hooks, and the recompute
    # stops early once it has what the backward needs)
    attention.register_forward_pre_hook(lambda *_: recomputed.append(torch._C._current_graph_task_id() != -1))

    trainer.train()

    assert trainer.model.get_base_model().is_activation_checkpointing
    assert any(recomputed), "no decoder layer was recomputed in the backward: checkpointing was off"
    assert set(gradients) == set(lora), sorted(set(lora) - set(gradients))
    assert max(v for n, v in gradients.items() if "lora_B" in n) > 0


@pytest.mark.parametrize(
    ("device", "environ", "device_count", "expected"),
    [
        ("cuda", {}, 1, "cuda:0"),  # one process, outside a launch
        ("cuda", {"LOCAL_RANK": "3", "WORLD_SIZE": "4"}, 4, "cuda:3"),  # DDP: each rank its own GPU
        ("cuda", {"LOCAL_RANK": "1", "ACCELERATE_USE_FSDP": "true"}, 2, "cpu"),  # FSDP: accelerate shards it
        ("cpu", {"LOCAL_RANK": "1"}, 0, "cpu"),  # gloo processes on the CPU
    ],
)
def test_each_process_loads_its_model_on_its_own_device(monkeypatch, device, environ, device_count, expected):
    from papo_nb.workbook.config.paths import process_device

    for name in ("LOCAL_RANK", "WORLD_SIZE", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():  # the launch's environment, as accelerate launch sets it
        monkeypatch.setenv(name, value)
    assert process_device(device, os.environ, device_count) == expected


@pytest.mark.parametrize("local_rank", ["2", "-1", "one"])
def test_a_rank_without_its_gpu_is_refused_naming_the_rank_and_the_count(local_rank):
    from papo_nb.workbook.config.paths import process_device

    with pytest.raises(ValueError, match=rf"LOCAL_RANK = '{local_rank}'.* 2 GPU\(s\) are visible.*'num_processes'"):
        process_device("cuda", {"LOCAL_RANK": local_rank}, 2)


def saving_trainer(tiny_vlm_path, dataset, output_dir, **fields):
    """A LoRA trainer of the tiny model that saves a checkpoint every step, its limit from the params."""
    model, processor = load_vlm(tiny_vlm_path)
    params = unit_params(save_steps=1, **fields)
    return build_trainer(params, papo_config(params, output_dir, processor), model, processor, dataset)


def test_save_total_limit_defaults_to_three_and_reaches_the_config(tmp_path):
    assert WorkbookParams().save_total_limit == 3
    args = papo_config(WorkbookParams(save_total_limit=5, device="cpu"), tmp_path, build_tiny_tokenizer())
    assert args.save_total_limit == 5
    assert (
        papo_config(
            WorkbookParams(save_total_limit=None, device="cpu"), tmp_path, build_tiny_tokenizer()
        ).save_total_limit
        is None
    )


@pytest.mark.model
@pytest.mark.slow
def test_the_limit_keeps_the_newest_checkpoints_and_resume_still_finds_the_last_complete(
    tiny_vlm_path, shapes_dataset, tmp_path
):
    out = tmp_path / "run"
    saving_trainer(tiny_vlm_path, shapes_dataset, out, max_steps=4, save_total_limit=2).train()
    assert [f.name for f in checkpoint_folders(out)] == ["checkpoint-4", "checkpoint-3"]
    assert find_resume_checkpoint(out, warn=False)[0] == out / "checkpoint-4"

    (out / "checkpoint-4" / TRAINER_STATE_FILE).unlink()  # a save cut short: the limit kept one to fall back to
    checkpoint, skipped = find_resume_checkpoint(out, warn=False)
    assert checkpoint == out / "checkpoint-3" and [s[0] for s in skipped] == [out / "checkpoint-4"]

    resumed = saving_trainer(tiny_vlm_path, shapes_dataset, out, max_steps=5, save_total_limit=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 5
    assert [f.name for f in checkpoint_folders(out)] == ["checkpoint-5", "checkpoint-4"]
    assert find_resume_checkpoint(out, warn=False) == (out / "checkpoint-5", [])


def test_the_probe_refuses_a_model_too_large_for_its_float64_vectors(tmp_path):
    from papo_nb.papo import PAPOGConfig
    from papo_nb.papo import probe as probe_package

    args = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, require_gpu_contract_probe=True)
    large = torch.nn.Linear(12_000, 10_000, device="meta")  # 120,010,000 weights, none allocated
    need = probe_package.PROBE_FLOAT64_VECTORS * 8 * 120_010_000 / 1024**3
    with pytest.raises(ValueError, match=rf"'require_gpu_contract_probe'.* 120,010,000 trainable .* {need:,.1f} GiB"):
        probe_package.training_probe(args, large)
    large.requires_grad_(False)  # frozen weights need no vectors
    assert probe_package.training_probe(args, large).pending
    assert probe_package.training_probe(args, torch.nn.Linear(4, 4)).pending


@pytest.mark.model
def test_full_fine_tuning_above_the_limit_is_refused_when_the_trainer_is_built(
    tiny_vlm_path, shapes_dataset, tmp_path, monkeypatch
):
    from papo_nb.papo import probe as probe_package

    monkeypatch.setattr(probe_package, "PROBE_MAX_TRAINABLE_PARAMETERS", 1_000)  # the tiny model at the 3B scale
    model, processor = load_vlm(tiny_vlm_path)
    trainable = sum(p.numel() for p in model.parameters())
    params = unit_params(finetuning="full", require_gpu_contract_probe=True)
    args = papo_config(params, tmp_path, processor)
    with pytest.raises(ValueError, match=rf"{trainable:,} trainable parameters, above the probe's limit of 1,000"):
        build_trainer(params, args, model, processor, shapes_dataset)
