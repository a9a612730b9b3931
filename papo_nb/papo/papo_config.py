"""PAPO-G configuration: every GRPOConfig field plus the perception and double-entropy fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from papo_nb.papo.contract import PAPO_PROBE_MAX_DEGENERATE_BATCHES

MASK_TYPES = ("patch", "merge_unit", "random")
GAMMA_SCHEDULES = ("fixed", "linear")


@dataclass
class PAPOGConfig(GRPOConfig):
    r"""Configuration for [`PAPOGTrainer`]: every [`~trl.GRPOConfig`] field, plus the PAPO-G ones below.

    Defaults follow the PAPO paper for PAPO-G (arXiv 2507.06448), not TRL 0.29.1's experimental trainer
    (which used gamma 0.1 and mask ratio 0.3).

    Parameters:
        perception_loss_weight (`float`, defaults to `0.02`):
            gamma, the weight of the perception KL that is *maximised* (subtracted from the loss). The paper
            uses 0.02 for PAPO-G 3B; 0.04 collapsed at 3B ("KL_prcp hacking").
        perception_loss_weight_final (`float`, defaults to `0.0`):
            gamma at the last step when `perception_loss_schedule="linear"`; ignored for `"fixed"`.
        perception_loss_schedule (`str`, defaults to `"fixed"`):
            `"fixed"` keeps gamma constant; `"linear"` anneals it linearly from `perception_loss_weight` to
            `perception_loss_weight_final` over `max_steps` optimizer steps.
        mask_type (`str`, defaults to `"patch"`):
            How the masked image is made from `pixel_values`: `"patch"` blacks out whole 14x14 vision patches
            (the processed-tensor equivalent of the official raw-image square mask), `"merge_unit"` whole 2x2
            merge units, `"random"` single pixel values. Masked values are black after normalisation.
        mask_ratio (`float`, defaults to `0.6`):
            Fraction of patches/units (or probability per value for `"random"`) that are blacked out.
            Paper ablation at 3B: 0.6 best; 1.0 raises collapse risk.
        mask_seed (`int`, defaults to `0`):
            Seed of the adapter's own `torch.Generator` for masks, so masking never touches global RNG.
        perception_kl_clamp (`float` or `None`, defaults to `None`):
            If set, clamp the per-token KL to `[0, perception_kl_clamp]` (official option: 0.2). Off by
            default, as in the official code.
        original_entropy_weight (`float`, defaults to `0.03`):
            eta1, weight of the entropy of the policy on original images (kept low; added to the loss). Its
            gradient is real: the adapter asks the parent for differentiable entropies when it is non-zero.
        masked_entropy_weight (`float`, defaults to `0.03`):
            eta2, weight of the entropy on masked images. With `masked_branch_grad=False` (official default)
            this term is a constant and contributes no gradient, as the official author confirmed (their issue
            20); set `masked_branch_grad=True` for it to regularise.
        masked_branch_grad (`bool`, defaults to `False`):
            Backpropagate through the masked forward. Off by default (official): the masked branch is a
            no-grad target, which halves the extra memory.
        require_gpu_contract_probe (`bool`, defaults to `False`):
            Run the gamma-zero reduction probe inside training until it has evidence (smoke and CI runs set
            this true; main runs leave it false so no probe code runs at all).
        probe_max_degenerate_batches (`int`, defaults to `20`):
            How many consecutive image-invariant batches (mean perception KL exactly 0) the probe may defer on
            before it fails as a wiring error.
    """

    perception_loss_weight: float = field(
        default=0.02, metadata={"help": "gamma: weight of the maximised perception KL."}
    )
    perception_loss_weight_final: float = field(
        default=0.0, metadata={"help": "gamma at the last step for the linear schedule."}
    )
    perception_loss_schedule: str = field(default="fixed", metadata={"help": "'fixed' or 'linear' gamma schedule."})
    mask_type: str = field(default="patch", metadata={"help": "'patch', 'merge_unit' or 'random'."})
    mask_ratio: float = field(default=0.6, metadata={"help": "Fraction of the image blacked out, in [0, 1]."})
    mask_seed: int = field(default=0, metadata={"help": "Seed of the masking generator."})
    perception_kl_clamp: float | None = field(
        default=None, metadata={"help": "Upper clamp of the per-token KL (None: off)."}
    )
    original_entropy_weight: float = field(default=0.03, metadata={"help": "eta1: entropy weight, original images."})
    masked_entropy_weight: float = field(default=0.03, metadata={"help": "eta2: entropy weight, masked images."})
    masked_branch_grad: bool = field(default=False, metadata={"help": "Backpropagate through the masked forward."})
    require_gpu_contract_probe: bool = field(default=False, metadata={"help": "Run the gamma-zero probe in training."})
    probe_max_degenerate_batches: int = field(
        default=PAPO_PROBE_MAX_DEGENERATE_BATCHES, metadata={"help": "Image-invariant batches the probe may defer on."}
    )
    beta: float = field(default=0.01, metadata={"help": "Reference KL coefficient (paper: 0.01)."})

    def __post_init__(self):
        self.validate_papo_fields()
        super().__post_init__()

    def validate_papo_fields(self) -> None:
        """Raise ValueError naming the field, its value and what is allowed, before any model loads."""

        def require(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"PAPOGConfig.{name}={getattr(self, name)!r} is invalid: expected {allowed}")

        finite = lambda v: (
            isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
        )  # noqa: E731
        require(
            finite(self.perception_loss_weight) and self.perception_loss_weight >= 0,
            "perception_loss_weight",
            "a finite number >= 0",
        )
        require(
            finite(self.perception_loss_weight_final) and self.perception_loss_weight_final >= 0,
            "perception_loss_weight_final",
            "a finite number >= 0",
        )
        require(
            self.perception_loss_schedule in GAMMA_SCHEDULES, "perception_loss_schedule", f"one of {GAMMA_SCHEDULES}"
        )
        require(self.mask_type in MASK_TYPES, "mask_type", f"one of {MASK_TYPES}")
        require(finite(self.mask_ratio) and 0.0 < self.mask_ratio <= 1.0, "mask_ratio", "a number in (0, 1]")
        require(isinstance(self.mask_seed, int) and not isinstance(self.mask_seed, bool), "mask_seed", "an int")
        require(
            self.perception_kl_clamp is None or (finite(self.perception_kl_clamp) and self.perception_kl_clamp > 0),
            "perception_kl_clamp",
            "None or a finite number > 0",
        )
        require(
            finite(self.original_entropy_weight) and self.original_entropy_weight >= 0,
            "original_entropy_weight",
            "a finite number >= 0",
        )
        require(
            finite(self.masked_entropy_weight) and self.masked_entropy_weight >= 0,
            "masked_entropy_weight",
            "a finite number >= 0",
        )
        require(isinstance(self.masked_branch_grad, bool), "masked_branch_grad", "a bool")
        require(isinstance(self.require_gpu_contract_probe, bool), "require_gpu_contract_probe", "a bool")
        require(
            isinstance(self.probe_max_degenerate_batches, int) and self.probe_max_degenerate_batches >= 1,
            "probe_max_degenerate_batches",
            "an int >= 1",
        )
