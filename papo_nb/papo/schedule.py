"""gamma_t, the weight of the perception KL, and the annealing discount d_t = gamma_t / gamma_0 of the entropy terms.

Fixed, or the official linear annealing (MikeWangWZHL/PAPO at fb63bf4, verl/trainer/core_algos.py L75-L90,
ray_trainer.py L327-L338) over ``int(total_steps * perception_annealing_ratio)`` optimizer steps, then held; the
discount is the official factor on both entropy terms
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L364-L381).
"""

from __future__ import annotations

from dataclasses import dataclass


def gamma_at(args, global_step: int, total_steps: int) -> float:
    """gamma at optimizer step ``global_step`` of a run of ``total_steps`` (<= 0: unknown, the schedule holds
    gamma_0); ``args`` is a ``PAPOGConfig``."""
    if args.perception_loss_schedule == "fixed" or total_steps <= 0:
        return args.perception_loss_weight
    span = max(1, int(total_steps * args.perception_annealing_ratio))
    progress = min(global_step / span, 1.0)
    start, end = args.perception_loss_weight, args.perception_loss_weight_final
    return start + (end - start) * progress


def perception_off_for_the_run(args) -> bool:
    """Whether gamma is 0 at every step: fixed at 0, or a linear schedule that starts and ends at 0."""
    fixed = args.perception_loss_schedule == "fixed"
    return args.perception_loss_weight == 0 and (fixed or args.perception_loss_weight_final == 0)


@dataclass(frozen=True)
class LossWeights:
    """The weights of one loss call: ``gamma`` (gamma_t), ``discount`` (d_t) and the effective entropy weights
    ``eta1`` / ``eta2`` (``original_entropy_weight`` / ``masked_entropy_weight`` times d_t)."""

    gamma: float
    discount: float
    eta1: float
    eta2: float


def loss_weights(args, global_step: int, total_steps: int) -> LossWeights:
    """The weights at optimizer step ``global_step`` (arguments as ``gamma_at``), gamma_t computed once; the
    discount is gamma_t / gamma_0, 1 when gamma_0 is 0 (the entropy terms then keep their weights)."""
    gamma = gamma_at(args, global_step, total_steps)
    gamma0 = args.perception_loss_weight
    discount = gamma / gamma0 if gamma0 > 0 else 1.0
    return LossWeights(gamma, discount, args.original_entropy_weight * discount, args.masked_entropy_weight * discount)
