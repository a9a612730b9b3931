"""The official VPPO run as a named preset of VPPOConfig fields: the one place its values are written down.

Source: huaixuheqing/VPPO-RL at commit a23c54b, https://github.com/huaixuheqing/VPPO-RL/tree/a23c54b. ``sh7b`` =
examples/configs/train_vppo_7b.sh, ``cfg`` = examples/configs/config.yaml, ``actor`` = verl/workers/actor/config.py,
``perc`` = verl/workers/perc_utils.py, ``workers`` = verl/workers/fsdp_workers.py, ``dp`` =
verl/workers/actor/dp_actor.py. Left out, as in ``papo_nb.papo.recipes``: the batches, data, hardware and model,
which a run's params file sets (``params/recipes/vppo_7b.yaml``).
"""

from __future__ import annotations

from typing import Any

VPPO_7B: dict[str, Any] = {
    "vppo_token_fraction": 0.4,  # sh7b:21,55 top_p_perception_tokens
    "vppo_advantage_scale_min": 0.9,  # sh7b:22,57 advantage_scaling_min (use_advantage_shaping, sh7b:53)
    "perception_loss_weight": 0.0,  # VPPO adds no perception KL to the loss (dp:537-567)
    "perception_kl_clamp": None,  # dp:403-405: only the k3 bounds
    "mask_type": "auto",  # perc:5 14-px squares: here whole patches of the model's own size (14 on Qwen2.5-VL)
    "mask_ratio": 0.5,  # perc:5,107 black_prob 0.5
    "mask_sharing": "completion",  # workers:501-511: each row of the repeated rollout batch draws its own mask
    "entropy_estimator": "sampled",  # dp:566 -masked_mean(log_probs)
    "original_entropy_weight": 0.06,  # sh7b:23,54,56 use_entropy_penalty, entropy_penalty_coef 0.06
    "masked_entropy_weight": 0.0,
    "masked_branch": "rollout",  # ray_trainer.py:614-619: once per rollout batch, rollout-time policy, no grad
    "masked_branch_grad": False,
    "beta": 0.0,  # cfg:21 disable_kl true: no reference policy (ray_trainer.py:195-198)
    "loss_type": "dapo",  # actor:93 loss_avg_mode token, then dp:570: a token mean over the whole mini-batch
    "epsilon": 0.2,  # cfg:33 clip_ratio_low
    "epsilon_high": 0.28,  # cfg:34 clip_ratio_high
    "learning_rate": 1.0e-6,  # cfg:48
    "weight_decay": 1.0e-2,  # cfg:49
    "warmup_steps": 0,  # cfg:51 lr_warmup_ratio 0.0
    "lr_scheduler_type": "constant",  # actor:52 warmup_style "constant"
    "max_grad_norm": 1.0,  # cfg:39
    "num_generations": 8,  # sh7b:18,58 rollout=8
    "temperature": 1.0,  # cfg:63
    "top_p": 0.99,  # cfg:64
    "max_completion_length": 2048,  # cfg:8 max_response_length
    "num_train_epochs": 2,  # sh7b:13 TOTAL_EPOCHES=2
    "reward_weights": [1.0, 0.0],  # sh7b:33 compute_score_wo_format: boxed accuracy only, no format term
}

VPPO_RECIPES: dict[str, dict[str, Any]] = {"vppo_7b": VPPO_7B}
