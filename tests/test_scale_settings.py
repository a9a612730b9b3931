"""The settings a GPU run needs to start, fit and finish (issue 53, item 3): gradient checkpointing as TRL's default
has it (LoRA too), each process's model on its own device, the probe's memory refused before work under full
fine-tuning at scale, and a bound on the checkpoints kept."""

import os

import pytest
import torch
from tiny_trainers import tiny_trainer, unit_params

from papo_nb.testbed.models import build_tiny_tokenizer, load_vlm
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.builder import papo_config


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
