"""The official PAPO-G recipes as named presets of PAPOGConfig fields: the one place they are written down.

Source: the official repository at commit fb63bf4 (2026-01-30),
https://github.com/MikeWangWZHL/PAPO/tree/fb63bf4533b78da5a2bb17bc812375dcb620887d. Each value names the file and line
it comes from, under that URL (append ``/<file>#L<line>`` after ``blob/<commit>``):
``sh3b`` = examples/papo_grpo/qwen2_5_vl_3b_grpo_papo.sh, ``sh7b`` = examples/papo_grpo/qwen2_5_vl_7b_grpo_papo.sh,
``shnokl`` = examples/papo_grpo/qwen2_5_vl_{3b,7b}_grpo_papo_no_kl_ref.sh (identical but for the model),
``yaml`` = examples/configs/config_grpo_papo.yaml, ``actor`` = verl/workers/actor/config.py,
``dp`` = verl/workers/actor/dp_actor.py, ``ray_trainer.py`` = verl/trainer/ray_trainer.py,
``papo_utils.py`` = verl/trainer/papo_utils.py. For example ``sh3b:28`` is
https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4533b78da5a2bb17bc812375dcb620887d/examples/papo_grpo/qwen2_5_vl_3b_grpo_papo.sh#L28

Left out on purpose: what depends on the hardware or the data pipeline (bf16 via FSDP, rollout batch 384 prompts and
update batch 128 prompts, i.e. 3 optimizer steps per rollout batch, max prompt length 4096, the data seed), which a
run sets with its own batch sizes; the model (full fine-tuning with the vision tower trainable, yaml:67); and the
rollout engine: the official runs generate with vLLM, which the GPU params files set (``use_vllm`` with
``vllm_mode: colocate``; GRPOConfig fields, outside these presets because they need a GPU and vLLM installed).
"""

from __future__ import annotations

from typing import Any

_PAPO_G_3B: dict[str, Any] = {
    "perception_loss_weight": 0.02,  # sh3b:28 KL_PRCP_COEF=0.02, sh3b:44
    "perception_loss_schedule": "fixed",  # yaml:43
    "perception_kl_clamp": None,  # actor:127 use_kl_prcp_clipping False
    "mask_type": "auto",  # yaml:40-42 14-px squares (papo_utils.py:17-30): here whole patches of the model
    "mask_ratio": 0.6,  # yaml:42 black_prob
    "mask_sharing": "prompt",  # ray_trainer.py:602-614 masks the prompt's images before the repeat at :644
    "entropy_estimator": "sampled",  # dp:289, dp:326
    "original_entropy_weight": 0.0,  # yaml:52 use_ori_entropy_loss false
    "masked_entropy_weight": 0.0,  # yaml:49 use_aug_entropy_loss false
    "masked_branch": "rollout",  # ray_trainer.py:759-769: once per rollout batch, before the update loop
    "masked_branch_grad": False,  # dp:46 RECOMPUTE_AUG_LOG_PROBS=False
    "beta": 0.01,  # yaml:26-28 use_kl_loss, low_var_kl, kl_coef 1e-2
    "loss_type": "bnpo",  # actor:93 loss_avg_mode "token"; dp:357 and dp:400 (/ gradient_accumulation)
    "epsilon": 0.2,  # actor:87 clip_ratio_low
    "epsilon_high": 0.3,  # actor:89 clip_ratio_high
    "learning_rate": 1.0e-6,  # yaml:69
    "weight_decay": 1.0e-2,  # yaml:70
    "warmup_steps": 0,  # yaml:72 lr_warmup_ratio 0.0
    "lr_scheduler_type": "constant",  # actor:52 warmup_style "constant", no decay (min_lr_ratio None, actor:51)
    "max_grad_norm": 1.0,  # yaml:60
    "num_generations": 5,  # yaml:83
    "temperature": 1.0,  # yaml:84
    "top_p": 0.99,  # yaml:85
    "max_completion_length": 2048,  # yaml:11
    "num_train_epochs": 2,  # sh3b:13 TOTAL_EPOCHES=2
}

RECIPES: dict[str, dict[str, Any]] = {
    "papo_g_3b": _PAPO_G_3B,
    # sh7b:31-34 and :51-54: both entropy terms on at 0.05; everything else as 3B. Qwen2.5-VL-7B unties its head
    # (tie_word_embeddings false; 3B ties it), so TRL's cast_lm_head_to_fp32 applies: fp32 logits, as the official
    # log-probs are (verl/utils/torch_functional.py:48-69). Measured on an untied tiny Qwen2-VL: bf16 weights move
    # the perception KL by up to 4.5%, 0.31% with the cast; under bf16 autocast the cast is re-cast to bf16.
    "papo_g_7b": {
        **_PAPO_G_3B,
        "original_entropy_weight": 0.05,
        "masked_entropy_weight": 0.05,
        "cast_lm_head_to_fp32": True,
    },
    # shnokl:28-34 and :50-55: gamma 0.01, disable_kl (no reference KL), both entropy terms at 0.03.
    "papo_g_no_kl_ref": {
        **_PAPO_G_3B,
        "perception_loss_weight": 0.01,
        "beta": 0.0,
        "original_entropy_weight": 0.03,
        "masked_entropy_weight": 0.03,
    },
}


def recipe(name: str) -> dict[str, Any]:
    """A copy of the named recipe's PAPOGConfig fields; raises ValueError naming the allowed recipes."""
    if name not in RECIPES:
        raise ValueError(f"unknown PAPO recipe {name!r}; allowed: {', '.join(RECIPES)}")
    return dict(RECIPES[name])


# The fields that size a generation batch; a run that sets none of them gets one prompt's rollouts per device batch.
BATCH_FIELDS = frozenset({"per_device_train_batch_size", "generation_batch_size", "steps_per_generation"})


def recipe_config(name: str, **overrides):
    """A PAPOGConfig of the named recipe; ``overrides`` (output_dir, batch sizes, bf16, ...) win. With no batch size
    among them, a device batch is one prompt's ``num_generations`` rollouts: TRL's default of 8 rows is not a
    multiple of the recipes' 5 generations, which GRPOConfig refuses."""
    from .papo_config import PAPOGConfig

    fields = {**recipe(name), **overrides}
    if not BATCH_FIELDS & overrides.keys():
        fields["per_device_train_batch_size"] = fields["num_generations"]
    return PAPOGConfig(**fields)
