"""End to end: TRL's GRPOTrainer trains a LoRA on the tiny VLM with the shapes task, on CPU."""

import math

import pytest
import torch
from trl import GRPOTrainer

from papo_nb.testbed.models import load_vlm, tiny_grpo_config, tiny_lora_config, vision_special_token_ids
from papo_nb.testbed.rewards import accuracy_reward, format_reward


def lora_tensors(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.slow
def test_grpo_lora_trains_tiny_vlm(tiny_vlm_path, shapes_dataset, tmp_path):
    model, processor = load_vlm(tiny_vlm_path)
    args = tiny_grpo_config(tmp_path / "grpo", suppress_tokens=vision_special_token_ids(processor), max_steps=4)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy_reward, format_reward],
        args=args,
        train_dataset=shapes_dataset,
        processing_class=processor,
        peft_config=tiny_lora_config(),
    )
    before = lora_tensors(trainer.model)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert before, "LoRA produced no adapter tensors"
    assert all(".visual." not in name for name in before), "LoRA leaked into the vision tower"

    trainer.train()

    after = lora_tensors(trainer.model)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed), changed

    base_after = dict(trainer.model.named_parameters())
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before), "the frozen base model moved"

    step_logs = [log for log in trainer.state.log_history if "loss" in log and "reward_std" in log]
    assert len(step_logs) == 4
    assert all(math.isfinite(log["loss"]) for log in step_logs)
    assert any(log["reward_std"] > 0 for log in step_logs), [log["reward_std"] for log in step_logs]
