"""End to end: TRL's GRPOTrainer trains a LoRA on the tiny VLM with the shapes task, on CPU."""

import math

import pytest
import torch
from tiny_trainers import tiny_trainer
from trl import GRPOTrainer

from papo_nb.testbed.models import load_vlm
from papo_nb.workbook.training.figures import step_logs


def lora_tensors(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.slow
def test_grpo_lora_trains_tiny_vlm(tiny_vlm_path, shapes_dataset, tmp_path):
    model, processor = load_vlm(tiny_vlm_path)
    # the workbook's one builder makes the plain GRPO trainer too (a fresh LoRA: model is not a PeftModel yet)
    trainer = tiny_trainer(model, processor, shapes_dataset, tmp_path / "grpo", GRPOTrainer, max_steps=4)
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

    steps = step_logs(trainer.state.log_history)
    assert len(steps) == 4
    assert all(math.isfinite(log["loss"]) for log in steps)
    assert any(log["reward_std"] > 0 for log in steps), [log["reward_std"] for log in steps]
