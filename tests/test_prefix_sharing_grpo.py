"""Prefix sharing as a feature of TRL's plain GRPOTrainer (no PAPO-G): ``PrefixSharingMixin`` on ``GRPOTrainer``
with a ``PrefixSharingConfig`` trains exactly as ``GRPOTrainer`` does.

The check is of SGD steps in float64, where roundoff cancels: both trainers start from the same weights and the same
random stream, sample the same completions, and take two optimizer steps over one generation round seen twice
(``num_iterations=2``: old log-probs; ``beta`` > 0: reference log-probs), so every forward TRL routes through its
log-prob method runs packed in one and plain in the other. Full fine-tuning, so the vision tower's gradients count.
Qwen2-VL's float32 islands are computed in float64 (``float64_islands.py``: else the two differ by float32 roundoff,
6.2e-8 of the largest gradient, though their forwards agree to the bit), and the LM head is frozen: TRL 1.15+'s fused
head (``trl.kernels.chunked_logprob``) accumulates its weight gradient in float32 over the rows it is given, and the
packed and plain forwards give it different rows (1.5e-7 of the largest step on TRL 1.16). Measured with both:
2.2e-16 on TRL 1.9.1, 1.1e-16 on 1.16.0, of steps that move the parameters by up to 0.07."""

import pytest
import torch
from float64_islands import lift_float32_islands
from trl import GRPOConfig, GRPOTrainer

from papo_nb.prefix_sharing import PrefixSharingConfig, PrefixSharingMixin
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed.models import load_vlm

pytestmark = pytest.mark.model

FP64_ROUNDOFF = 1e-12  # relative to how far the steps moved the parameters
SETTINGS = dict(
    num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=2,
    num_iterations=2, beta=0.01, max_steps=2, max_completion_length=8, learning_rate=1.0, optim="sgd",
    bf16=False, report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
    model_init_kwargs={"dtype": torch.float64},  # the reference model TRL loads from the checkpoint: float64 too
)  # fmt: skip


class SharedGRPOTrainer(PrefixSharingMixin, GRPOTrainer):
    """TRL's GRPOTrainer with prefix sharing: the mixin is the whole change."""


def length_reward(completions, **kwargs) -> list[float]:
    """A reward of our own that differs within every group, so advantages (and the policy gradient) are not zero."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t)) / 8.0 for t in texts]


def train_two_steps(trainer_cls, config_cls, tiny_vlm_path, dataset, folder, **fields):
    model, processor = load_vlm(str(tiny_vlm_path))
    model = model.to(torch.float64)
    model.lm_head.requires_grad_(False)  # TRL 1.15+'s fused head sums its weight gradient in float32 (docstring)
    trainer = trainer_cls(
        model=model,
        reward_funcs=[length_reward],
        args=config_cls(output_dir=str(folder), **SETTINGS, **fields),
        train_dataset=dataset,
        processing_class=processor,
    )
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    return trainer, start, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_plain_grpo_trainer_with_prefix_sharing_takes_grpos_sgd_steps_exactly(
    tiny_vlm_path, shapes_dataset, tmp_path, monkeypatch
):
    lift_float32_islands(monkeypatch)
    shared, start, after = train_two_steps(
        SharedGRPOTrainer, PrefixSharingConfig, tiny_vlm_path, shapes_dataset, tmp_path / "shared", prefix_sharing=True
    )
    plain, _, expected = train_two_steps(GRPOTrainer, GRPOConfig, tiny_vlm_path, shapes_dataset, tmp_path / "plain")
    logged = [h for h in shared.state.log_history if prefix_sharing.METRIC in h]
    assert logged and all(h[prefix_sharing.METRIC] == 1.0 for h in logged), "every log-prob call ran packed"
    assert not any(prefix_sharing.METRIC in h for h in plain.state.log_history)
    moved = {n: (after[n] - start[n]).abs().max().item() for n in start}
    assert any(v > 0 for n, v in moved.items() if "visual" in n), "the vision tower trained (its gradients count)"
    scale = max(moved.values())
    diff = max((after[n] - expected[n]).abs().max().item() for n in start)
    print(f"plain GRPOTrainer, fp64 SGD: parameters moved by up to {scale:.3e}, shared vs plain differ by {diff:.3e}")
    assert scale > 1e-4, "the steps moved the parameters well past roundoff"
    assert diff <= FP64_ROUNDOFF * scale


def test_the_config_refuses_a_forced_sharing_without_whole_groups(tmp_path):
    with pytest.raises(ValueError, match=r"PrefixSharingConfig\.prefix_sharing=True is invalid with per_device"):
        PrefixSharingConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=6,
                            prefix_sharing=True, use_cpu=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"PrefixSharingConfig\.grouped_attention_kernel='triton' is invalid"):
        PrefixSharingConfig(output_dir=str(tmp_path), grouped_attention_kernel="triton", use_cpu=True)


def test_the_mixin_refuses_a_config_without_its_fields_before_loading_the_model(tmp_path):
    with pytest.raises(TypeError, match=r"SharedGRPOTrainer needs args=PrefixSharingConfig\(...\).*got GRPOConfig"):
        SharedGRPOTrainer(
            model="no/such-model",
            reward_funcs=[length_reward],
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True),
        )
