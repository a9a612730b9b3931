"""TRL's own GRPO VLM cases (``tests/test_grpo_trainer.py``, class ``TestGRPOTrainerVLM``, at the release pinned here)
with PAPOGTrainer in place of GRPOTrainer, offline on this project's tiny models.

Each test rebuilds the upstream scenario (full fine-tuning at learning rate 0.1, 2 prompts a step with 2 generations,
8-token completions, a reward for longer completions) and asserts what upstream asserts, once at gamma 0 (PAPO-G's
terms off: a GRPO-equivalent config) and once at PAPOGConfig's defaults. Upstream trains its tiny hub checkpoints
over a whole dataset; here a step or two on the shapes task, which already moves every trainable parameter at this
learning rate. Upstream's ``test_train_vlm`` models all have a stand-in here (its
``trl-internal-testing/tiny-Gemma4ForConditionalGeneration`` is ``tiny:gemma4``) except Qwen3.5 and Qwen3.5-MoE, for
which Qwen3-VL stands in as the newest Qwen family. The stand-ins are configured as the hub checkpoints are
(LLaVA-NeXT's ``vision_feature_layer=-2``, Gemma3's vision tower without its attention-pooling head, Gemma4 as
gemma-4-E2B, which upstream's tiny Gemma4 copies: clipped vision linears, per-layer inputs, 3x3 pooling).
"""

from __future__ import annotations

import functools

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from papo_nb.papo import PAPOGConfig, PAPOGTrainer
from papo_nb.testbed import models
from papo_nb.testbed.shapes import make_shapes_dataset

MODES = {
    "gamma0": dict(perception_loss_weight=0.0, original_entropy_weight=0.0, masked_entropy_weight=0.0),
    "defaults": {},
}
pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.parametrize("mode", list(MODES))]


def longer_is_better(completions, **kwargs):
    """Upstream's reward: the completion's length in characters."""
    return [float(len(completion[0]["content"])) for completion in completions]


@functools.cache
def tiny_model_folder(family: str, root: str) -> str:
    return str(models.build_tiny_vlm(family, seed=0, cache_dir=root))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trl_case_models"))


def upstream_trainer(
    family, mode, cache, out, *, dataset=None, eval_dataset=None, peft_config=None, reward_funcs=None, **config
):
    """PAPOGTrainer with upstream's VLM settings (``TestGRPOTrainerVLM``) and ``config`` on top."""
    model, processor = models.load_vlm(tiny_model_folder(family, cache))
    settings = dict(
        output_dir=str(out),
        learning_rate=0.1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        # a sampled image placeholder would break the next forward: only the processor places them
        generation_kwargs={"suppress_tokens": models.vision_special_token_ids(processor)},
    )
    args = PAPOGConfig(**{**settings, **MODES[mode], **config})
    torch.manual_seed(0)
    return PAPOGTrainer(
        model=model,
        processing_class=processor,
        reward_funcs=reward_funcs or longer_is_better,
        args=args,
        train_dataset=dataset if dataset is not None else make_shapes_dataset(4, seed=0),
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )


def train_and_diff(trainer) -> tuple[list[str], list[str]]:
    """Train; the names of the parameters that changed and of those that did not."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    if trainer.args.perception_loss_weight > 0:  # the defaults really ran PAPO-G's masked branch
        # (with an evaluation at the same step only the eval_ prefixed metrics reach the history)
        kls = [h.get("perception_kl", h.get("eval_perception_kl", 0)) for h in trainer.state.log_history]
        assert any(kl > 0 for kl in kls)
    changed = [n for n, p in before.items() if not torch.equal(p, trainer.model.get_parameter(n))]
    return changed, [n for n in before if n not in changed]


# LLaVA-NeXT takes features from the second-to-last CLIP layer: the last layer and post_layernorm (pooler only)
# get no gradient, and upstream asserts they stay as they were.
FROZEN_BY_DESIGN = {"llava_next": ("encoder.layers.1", "post_layernorm")}


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "llava_next", "qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_train_vlm(family, mode, cache, tmp_path):
    """Upstream ``test_train_vlm``: every parameter changes, except LLaVA-NeXT's frozen-by-design ones."""
    changed, unchanged = train_and_diff(upstream_trainer(family, mode, cache, tmp_path))
    frozen = FROZEN_BY_DESIGN.get(family, ())
    assert [n for n in unchanged if not any(part in n for part in frozen)] == []
    assert [n for n in changed if any(part in n for part in frozen)] == []


def test_train_vlm_with_pad_to_multiple_of(mode, cache, tmp_path):
    """Upstream ``test_train_vlm_with_pad_to_multiple_of``: Gemma3's ``token_type_ids`` padded along; all change."""
    changed, unchanged = train_and_diff(upstream_trainer("gemma3", mode, cache, tmp_path, pad_to_multiple_of=7))
    assert unchanged == [] and changed


def test_train_vlm_beta_non_zero(mode, cache, tmp_path):
    """Upstream ``test_train_vlm_beta_non_zero``: with a reference model (beta 0.1) every parameter changes."""
    trainer = upstream_trainer("qwen2_5_vl", mode, cache, tmp_path, beta=0.1)
    assert trainer.ref_model is not None
    changed, unchanged = train_and_diff(trainer)
    assert unchanged == [] and changed


def test_train_vlm_peft(mode, cache, tmp_path):
    """Upstream ``test_train_vlm_peft``: LoRA on q_proj/v_proj; base weights unchanged, adapter weights changed
    (two steps: lora_B starts at zero, so lora_A has no gradient until B has moved)."""
    lora = LoraConfig(target_modules=["q_proj", "v_proj"])
    trainer = upstream_trainer("qwen2_5_vl", mode, cache, tmp_path, peft_config=lora, max_steps=2)
    base = {n for n, _ in trainer.model.named_parameters() if "lora_" not in n}
    changed, _ = train_and_diff(trainer)
    adapters = {n for n, _ in trainer.model.named_parameters() if "lora_" in n}
    assert adapters and set(changed) == adapters and not base & set(changed)


def test_train_vlm_and_importance_sampling(mode, cache, tmp_path):
    """Upstream ``test_train_vlm_and_importance_sampling``: two steps per generation (importance sampling)."""
    trainer = upstream_trainer("qwen2_5_vl", mode, cache, tmp_path, steps_per_generation=2, max_steps=2)
    changed, unchanged = train_and_diff(trainer)
    assert unchanged == [] and changed


def two_image_prompts(n: int) -> Dataset:
    """Upstream's ``zen-multi-image`` shape: an ``images`` list and one image placeholder per image."""
    first, second = make_shapes_dataset(n, seed=0), make_shapes_dataset(n, seed=1)
    rows = []
    for a, b in zip(first, second, strict=True):
        text = a["prompt"][0]["content"][1]["text"]
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": text}]
        rows.append({"prompt": [{"role": "user", "content": content}], "images": [a["image"], b["image"]]})
    return Dataset.from_list(rows)


def test_train_vlm_multi_image(mode, cache, tmp_path):
    """Upstream ``test_train_vlm_multi_image``: two images per prompt; every parameter changes."""
    trainer = upstream_trainer("qwen2_5_vl", mode, cache, tmp_path, dataset=two_image_prompts(4))
    changed, unchanged = train_and_diff(trainer)
    assert unchanged == [] and changed


def test_train_vlm_log_multimodal_false(mode, cache, tmp_path):
    """Upstream ``test_train_vlm_log_multimodal_false``: completions logged, their images not."""
    trainer = upstream_trainer("gemma3", mode, cache, tmp_path, log_completions=True, log_multimodal=False)
    trainer.train()
    assert len(trainer._logs["prompt"]) > 0 and len(trainer._logs["images"]) == 0


# ---- TRL's text-model cases (``TestGRPOTrainer``), run on the image task: PAPO-G's term needs an image ----


def distinct_characters(completions, **kwargs):
    """A second reward, not a function of the first: the completion's distinct characters."""
    return [float(len(set(completion[0]["content"]))) for completion in completions]


TEXT_CASES = {  # upstream test -> the config it trains (plus the VLM settings above)
    "test_train_loss_types[dapo]": dict(loss_type="dapo", gradient_accumulation_steps=2),
    "test_train_loss_types[dr_grpo]": dict(loss_type="dr_grpo", gradient_accumulation_steps=2),
    "test_train_loss_types[bnpo]": dict(loss_type="bnpo", gradient_accumulation_steps=2),
    "test_train_loss_types[cispo]": dict(loss_type="cispo", gradient_accumulation_steps=2),
    "test_train_multiple_iterations": dict(num_iterations=2, max_steps=2),
    "test_train_with_sync_ref_model": dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=2, max_steps=2),
    "test_train_with_entropy_filter": dict(top_entropy_quantile=0.2),
    "test_train_with_static_entropy": dict(entropy_coef=0.1),
    "test_train_with_eval": dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2),
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_text_cases_train_every_parameter(case, mode, cache, tmp_path):
    """Upstream ``TestGRPOTrainer`` cases named by ``case`` (loss types with gradient accumulation, several
    iterations, the reference-model sync, entropy filtering, the entropy bonus, evaluation): every parameter
    changes."""
    config = TEXT_CASES[case]
    evaluation = make_shapes_dataset(2, seed=1) if "eval_strategy" in config else None
    trainer = upstream_trainer("qwen2_vl", mode, cache, tmp_path, eval_dataset=evaluation, **config)
    if "sync_ref_model" in config:
        assert trainer.ref_model is not None
    changed, unchanged = train_and_diff(trainer)
    assert unchanged == [] and changed
    if evaluation is not None:
        assert any("eval_loss" in h for h in trainer.state.log_history)


def test_train_multiple_reward_funcs(mode, cache, tmp_path):
    """Upstream ``test_train_multiple_reward_funcs``: two reward functions; every parameter changes and both are
    logged."""
    rewards = [longer_is_better, distinct_characters]
    trainer = upstream_trainer("qwen2_vl", mode, cache, tmp_path, reward_funcs=rewards)
    changed, unchanged = train_and_diff(trainer)
    assert unchanged == [] and changed
    assert {"rewards/longer_is_better/mean", "rewards/distinct_characters/mean"} <= set(trainer.state.log_history[0])
