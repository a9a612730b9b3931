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
    r"""Configuration for [`PAPOGTrainer`]: every [`~trl.GRPOConfig`] field, plus the PAPO-G ones below.

    Defaults are the official PAPO-G 3B recipe (MikeWangWZHL/PAPO `examples/papo_grpo/qwen2_5_vl_3b_grpo_papo.sh`
    with `examples/configs/config_grpo_papo.yaml`), not TRL 0.29.1's experimental trainer (gamma 0.1, mask 0.3).
    `recipes.py` holds the official recipes as named presets.

    Parameters:
        > Parameters that control the perception KL

        perception_loss_weight (`float`, defaults to `0.02`):
            gamma, the weight of the perception KL that is *maximised* (subtracted from the loss). Official PAPO-G
            3B and 7B: 0.02; 0.04 collapsed at 3B ("KL_prcp hacking").
        perception_loss_weight_final (`float`, defaults to `0.0`):
            gamma at the end of the annealing when `perception_loss_schedule="linear"`; ignored for `"fixed"`.
        perception_loss_schedule (`str`, defaults to `"fixed"`):
            `"fixed"` keeps gamma constant (official recipes); `"linear"` anneals it linearly from
            `perception_loss_weight` to `perception_loss_weight_final` over the first
            `perception_annealing_ratio` of the run's optimizer steps (the official `annealing` schedule), then holds.
        perception_annealing_ratio (`float`, defaults to `0.5`):
            Fraction of the run's total optimizer steps (as the Trainer resolves them, epochs included) over which
            the linear schedule anneals (official `kl_prcp_schedule_args.annealing_ratio`, default 0.5).
        perception_kl_clamp (`float` or `None`, defaults to `None`):
            Optional extra clamp of the per-token KL to `[0, perception_kl_clamp]` (official
            `use_kl_prcp_clipping`, off; value 0.2). The official bounds (log-ratio in [-20, 20], k3 <= 10, fp32)
            always apply.

        > Parameters that control the masked image

        mask_type (`str`, defaults to `"auto"`):
            How the masked image is made from `pixel_values`: `"auto"` blacks out whole vision patches of the
            model's own patch size (the processed-tensor equivalent of the official raw-image 14-px squares) on
            whichever image layout the batch carries, detected from its keys and shapes (an unknown layout raises
            with the keys and shapes seen); `"merge_unit"` whole 2x2 merge units (Qwen-VL layouts only);
            `"random"` single pixel values inside real patches. Masked values are black after normalisation (see
            `mask_fill`); padding is never masked.
        mask_ratio (`float`, defaults to `0.6`):
            Fraction of patches/units (or probability per value for `"random"`) that are blacked out.
            Official `black_prob` 0.6; paper ablation at 3B: 0.6 best; 1.0 raises collapse risk.
        mask_sharing (`str`, defaults to `"prompt"`):
            `"prompt"`: one mask per prompt, shared by all its rollouts (official: the image is masked once before
            the rollouts are repeated); `"completion"`: an independent mask per completion.
        mask_seed (`int`, defaults to `0`):
            Seed of the adapter's own `torch.Generator` for masks; each process seeds it with
            `mask_seed + process_index`, so ranks draw different masks. Saved and restored with checkpoints.
        mask_fill (`str`, defaults to `"black"`):
            The colour masked patches take. `"black"`: black after normalisation (the official masking's aim);
            `"mean"`: the image processor's mean colour (0 after normalisation), for images whose background is
            black, where a black mask over the background changes no pixel. Both are constants, so the masks drawn
            for a seed are the same under either.
        mask_excluded_column (`str` or `None`, defaults to `None`):
            A dataset column listing, per example, the patch units never masked: indices into the example's real
            patch units (merge units with `mask_type="merge_unit"`) in `masking.select_units`' order (for Qwen-VL,
            the rows of `pixel_values`). An image then masks `round(mask_ratio * n)` of its `n` units or every unit
            it allows, whichever is fewer. A placebo mask excludes the patches that carry the task.
            `None`: any real patch may be masked. Needs a patch `mask_type` (not `"random"`).

        > Parameters that control the masked branch

        masked_branch (`str`, defaults to `"rollout"`):
            When the masked log-probs are computed. `"rollout"` (the official default,
            [verl/trainer/ray_trainer.py#L759-L769](https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/trainer/ray_trainer.py#L759-L769)):
            once per generation round, right after the completions are scored, under no-grad with the rollout-time
            policy, grouped by prompt; they travel with the round like TRL's `old_per_token_logps`, so with several
            optimizer steps (or `num_iterations`) per round the later steps compare the current policy with that
            rollout-time target. `"update"`: in every loss call with the current policy (required by
            `masked_branch_grad=True`, the official `RECOMPUTE_AUG_LOG_PROBS=True`).
        masked_branch_grad (`bool`, defaults to `False`):
            Backpropagate through the masked forward (official `RECOMPUTE_AUG_LOG_PROBS=False`: no). Needs
            `masked_branch="update"`.
        masked_forward (`str`, defaults to `"auto"`):
            How the no-grad masked branch runs. `"shared_prefix"`: the vision tower and the prompt's key/values once
            per prompt (and masked image), its completions run against that cache (`forward/prefill.py`; Qwen2-VL and
            Qwen2.5-VL, `masked_branch_grad=False`); `"full"`: one full forward per completion, as the parent
            computes log-probs; `"auto"`: the shared prefix where it applies (no grad, masks per prompt, a supported
            model, a prompt with two completions in the batch), else the full forward. The metric
            `papo/masked_forward_shared` says which ran, `papo/masked_forward_share` how many completions each
            prefill served, and a log line says why when it is the full one.

        > Parameters that control the entropy terms

        entropy_estimator (`str`, defaults to `"sampled"`):
            `"sampled"`: the official estimator `-mean(log pi(o_t))` over completion tokens, built from the log-probs
            the step already has (no vocabulary-sized tensor kept for backward); `"full"`: the exact
            full-vocabulary entropy (TRL 0.29.1's choice), which keeps the softmax alive for backward when eta1 > 0.
        original_entropy_weight (`float`, defaults to `0.0`):
            eta1, weight of the entropy on original images (kept low: added to the loss), scaled by the same
            annealing discount as gamma. Official 3B PAPO-G: off; 7B: 0.05.
        masked_entropy_weight (`float`, defaults to `0.0`):
            eta2, weight of the entropy on masked images, scaled by the discount. With `masked_branch_grad=False`
            (official default) this term is a constant and contributes no gradient, as the official author confirmed
            ([MikeWangWZHL/PAPO#20](https://github.com/MikeWangWZHL/PAPO/issues/20)); set
            `masked_branch_grad=True` (with `masked_branch="update"`) for it to regularise. Official 3B: off; 7B: 0.05.

        > Parameters that control the checks

        require_gpu_contract_probe (`bool`, defaults to `False`):
            Run the gamma-zero reduction probe inside training until it has evidence (smoke and CI runs set
            this true; main runs leave it false so no probe code runs at all).
        measure_perception_kl (`bool`, defaults to `False`):
            Run the masked branch even where nothing reads it (gamma 0 for the whole run, eta2 0, no probe), so the
            perception KL and the masked entropy are logged: a GRPO arm of a study then shows whether it stops
            looking at the image, and draws the same masks as its PAPO-G arms. Off, such a run skips the branch and
            costs what GRPOTrainer costs.
        probe_max_degenerate_batches (`int`, defaults to `20`):
            How many image-invariant batches (mean perception KL exactly 0), and separately how many underpowered
            batches (leak-detection power < 1), the probe may defer on before it ends.
        max_consecutive_nonfinite_grad_steps (`int`, defaults to `5`):
            An optimizer step whose gradient norm is not finite is skipped (its gradients dropped, as the official
            actor does:
            [verl/workers/actor/dp_actor.py#L185-L188](https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L185-L188)),
            logged and counted (`papo/nonfinite_grad_steps`); this many in a row stop the run with the norms seen.
        trainer_token_suppression (`str` or `bool`, defaults to `"auto"`):
            The tokens generation suppresses (the vision placeholders, `generation_kwargs`) are suppressed in the
            trainer's log-probs too (`token_suppression.py`), so that sampler and trainer score one distribution.
            `"auto"`: with `use_vllm`, whose importance-sampling ratio would read the renormalisation as off-policy
            sampling; True also on the HF path (where it changes the trained numbers); False: never.
        vllm_fidelity_every (`int`, defaults to `10`):
            With `use_vllm`: the rollout-fidelity guard (`vllm_rollouts.py`) checks the first vLLM round and then every
            this many rounds (0: the first only): vLLM's prompt ids must be the trainer's, and its sampling log-probs
            within `vllm_fidelity_logprob_tolerance` of the trainer's on the same weights, else the run stops.
        vllm_fidelity_logprob_tolerance (`float`, defaults to `0.05`):
            The largest mean |vLLM sampling log-prob - trainer log-prob| per completion token the guard accepts.

        > GRPO fields whose defaults PAPO-G restates

        beta (`float`, defaults to `0.01`):
            Reference KL coefficient (official `kl_coef` 1e-2, low_var_kl; the no-KL-reference recipes use 0).
        loss_type (`str`, defaults to `"bnpo"`):
            GRPO loss aggregation, stated rather than inherited (TRL's default is `"dapo"`). `"bnpo"` is the official
            `loss_avg_mode: token`: a token mean over each micro-batch divided by the accumulation steps. The PAPO
            terms are normalised exactly like the policy term for every loss type.
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
