"""VPPO (Visually-Perceptive Policy Optimization, arXiv 2510.09285) as an adapter beside PAPO-G on TRL 1.9.1.

VPPO reads the quantity PAPO-G maximises, the per-token KL between the policy on the original and on a
patch-blackened image, and uses it twice, without adding it to the loss: only the most visually dependent tokens of
each completion carry the policy gradient, and each completion's advantage is scaled by its mean dependency
(``shaping.py``). The masked image, the masked branch once per generation round and its alignment checks are
PAPO-G's (``PAPOGTrainer``, with gamma fixed at 0); the GRPO loss is the parent's, called through ``super()`` with
shaped advantages. Official code: huaixuheqing/VPPO-RL at a23c54b (``verl/workers/actor/dp_actor.py``,
``verl/trainer/ray_trainer.py``, ``verl/workers/perc_utils.py``, ``verl/trainer/core_algos.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..papo.logp_inputs import logp_call_arguments
from ..papo.papo_trainer import PAPOGTrainer
from ..papo.perception_metrics import ROLLOUT_ROW_KEY
from ..papo.rollout_branch import MASKED_LOGPS_KEY
from . import shaping
from .vppo_config import VPPOConfig

# Batch entries the round carries through TRL's shuffle and split (one row per completion), like the masked branch.
DEPENDENCY_KEY = "vppo_token_dependency"  # (B, T) fp32, 0 outside the completion
SCORE_RANGE_KEY = "vppo_score_range"  # (B, 2): the round's [min, max] sensitivity score, repeated per row
# What ``rollout_review`` keeps per completion, the completions table's VPPO columns, in this order.
REVIEW_COLUMNS = ("vppo_token_dependency", "vppo_kept_token_share", "vppo_advantage_scale")

VPPO_PAPER = {
    "title": "Spotlight on Token Perception for Multimodal Reinforcement Learning",
    "id": "2510.09285",
    # docstyle-ignore
    "citation": """\
@article{huang2025spotlight,
    title   = {{Spotlight on Token Perception for Multimodal Reinforcement Learning}},
    author  = {Huang, Siyuan and Qu, Xiaoye and Li, Yafu and Luo, Yun and He, Zefeng and Liu, Daizong and Cheng, Yu},
    journal = {arXiv preprint arXiv:2510.09285},
    year    = 2025
}""",
}
__all__ = ["VPPOTrainer"]


class VPPOTrainer(PAPOGTrainer):
    """[`PAPOGTrainer`] at gamma 0, whose GRPO loss trains only each completion's most visually dependent tokens,
    with each completion's advantage scaled by its mean visual dependency.

    What changes against the parent (``PAPOGTrainer``, itself a ``GRPOTrainer``):

    - ``_generate_and_score_completions``: after the parent's round (which carries the masked branch), adds each
      token's visual dependency against the rollout-time policy and the round's score range (``vppo_entries``);
    - ``_compute_loss``: rewrites the batch's advantages (kept tokens, trajectory scale: ``shaped_inputs``) and
      calls ``super()._compute_loss``, so the parent's clipping, normalisation, entropy penalty (eta1) and metrics
      apply unchanged.

    At ``vppo_token_fraction=1.0`` and ``vppo_advantage_scale_min=1.0`` the shaped advantages are the parent's, value
    for value, so the loss is GRPOTrainer's bit for bit (with ``original_entropy_weight=0``).
    """

    _tag_names = ["trl", "grpo", "vppo"]
    _name = "VPPO"
    _paper = VPPO_PAPER

    def __init__(self, model, reward_funcs=None, args: VPPOConfig | None = None, **kwargs):
        """The parent's parameters; ``args`` must be a [`VPPOConfig`]."""
        if not isinstance(args, VPPOConfig):  # a PAPOGConfig would train PAPO-G's loss without a word
            raise TypeError(f"VPPOTrainer needs args=VPPOConfig(...), got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, **kwargs)
        # by a completion's row in this rank's latest generation batch (ROLLOUT_ROW_KEY), as the parent's
        # perception_record.rollout: its mean token dependency, kept-token share and advantage scale (REVIEW_COLUMNS)
        self.rollout_review: dict[int, tuple[float, float, float]] = {}

    # ---- hooks ----
    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.rollout_review = {}
        batch.update(self.vppo_entries(batch))
        return batch

    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, self.shaped_inputs(inputs))

    # ---- pieces ----
    @torch.no_grad()
    def vppo_entries(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Per token, the visual dependency of the round's completions under the rollout-time policy (official
        ``aug_log_probs`` against ``old_log_probs``, ``ray_trainer.py`` L609-L619); per row, the round's score range.

        A text-only round has no masked branch: its dependency is 0 and its range NaN (no shaping, no filtering
        beyond ties, which keep the earliest tokens)."""
        mask = completion_mask(batch)
        masked = batch.get(MASKED_LOGPS_KEY)
        if masked is None:
            dependency = torch.zeros_like(mask)
        else:
            dependency = shaping.token_dependency(masked, self.rollout_logps(batch), mask)
        scores = shaping.sensitivity_scores(dependency, mask)
        low_high = shaping.score_range(scores, mask)
        return {DEPENDENCY_KEY: dependency, SCORE_RANGE_KEY: low_high.expand(len(scores), 2).clone()}

    def rollout_logps(self, batch: dict[str, Any]) -> torch.Tensor:
        """The rollout-time policy's log-probs of the round: TRL's ``old_per_token_logps`` where it computed them,
        else the same no-grad forward now (the official trainer always recomputes them, ``ray_trainer.py`` L610)."""
        if batch.get("old_per_token_logps") is not None:
            return batch["old_per_token_logps"]
        positional, vlm_kwargs = logp_call_arguments(batch)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, *positional, self.args.per_device_train_batch_size, **vlm_kwargs
        )
        return logps

    def shaped_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """A shallow copy of ``inputs`` whose ``advantages`` are VPPO's (B, T) ones; the metrics of the call."""
        if DEPENDENCY_KEY not in inputs:
            raise RuntimeError(
                f"VPPOTrainer: the batch has no {DEPENDENCY_KEY}: it was not built by this trainer's "
                "_generate_and_score_completions (rollout_batch or a training round)"
            )
        mask = completion_mask(inputs)
        dependency = inputs[DEPENDENCY_KEY]
        kept = shaping.kept_tokens(dependency, mask, self.args.vppo_token_fraction)
        has_tokens = (mask > 0).any(dim=1)
        scores = shaping.sensitivity_scores(dependency, mask)
        low_high = inputs[SCORE_RANGE_KEY][0] if len(scores) else scores.new_full((2,), torch.nan)
        scale = shaping.advantage_scale(scores, low_high, has_tokens, self.args.vppo_advantage_scale_min)
        filtered = (mask > 0) & ~kept
        advantages = shaping.shaped_advantages(inputs["advantages"], scale.scale, filtered)
        self.log_vppo_metrics(dependency, mask, kept, scale)
        self.review_rows(inputs, dependency, mask, kept, scale.scale)
        return {**inputs, "advantages": advantages}

    def review_rows(self, inputs, dependency, mask, kept, scale) -> None:
        """``rollout_review`` for the call's completions: each one's mean token dependency, the share of its tokens
        that keep their gradient, and its advantage scale."""
        valid = (mask > 0).float()
        count = valid.sum(dim=1).clamp(min=1.0)
        means = (dependency * valid).sum(dim=1) / count
        shares = (kept.float() * valid).sum(dim=1) / count
        values = zip(means.tolist(), shares.tolist(), scale.float().tolist(), strict=True)
        for row, row_values in zip(inputs.get(ROLLOUT_ROW_KEY, torch.empty(0)).tolist(), values, strict=False):
            self.rollout_review[row] = row_values

    def log_vppo_metrics(self, dependency, mask, kept, scale: shaping.AdvantageScale) -> None:
        """Token means over all ranks (one all-reduce): the dependency, of kept and filtered tokens, the kept share;
        the mean advantage scale and the band's dynamic top (official ``actor/perception_token_fraction``,
        ``low_var_kl_mean_selected``/``rejected``, ``scaling_factor_mean``, ``dynamic_scaling_max``)."""
        valid = (mask > 0).float()
        keptf = kept.float()
        upper = scale.upper.float().nan_to_num(0.0)
        has_upper = scale.upper.isfinite().float()
        sums = torch.stack(
            [
                (dependency * valid).sum(),
                valid.sum(),
                (dependency * keptf).sum(),
                keptf.sum(),
                scale.scale.float().sum(),
                torch.tensor(float(len(scale.scale)), device=valid.device),
                upper,
                has_upper,
            ]
        )
        t = self.accelerator.reduce(sums, reduction="sum").tolist()
        rejected = t[1] - t[3]
        values = {
            "vppo/token_dependency": t[0] / max(t[1], 1.0),
            "vppo/kept_token_share": t[3] / max(t[1], 1.0),
            "vppo/dependency_kept": t[2] / max(t[3], 1.0),
            "vppo/dependency_filtered": (t[0] - t[2]) / rejected if rejected > 0 else 0.0,
            "vppo/advantage_scale": t[4] / max(t[5], 1.0),
            "vppo/advantage_scale_max": t[6] / t[7] if t[7] > 0 else 1.0,
        }
        metrics = self._metrics["train" if self.model.training else "eval"]
        for key, value in values.items():
            metrics[key].append(value)


def completion_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The tokens the parent's loss counts (completion, times ``tool_mask`` where present), fp32."""
    mask = batch["completion_mask"]
    if "tool_mask" in batch:
        mask = mask * batch["tool_mask"]
    return mask.float()
