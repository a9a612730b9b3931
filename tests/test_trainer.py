"""PAPOGTrainer on the tiny VLM: parent reduction, the PAPO terms, masking hygiene, config validation."""

import pytest
import torch
from peft import get_peft_model
from trl import GRPOConfig, GRPOTrainer

from papo_nb.papo import PAPOGConfig, PAPOGTrainer
from papo_nb.testbed.models import load_vlm, tiny_grpo_config, tiny_lora_config, vision_special_token_ids
from papo_nb.testbed.rewards import accuracy_reward, format_reward
from papo_nb.workbook.batches import clone_batch, rollout_batch


@pytest.fixture(scope="module")
def policy(tiny_vlm_path):
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    return get_peft_model(model, tiny_lora_config()), processor


def make_trainer(policy, dataset, tmp_path, trainer_cls=PAPOGTrainer, config_cls=PAPOGConfig, **overrides):
    model, processor = policy
    args = tiny_grpo_config(
        tmp_path / trainer_cls.__name__, vision_special_token_ids(processor), config_cls=config_cls, **overrides
    )
    return trainer_cls(
        model=model,
        processing_class=processor,
        reward_funcs=[accuracy_reward, format_reward],
        args=args,
        train_dataset=dataset,
    )


@pytest.fixture(scope="module")
def batch(policy, shapes_dataset, tmp_path_factory):
    trainer = make_trainer(policy, shapes_dataset, tmp_path_factory.mktemp("batch"))
    return rollout_batch(trainer, shapes_dataset, n_prompts=2, seed=0)


def trainable_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_zero_gamma_zero_eta_is_the_parent_loss_bit_for_bit(policy, shapes_dataset, batch, tmp_path, loss_type):
    papo = make_trainer(
        policy,
        shapes_dataset,
        tmp_path,
        loss_type=loss_type,
        perception_loss_weight=0.0,
        original_entropy_weight=0.0,
        masked_entropy_weight=0.0,
    )
    plain = make_trainer(
        policy, shapes_dataset, tmp_path, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, loss_type=loss_type
    )
    for trainer in (papo, plain):
        trainer.current_gradient_accumulation_steps = 1
    papo_loss = papo._compute_loss(policy[0], batch)
    plain_loss = plain._compute_loss(policy[0], batch)
    assert torch.equal(papo_loss, plain_loss), (papo_loss.item(), plain_loss.item())
    # On-policy grpo loss is ~0 in value (group-centred advantages), so compare gradients too.
    plain_grad = trainable_grads(policy[0], plain_loss)
    assert plain_grad.norm() > 0
    assert torch.equal(trainable_grads(policy[0], papo_loss), plain_grad)
    live = make_trainer(policy, shapes_dataset, tmp_path, loss_type=loss_type)
    live.current_gradient_accumulation_steps = 1
    assert not torch.equal(live._compute_loss(policy[0], batch), plain_loss)


def test_terms_and_metrics_on_a_real_batch(policy, shapes_dataset, batch, tmp_path):
    trainer = make_trainer(policy, shapes_dataset, tmp_path)
    before = clone_batch(batch)
    parent, terms = trainer.papo_loss_parts(policy[0], batch)
    assert terms.has_images and terms.kl_sum.item() > 0
    assert terms.perception_kl.requires_grad, "the perception KL must carry gradient through the original branch"
    assert not terms.masked_entropy.requires_grad, "masked branch is no-grad by default"
    for key, value in before.items():
        assert type(value) is type(batch[key])
        assert torch.equal(value, batch[key]) if isinstance(value, torch.Tensor) else value == batch[key], key
    metrics = trainer._metrics["train"]
    assert metrics["perception_kl"][-1] > 0 and metrics["perception_loss"][-1] == -metrics["perception_kl"][-1]
    assert metrics["masked_entropy"][-1] > 0 and metrics["perception_gamma"][-1] == 0.02


def test_masked_pixel_values_differ_and_input_is_untouched(policy, shapes_dataset, batch, tmp_path):
    trainer = make_trainer(policy, shapes_dataset, tmp_path)
    original = batch["pixel_values"].clone()
    masked = trainer.masked_pixel_values(batch)
    assert torch.equal(batch["pixel_values"], original)
    changed_rows = (masked != original).any(dim=1).float().mean().item()
    assert abs(changed_rows - 0.6) < 0.05


def test_padding_changes_neither_perception_nor_entropy_terms(policy, shapes_dataset, batch, tmp_path):
    trainer = make_trainer(policy, shapes_dataset, tmp_path, loss_type="grpo")
    padded = clone_batch(batch)
    padded["completion_mask"][::2, -4:] = 0  # make sure several rows end in padding
    scrambled = clone_batch(padded)
    pad = scrambled["completion_mask"] == 0
    assert pad.any()
    sampled = padded["completion_ids"][padded["completion_mask"] == 1]  # generated, so free of vision tokens
    pick = torch.randint(0, sampled.numel(), (int(pad.sum()),), generator=torch.Generator().manual_seed(0))
    scrambled["completion_ids"][pad] = sampled[pick]
    assert not torch.equal(scrambled["completion_ids"], padded["completion_ids"])
    results = []
    for inputs in (padded, scrambled):
        trainer.mask_generator.manual_seed(7)
        _, terms = trainer.papo_loss_parts(policy[0], inputs)
        results.append(terms)
    for name in ("perception_kl", "original_entropy", "masked_entropy"):
        assert torch.equal(getattr(results[0], name), getattr(results[1], name)), name


def test_text_only_batch_has_zero_perception_term(policy, shapes_dataset, batch, tmp_path):
    trainer = make_trainer(policy, shapes_dataset, tmp_path)
    text_only = {
        k: v
        for k, v in batch.items()
        if k not in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
    }
    text_only["prompt_ids"] = text_only["prompt_ids"][:, -4:]  # drop the image tokens as well
    text_only["prompt_mask"] = text_only["prompt_mask"][:, -4:]
    parent, terms = trainer.papo_loss_parts(policy[0], text_only)
    assert not terms.has_images and terms.kl_sum.item() == 0.0 and terms.perception_kl.item() == 0.0
    assert torch.isfinite(parent)


def test_entropy_weights_change_the_gradient(policy, shapes_dataset, batch, tmp_path):
    model = policy[0]

    def grad_for(**weights):
        trainer = make_trainer(policy, shapes_dataset, tmp_path, perception_loss_weight=0.0, **weights)
        trainer.current_gradient_accumulation_steps = 1
        trainer.mask_generator.manual_seed(3)
        return trainable_grads(model, trainer._compute_loss(model, batch))

    base = grad_for(original_entropy_weight=0.0, masked_entropy_weight=0.0)
    eta1 = grad_for(original_entropy_weight=0.5, masked_entropy_weight=0.0)
    assert (eta1 - base).norm() > 1e-3 * base.norm(), "eta1 must regularise the original-image entropy"
    eta2_no_grad = grad_for(original_entropy_weight=0.0, masked_entropy_weight=0.5)
    assert torch.equal(eta2_no_grad, base), "with a no-grad masked branch eta2 is a constant"
    eta2_grad = grad_for(original_entropy_weight=0.0, masked_entropy_weight=0.5, masked_branch_grad=True)
    assert (eta2_grad - base).norm() > 1e-3 * base.norm(), "with masked_branch_grad eta2 must act"


def test_gamma_pushes_the_gradient_and_linear_schedule_anneals(policy, shapes_dataset, batch, tmp_path):
    model = policy[0]
    trainer = make_trainer(
        policy,
        shapes_dataset,
        tmp_path,
        original_entropy_weight=0.0,
        masked_entropy_weight=0.0,
        perception_loss_weight=0.5,
        perception_loss_schedule="linear",
        perception_loss_weight_final=0.1,
        max_steps=4,
    )
    trainer.current_gradient_accumulation_steps = 1
    assert trainer.current_gamma() == 0.5
    trainer.state.global_step = 2
    assert trainer.current_gamma() == pytest.approx(0.3)
    trainer.state.global_step = 4
    assert trainer.current_gamma() == pytest.approx(0.1)
    parent, terms = trainer.papo_loss_parts(model, batch)
    loss = trainer.assemble_loss(parent, terms, 0.5, 0.0, 0.0)
    assert not torch.equal(trainable_grads(model, loss), trainable_grads(model, parent))


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("perception_loss_weight", -0.1, ">= 0"),
        ("mask_ratio", 1.5, "(0, 1]"),
        ("mask_type", "grid", "'patch', 'merge_unit', 'random'"),
        ("perception_loss_schedule", "cosine", "'fixed', 'linear'"),
        ("perception_kl_clamp", 0.0, "None or a finite number > 0"),
        ("probe_max_degenerate_batches", 0, "an int >= 1"),
        ("masked_entropy_weight", float("nan"), "finite"),
    ],
)
def test_config_rejects_bad_fields_by_name(tmp_path, field, value, allowed):
    with pytest.raises(ValueError) as info:
        PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{field: value})
    message = str(info.value)
    assert f"PAPOGConfig.{field}={value!r}" in message and allowed in message


def test_config_defaults_follow_the_paper(tmp_path):
    args = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert (
        args.perception_loss_weight,
        args.mask_ratio,
        args.original_entropy_weight,
        args.masked_entropy_weight,
    ) == (0.02, 0.6, 0.03, 0.03)
    assert args.beta == 0.01 and args.masked_branch_grad is False and args.perception_kl_clamp is None
    assert args.require_gpu_contract_probe is False and args.probe_max_degenerate_batches == 20
