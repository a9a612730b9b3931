"""VPPO configuration: the PAPO-G fields (the masked image and branch it reuses) plus VPPO's two, with the official
VPPO run's values as defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..papo.papo_config import LOSS_TYPES, MASK_SHARING, PAPOGConfig, is_finite_number
from ..prefix_sharing.config import check_field_rules

# name -> (rule, what is allowed), as papo_config.FIELD_RULES: the workbook derives its params schema from it.
VPPO_FIELD_RULES = {
    "vppo_token_fraction": (lambda v: is_finite_number(v) and 0.0 < v <= 1.0, "a number in (0, 1]"),
    "vppo_advantage_scale_min": (lambda v: is_finite_number(v) and 0.0 <= v <= 1.0, "a number in [0, 1]"),
}
# PAPO-G fields VPPO cannot take another value of: (value, why).
VPPO_FIXED = {
    "perception_loss_weight": (0.0, "VPPO reads the perception KL as a signal and never adds it to the loss"),
    "masked_branch": (
        "rollout",
        "VPPO's dependency is the rollout-time policy's (aug_log_probs beside old_log_probs)",
    ),
}


@dataclass
class VPPOConfig(PAPOGConfig):
    r"""Configuration for [`VPPOTrainer`]: every [`PAPOGConfig`] field (the masked image and the masked branch VPPO
    reuses), plus VPPO's token fraction and advantage band.

    Defaults are the official VPPO 7B run (huaixuheqing/VPPO-RL at a23c54b, `examples/configs/train_vppo_7b.sh` with
    `examples/configs/config.yaml`; the 8B script uses the same VPPO values), not the dataclass defaults of its
    `verl/trainer/config.py` (0.2 and 0.8), which neither script uses.

    Parameters:
        > Parameters that control VPPO

        vppo_token_fraction (`float`, defaults to `0.4`):
            k, the share of each completion's tokens, the most visually dependent, that keep their policy gradient
            (official `top_p_perception_tokens`, 7B and 8B scripts: 0.4): `ceil(n * k)` of its `n` tokens. 1.0 keeps
            every token.
        vppo_advantage_scale_min (`float`, defaults to `0.9`):
            The bottom of the trajectory advantage band (official `advantage_scaling_min`, scripts: 0.9). The top is
            dynamic, `min + (1 - min) / mean`, so the scale averages to 1 over a micro-batch; 1.0 gives the band
            [1, 1] (no shaping).

        > PAPO-G fields whose defaults VPPO restates

        perception_loss_weight (`float`, defaults to `0.0`, fixed):
            VPPO never adds the perception KL to the loss; any other value is refused.
        mask_ratio (`float`, defaults to `0.5`):
            Official `random_patch_blackening(black_prob=0.5)` (`verl/workers/perc_utils.py` L5, L107): there each
            14-px square is blackened with probability 0.5; here exactly `round(0.5 * n)` of the `n` patches.
        mask_sharing (`str`, defaults to `"completion"`):
            The official masks are drawn per row of the rollout batch, that is per completion
            (`verl/workers/fsdp_workers.py` L501-L511, after the prompts are repeated); PAPO-G draws one per prompt.
        original_entropy_weight (`float`, defaults to `0.06`):
            The official entropy penalty (`use_entropy_penalty`, `entropy_penalty_coef` 0.06): `0.06 * mean(-log
            pi(o_t))` over all completion tokens added to the loss (`dp_actor.py` L564-L567), i.e. PAPO-G's eta1
            with the sampled estimator (its annealing discount is 1 at gamma 0).
        masked_branch (`str`, defaults to `"rollout"`, fixed):
            The official `aug_log_probs` are computed once per rollout batch with the rollout-time policy
            (`ray_trainer.py` L614-L619); `"update"` is refused.
        measure_perception_kl (`bool`, always `True`):
            VPPO reads the masked branch, so it always runs (set true whatever the value given).
        beta (`float`, defaults to `0.0`):
            Official `disable_kl: true` (`config.yaml` L21): no reference model.
        epsilon_high (`float`, defaults to `0.28`):
            Official `clip_ratio_high` (`config.yaml` L34); `epsilon` (low) 0.2 is TRL's default and the official.
        loss_type (`str`, defaults to `"dapo"`):
            The official loss is a token mean over the whole optimisation batch (`dp_actor.py` L570), which TRL's
            `"dapo"` normaliser reproduces.
    """

    vppo_token_fraction: float = field(
        default=0.4, metadata={"help": "k: share of each completion's most visually dependent tokens kept (0.4)."}
    )
    vppo_advantage_scale_min: float = field(
        default=0.9, metadata={"help": "Bottom of the trajectory advantage band (0.9); 1.0 turns shaping off."}
    )
    perception_loss_weight: float = field(
        default=0.0, metadata={"help": "gamma: fixed at 0 for VPPO (the KL is a signal, not a loss term)."}
    )
    mask_ratio: float = field(default=0.5, metadata={"help": "Fraction of the image blacked out (official 0.5)."})
    mask_sharing: str = field(
        default="completion",
        metadata={"help": "One mask per 'completion' (official VPPO) or per 'prompt'.", "choices": MASK_SHARING},
    )
    original_entropy_weight: float = field(
        default=0.06, metadata={"help": "Entropy penalty on original images (official VPPO: 0.06)."}
    )
    beta: float = field(default=0.0, metadata={"help": "Reference KL coefficient (official VPPO: 0, disable_kl)."})
    epsilon_high: float = field(default=0.28, metadata={"help": "Upper clip range (official VPPO: 0.28)."})
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss aggregation; 'dapo' is VPPO's token mean over the whole batch.",
            "choices": LOSS_TYPES,
        },
    )

    def __post_init__(self):
        self.validate_vppo_fields()
        self.measure_perception_kl = True
        super().__post_init__()

    def validate_vppo_fields(self) -> None:
        """Raise ValueError naming the field, its value and what is allowed, before any model loads."""
        check_field_rules(self, VPPO_FIELD_RULES, "VPPOConfig")
        for name, (value, why) in VPPO_FIXED.items():
            if getattr(self, name) != value:
                raise ValueError(f"VPPOConfig.{name}={getattr(self, name)!r} is invalid: {why}; allowed: {value!r}")
