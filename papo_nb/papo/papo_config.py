"""PAPO-G configuration: every GRPOConfig field plus the perception and double-entropy fields.

Every PAPO field carries its rule (``FIELD_RULES``, read by ``check_field_rules``) and, where it has a closed set of
values, its choices in ``field.metadata["choices"]``: the workbook derives its params schema from this dataclass, so
nothing is typed twice.

The four fields that shape the forward (``masked_branch``, ``masked_branch_grad``, ``masked_forward``,
``prefix_sharing``) are checked together in one place, ``forward_fields_problem``; the plan a trainer logs is
``forward_plan.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ..prefix_sharing.config import (
    AUTO_OR_BOOL,
    SHARING_FIELD_RULES,
    PrefixSharingConfig,
    check_field_rules,
    sharing_fields_problem,
)
from .contract import PAPO_PROBE_MAX_DEGENERATE_BATCHES
from .masking import MASK_FILLS

MASK_TYPES = ("auto", "merge_unit", "random")
MASK_SHARING = ("prompt", "completion")
GAMMA_SCHEDULES = ("fixed", "linear")
ENTROPY_ESTIMATORS = ("sampled", "full")
MASKED_FORWARDS = ("auto", "full", "shared_prefix")
MASKED_BRANCH_TIMINGS = ("rollout", "update")
# Every loss_type TRL 1.9.1's GRPOTrainer._compute_loss aggregates (grpo_trainer.py:3124-3153).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# name -> (rule, what is allowed); one table serves PAPOGConfig.__post_init__ and the workbook's params schema.
FIELD_RULES = {
    "perception_loss_weight": (lambda v: is_finite_number(v) and v >= 0, "a finite number >= 0"),
    "perception_loss_weight_final": (lambda v: is_finite_number(v) and v >= 0, "a finite number >= 0"),
    "perception_loss_schedule": (lambda v: v in GAMMA_SCHEDULES, f"one of {GAMMA_SCHEDULES}"),
    "perception_annealing_ratio": (lambda v: is_finite_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "perception_kl_clamp": (lambda v: v is None or (is_finite_number(v) and v > 0), "None or a finite number > 0"),
    "mask_type": (lambda v: v in MASK_TYPES, f"one of {MASK_TYPES}"),
    "mask_ratio": (lambda v: is_finite_number(v) and 0.0 < v <= 1.0, "a number in (0, 1]"),
    "mask_sharing": (lambda v: v in MASK_SHARING, f"one of {MASK_SHARING}"),
    "mask_seed": (is_int, "an int"),
    "mask_fill": (lambda v: v in MASK_FILLS, f"one of {MASK_FILLS}"),
    "mask_excluded_column": (
        lambda v: v is None or (isinstance(v, str) and v != ""),
        "None or the name of a dataset column",
    ),
    "entropy_estimator": (lambda v: v in ENTROPY_ESTIMATORS, f"one of {ENTROPY_ESTIMATORS}"),
    "original_entropy_weight": (lambda v: is_finite_number(v) and v >= 0, "a finite number >= 0"),
    "masked_entropy_weight": (lambda v: is_finite_number(v) and v >= 0, "a finite number >= 0"),
    "masked_branch_grad": (lambda v: isinstance(v, bool), "a bool"),
    "masked_forward": (lambda v: v in MASKED_FORWARDS, f"one of {MASKED_FORWARDS}"),
    "masked_branch": (lambda v: v in MASKED_BRANCH_TIMINGS, f"one of {MASKED_BRANCH_TIMINGS}"),
    **SHARING_FIELD_RULES,
    "max_consecutive_nonfinite_grad_steps": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "trainer_token_suppression": (lambda v: v == "auto" or isinstance(v, bool), f"one of {AUTO_OR_BOOL}"),
    "vllm_fidelity_every": (lambda v: is_int(v) and v >= 0, "an int >= 0"),
    "vllm_fidelity_logprob_tolerance": (lambda v: is_finite_number(v) and v > 0, "a finite number > 0"),
    "require_gpu_contract_probe": (lambda v: isinstance(v, bool), "a bool"),
    "measure_perception_kl": (lambda v: isinstance(v, bool), "a bool"),
    "probe_max_degenerate_batches": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "beta": (lambda v: is_finite_number(v) and v >= 0, "a finite number >= 0"),
    "loss_type": (lambda v: v in LOSS_TYPES, f"one of {LOSS_TYPES}"),
}


FORWARD_FIELDS = ("masked_branch", "masked_branch_grad", "masked_forward", "prefix_sharing")


def forward_fields_problem(args) -> str | None:
    """What is wrong with the combination of the forward fields of ``args`` (a ``PAPOGConfig`` whose fields each
    passed their own rule), naming every field it joins with its value and what is allowed, or None. The only place
    these combinations are checked (prefix sharing's own rule first: ``sharing_fields_problem``)."""
    if args.masked_forward == "shared_prefix" and args.masked_branch_grad:
        return (
            "masked_forward='shared_prefix' is invalid with masked_branch_grad=True: the shared prefix is a no-grad "
            "path; allowed: masked_forward 'auto' or 'full', or masked_branch_grad=False"
        )
    sharing_problem = sharing_fields_problem(args)
    if sharing_problem is not None:
        return sharing_problem
    if (
        args.masked_forward == "shared_prefix"
        and args.mask_sharing == "completion"
        and args.masked_branch == "rollout"
    ):
        # The rollout pass prefills each prompt once with one mask (its first rollout's): per-completion masks
        # would silently become one mask per prompt there.
        return (
            "masked_forward='shared_prefix' is invalid with mask_sharing='completion' and masked_branch='rollout': "
            "the rollout pass masks and prefills each prompt once, so every completion would get its prompt's first "
            "mask; allowed: mask_sharing='prompt', masked_forward 'auto' or 'full' (a full forward per completion, "
            "each with its own mask), or masked_branch='update'"
        )
    if args.masked_branch == "rollout" and args.masked_branch_grad:
        return (
            "masked_branch='rollout' is invalid with masked_branch_grad=True: the rollout-time masked branch is "
            "computed once per generation round without gradient; allowed: masked_branch='update' (the official "
            "RECOMPUTE_AUG_LOG_PROBS=True), or masked_branch_grad=False"
        )
    return None


@dataclass
class PAPOGConfig(PrefixSharingConfig):
    r"""Configuration for [`PAPOGTrainer`]: every [`PrefixSharingConfig`] (so [`~trl.GRPOConfig`]) field, plus the
    PAPO-G ones below. Defaults are the official PAPO-G 3B recipe (MikeWangWZHL/PAPO
    `examples/papo_grpo/qwen2_5_vl_3b_grpo_papo.sh`); `recipes.py` holds the official recipes as presets. How each
    field acts: [docs/adapter.md](../../docs/adapter.md) and [docs/masked_branch.md](../../docs/masked_branch.md).

    Parameters:
        > Parameters that control the perception KL

        perception_loss_weight (`float`, defaults to `0.02`):
            gamma, the weight of the perception KL, which is maximised. Official 3B and 7B: 0.02 (0.04 collapsed).
        perception_loss_weight_final (`float`, defaults to `0.0`):
            gamma at the end of the `"linear"` schedule.
        perception_loss_schedule (`str`, defaults to `"fixed"`):
            `"fixed"` (official recipes) or `"linear"` (the official annealing from `perception_loss_weight` to
            `perception_loss_weight_final`).
        perception_annealing_ratio (`float`, defaults to `0.5`):
            Fraction of the run's optimizer steps the linear schedule anneals over. Official: 0.5.
        perception_kl_clamp (`float` or `None`, defaults to `None`):
            Extra clamp of the per-token KL to `[0, value]` (official `use_kl_prcp_clipping`: off, value 0.2). The
            official bounds (log-ratio in [-20, 20], k3 <= 10, fp32) always apply.

        > Parameters that control the masked image

        mask_type (`str`, defaults to `"auto"`):
            `"auto"`: whole vision patches of the model's patch size, on any image layout (the official 14-px
            squares); `"merge_unit"`: whole 2x2 merge units (Qwen-VL); `"random"`: single values in real patches.
        mask_ratio (`float`, defaults to `0.6`):
            Fraction of patches (or units, or values) masked. Official `black_prob`: 0.6.
        mask_sharing (`str`, defaults to `"prompt"`):
            `"prompt"`: one mask per prompt, shared by its rollouts (official); `"completion"`: one per completion.
        mask_seed (`int`, defaults to `0`):
            Seed of the masking generator (plus the process index); saved and restored with checkpoints.
        mask_fill (`str`, defaults to `"black"`):
            Masked patches' colour: `"black"` after normalisation (official) or the processor's `"mean"`.
        mask_excluded_column (`str` or `None`, defaults to `None`):
            A dataset column of per-example patch units never masked (a placebo mask); needs a patch `mask_type`.

        > Parameters that control the masked branch

        masked_branch (`str`, defaults to `"rollout"`):
            When the masked log-probs are computed: `"rollout"`, once per generation round with the rollout-time
            policy (official); `"update"`, in every loss call.
        masked_branch_grad (`bool`, defaults to `False`):
            Backpropagate through the masked forward (official `RECOMPUTE_AUG_LOG_PROBS=False`: no); needs
            `masked_branch="update"`.
        masked_forward (`str`, defaults to `"auto"`):
            The no-grad masked branch's form: `"shared_prefix"` (each prompt prefilled once, `prefill.py`), `"full"`
            (a forward per completion) or `"auto"` (the shared prefix where it applies).

        > Parameters that control the entropy terms

        entropy_estimator (`str`, defaults to `"sampled"`):
            `"sampled"`: `-mean(log pi(o_t))` (official); `"full"`: the full-vocabulary entropy.
        original_entropy_weight (`float`, defaults to `0.0`):
            eta1, the entropy weight on original images, scaled by gamma's discount. Official 3B: 0; 7B: 0.05.
        masked_entropy_weight (`float`, defaults to `0.0`):
            eta2, the entropy weight on masked images; a constant without `masked_branch_grad` (MikeWangWZHL/PAPO#20).
            Official 3B: 0; 7B: 0.05.

        > Parameters that control the checks

        require_gpu_contract_probe (`bool`, defaults to `False`):
            Run the gamma-zero probe inside training until it has evidence (smoke and CI runs).
        measure_perception_kl (`bool`, defaults to `False`):
            Run the masked branch where nothing reads it (a GRPO arm), to log the perception KL.
        probe_max_degenerate_batches (`int`, defaults to `20`):
            Image-invariant (and, apart, underpowered) batches the probe may defer on.
        max_consecutive_nonfinite_grad_steps (`int`, defaults to `5`):
            A step with a non-finite gradient norm is skipped (as the official actor does); this many in a row stop
            the run.
        trainer_token_suppression (`str` or `bool`, defaults to `"auto"`):
            Suppress the tokens generation bans in the trainer's log-probs too; `"auto"`: with `use_vllm`.
        vllm_fidelity_every (`int`, defaults to `10`):
            With `use_vllm`: vLLM rounds between rollout-fidelity checks after the first (0: the first only).
        vllm_fidelity_logprob_tolerance (`float`, defaults to `0.05`):
            The largest mean |vLLM - trainer| log-prob per completion token the fidelity guard accepts.

        > GRPO fields whose defaults PAPO-G restates

        beta (`float`, defaults to `0.01`):
            Reference KL coefficient. Official `kl_coef`: 0.01.
        loss_type (`str`, defaults to `"bnpo"`):
            Loss aggregation; `"bnpo"` is the official token mean (TRL's default is `"dapo"`).
    """

    perception_loss_weight: float = field(
        default=0.02, metadata={"help": "gamma: weight of the maximised perception KL (official PAPO-G: 0.02)."}
    )
    perception_loss_weight_final: float = field(
        default=0.0, metadata={"help": "gamma at the end of the annealing for the linear schedule."}
    )
    perception_loss_schedule: str = field(
        default="fixed", metadata={"help": "'fixed' or 'linear' gamma schedule.", "choices": GAMMA_SCHEDULES}
    )
    perception_annealing_ratio: float = field(
        default=0.5, metadata={"help": "Fraction of the total steps the linear schedule anneals over (official 0.5)."}
    )
    perception_kl_clamp: float | None = field(
        default=None, metadata={"help": "Extra upper clamp of the per-token KL (None: off; official option 0.2)."}
    )
    mask_type: str = field(
        default="auto",
        metadata={
            "help": "'auto' (whole patches, any layout), 'merge_unit' or 'random'.",
            "choices": MASK_TYPES,
        },
    )
    mask_ratio: float = field(default=0.6, metadata={"help": "Fraction of the image blacked out, in (0, 1]."})
    mask_sharing: str = field(
        default="prompt",
        metadata={"help": "One mask per 'prompt' (official) or per 'completion'.", "choices": MASK_SHARING},
    )
    mask_seed: int = field(default=0, metadata={"help": "Seed of the masking generator (plus the process index)."})
    mask_fill: str = field(
        default="black",
        metadata={
            "help": "Masked patches' colour: 'black' (normalised) or the processor's 'mean'.",
            "choices": MASK_FILLS,
        },
    )
    mask_excluded_column: str | None = field(
        default=None,
        metadata={"help": "Dataset column of per-example patch units never masked (None: any real patch)."},
    )
    entropy_estimator: str = field(
        default="sampled",
        metadata={
            "help": "'sampled' -mean(log p) (official) or 'full' vocabulary entropy.",
            "choices": ENTROPY_ESTIMATORS,
        },
    )
    original_entropy_weight: float = field(default=0.0, metadata={"help": "eta1: entropy weight, original images."})
    masked_entropy_weight: float = field(default=0.0, metadata={"help": "eta2: entropy weight, masked images."})
    masked_branch: str = field(
        default="rollout",
        metadata={
            "help": "When the masked branch runs: 'rollout' (once per generation round, official) or 'update'.",
            "choices": MASKED_BRANCH_TIMINGS,
        },
    )
    masked_branch_grad: bool = field(default=False, metadata={"help": "Backpropagate through the masked forward."})
    masked_forward: str = field(
        default="auto",
        metadata={
            "help": "Masked branch: 'shared_prefix' (prompt key/values once per prompt), 'full', or 'auto'.",
            "choices": MASKED_FORWARDS,
        },
    )
    require_gpu_contract_probe: bool = field(default=False, metadata={"help": "Run the gamma-zero probe in training."})
    measure_perception_kl: bool = field(
        default=False, metadata={"help": "Run the masked branch where nothing reads it, to log the perception KL."}
    )
    probe_max_degenerate_batches: int = field(
        default=PAPO_PROBE_MAX_DEGENERATE_BATCHES,
        metadata={"help": "Image-invariant (and, apart, underpowered) batches the probe may defer on."},
    )
    max_consecutive_nonfinite_grad_steps: int = field(
        default=5, metadata={"help": "Optimizer steps with a non-finite gradient norm in a row before the run stops."}
    )
    trainer_token_suppression: str | bool = field(
        default="auto",
        metadata={
            "help": "Suppress the tokens generation bans in the trainer's log-probs too: 'auto' (with vLLM), True "
            "or False.",
            "choices": AUTO_OR_BOOL,
        },
    )
    vllm_fidelity_every: int = field(
        default=10, metadata={"help": "vLLM rounds between rollout-fidelity checks after the first (0: first only)."}
    )
    vllm_fidelity_logprob_tolerance: float = field(
        default=0.05, metadata={"help": "Largest mean |vLLM - trainer| log-prob per token the guard accepts."}
    )
    beta: float = field(default=0.01, metadata={"help": "Reference KL coefficient (official: 0.01)."})
    loss_type: str = field(
        default="bnpo",
        metadata={"help": "Loss aggregation; 'bnpo' is the official token mean.", "choices": LOSS_TYPES},
    )

    def __post_init__(self):
        self.validate_papo_fields()
        super().__post_init__()

    def validate_papo_fields(self) -> None:
        """Raise ValueError naming the field, its value and what is allowed, before any model loads."""
        check_field_rules(self, FIELD_RULES, "PAPOGConfig")
        forward_problem = forward_fields_problem(self)  # every combination of the forward fields, in one place
        if forward_problem is not None:
            raise ValueError(f"PAPOGConfig.{forward_problem}")
        if self.mask_excluded_column is not None and self.mask_type == "random":
            raise ValueError(
                f"PAPOGConfig.mask_excluded_column={self.mask_excluded_column!r} is invalid with mask_type='random': "
                "it excludes patch units, 'random' masks single values; allowed: mask_type 'auto' or 'merge_unit'"
            )
        if self.use_liger_kernel:
            # GRPOTrainer.compute_loss sends a Liger run to compute_liger_loss and never calls _compute_loss
            # (grpo_trainer.py:2913-2917): the PAPO terms and the probe would vanish without a word.
            raise ValueError(
                "PAPOGConfig.use_liger_kernel=True is invalid: GRPOTrainer's Liger loss bypasses _compute_loss, so "
                "the perception and entropy terms would silently not be trained; allowed: False"
            )


def papo_fields() -> tuple:
    """The dataclass fields PAPOGConfig declares itself (the PAPO ones and the GRPO defaults it restates)."""
    return tuple(f for f in fields(PAPOGConfig) if f.name in FIELD_RULES)
