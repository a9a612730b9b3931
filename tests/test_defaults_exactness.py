"""The adapter's two promises with every default, as a user builds it (``PAPOGConfig`` as TRL defaults it: ``bf16``
on, ``prefix_sharing="auto"``), on the installed TRL (``.ci/run`` runs this file on 1.9.1 and on 1.16.0):

- its loss is PAPO-G's: the parent's loss minus gamma times the bounded k3 KL between ``GRPOTrainer``'s own
  log-probs on the original and on the adapter's masked images, at both masked-branch timings;
- at gamma 0 it is GRPO at GRPO's cost: ``GRPOTrainer``'s vision forwards exactly, none on masked images, and its
  losses bit for bit.

TRL 1.15+ opens the accelerator's autocast inside its log-prob method; a packed forward that did not computed in
float32 beside a parent in bf16 (1.2e-3 apart in log-probs, 3% of the KL term in the loss)."""

import pytest
import torch
from peft import LoraConfig
from trl import GRPOTrainer

from papo_nb.papo import PAPOGConfig, PAPOGTrainer
from papo_nb.papo.logp_inputs import logp_call_arguments
from papo_nb.papo.terms import bounded_k3
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed.models import load_vlm
from papo_nb.testbed.rewards import accuracy_reward, format_reward
from papo_nb.workbook.rollouts import rollout_batch

pytestmark = pytest.mark.model  # every test here builds and trains the tiny VLM

GAMMA = 0.5
LOGP_ROUNDOFF = 1e-5  # measured: 0.0 on TRL 1.9.1 and 1.16.0, native, avx2 and default kernel paths
# The sizes a CPU test can afford; every other field keeps PAPOGConfig's (so TRL's) default.
SIZES = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, report_to="none", use_cpu=True)


def trainer_with_defaults(tiny_vlm_path, dataset, folder, trainer_cls=PAPOGTrainer, **fields):
    """A trainer on a fresh copy of the tiny Qwen2-VL with a fresh LoRA adapter (the same weights every call)."""
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return trainer_cls(
        model=model,
        processing_class=processor,
        reward_funcs=[accuracy_reward, format_reward],
        args=PAPOGConfig(output_dir=str(folder), **SIZES, **fields),
        train_dataset=dataset,
        peft_config=lora,
    )


def parent_logps(trainer, model, batch, pixel_values):
    """``GRPOTrainer``'s own log-probs of the batch's completions given ``pixel_values`` (the adapter bypassed)."""
    args, keywords = logp_call_arguments({**batch, "pixel_values": pixel_values})
    with torch.no_grad():
        return GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, *args, **keywords)[0]


@pytest.mark.parametrize("timing", ["rollout", "update"])
def test_with_every_default_the_loss_is_the_parent_loss_minus_gamma_times_the_k3_kl(
    tiny_vlm_path, shapes_dataset, tmp_path, timing
):
    papo = trainer_with_defaults(
        tiny_vlm_path, shapes_dataset, tmp_path / "papo", perception_loss_weight=GAMMA, masked_branch=timing,
        masked_forward="full", original_entropy_weight=0.0, masked_entropy_weight=0.0,
    )  # fmt: skip
    grpo = trainer_with_defaults(tiny_vlm_path, shapes_dataset, tmp_path / "grpo", GRPOTrainer)
    assert papo.args.bf16 and papo.args.prefix_sharing == "auto", "TRL's and the adapter's defaults"
    assert papo.prefix_sharing.reason is None, "auto packs this batch: the path under test"
    batch = rollout_batch(papo, shapes_dataset, n_prompts=2, seed=0)
    loss = papo._compute_loss(papo.model, batch).item()
    assert papo._metrics["train"][prefix_sharing.METRIC][-1] == 1.0, "the loss call ran packed"

    grpo.current_gradient_accumulation_steps = 1
    parent_loss = GRPOTrainer._compute_loss(grpo, grpo.model, batch).item()
    original = parent_logps(grpo, grpo.model, batch, batch["pixel_values"])
    masked = parent_logps(grpo, grpo.model, batch, papo.masked_pixel_values(batch))
    mask = batch["completion_mask"].float()
    keywords = logp_call_arguments(batch)
    with torch.no_grad():  # the adapter's packed log-probs, after the loss call's first-batch check
        ours = papo._get_per_token_logps_and_entropies(papo.model, *keywords[0], **keywords[1])[0]
    gap = ((ours - original).abs() * mask).max().item()
    print(f"{timing}: max |adapter - GRPOTrainer| log-prob {gap:.3g}")
    # Both forwards compute in the same precision on the same rows, so they agree to float32 roundoff; a forward
    # outside the parent's autocast was 1.7e-3 off, inside bf16's own resolution, which a bf16 bound cannot see.
    assert gap <= LOGP_ROUNDOFF, gap
    kl = ((bounded_k3(masked, original) * mask).sum() / mask.sum()).item()  # bnpo, TRL's default loss type
    reference = parent_loss - GAMMA * kl
    print(f"{timing}: adapter {loss:.6e}, reference {reference:.6e}, KL term {GAMMA * kl:.3e}")
    assert kl > 1e-4, "a perception KL to be measured"
    assert abs(loss - reference) <= 1e-3 * GAMMA * kl, (loss, reference, GAMMA * kl)


def vision_forwards(trainer) -> list[int]:
    """One entry per forward of the vision tower (generation included) during the trainer's run."""
    calls = []
    trainer.model.get_base_model().model.visual.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_with_every_default_gamma_zero_makes_grpos_vision_forwards_and_losses(tiny_vlm_path, shapes_dataset, tmp_path):
    runs = {}
    for name, trainer_cls, fields in (
        ("grpo", GRPOTrainer, {}),
        ("gamma0", PAPOGTrainer, {"perception_loss_weight": 0.0}),
    ):
        trainer = trainer_with_defaults(
            tiny_vlm_path, shapes_dataset, tmp_path / name, trainer_cls, max_steps=2, logging_steps=1, **fields
        )
        forwards = vision_forwards(trainer)
        masks = trainer.masks.generator.get_state() if trainer_cls is PAPOGTrainer else None
        trainer.train()
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        runs[name] = dict(trainer=trainer, forwards=len(forwards), losses=losses, masks=masks)
    grpo, gamma0 = runs["grpo"], runs["gamma0"]
    print(f"vision forwards: GRPOTrainer {grpo['forwards']}, PAPO-G at gamma 0 {gamma0['forwards']}")
    trainer = gamma0["trainer"]
    assert trainer.masked_branch.skipped and trainer.masked_branch.clock.calls == 0
    assert torch.equal(trainer.masks.generator.get_state(), gamma0["masks"]), "no mask was drawn"
    assert trainer.prefix_sharing.reason == prefix_sharing.GRPO_RUN_REASON and trainer.prefix_sharing.checked is None
    assert gamma0["forwards"] == grpo["forwards"] and gamma0["losses"] == grpo["losses"]
