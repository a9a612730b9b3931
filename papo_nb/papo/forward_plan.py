"""The forward plan: what each forward of a run does, named once from the choices the trainer made at construction.

Four config fields shape the forward (``papo_config.FORWARD_FIELDS``); ``papo_config.forward_fields_problem`` refuses
an invalid combination of them before any model loads. At
construction the masked branch (``MaskedBranch.plan``) and prefix sharing (``PrefixSharing.reason``) each decide
their part against the model; ``forward_plan`` reads those decisions (it decides nothing again) into one frozen
object that the trainer logs, so a reader of the run's log sees every forward's form and why. ``Trainer.train``
changes the model after construction (it turns gradient checkpointing on, TRL's default), so at ``train()`` start
``ForwardPlanAtTrainStart`` reads prefix sharing's decision again against the model as it then is, and logs the plan
again where it changed (each forward decides again too: ``PrefixSharing.reason_now``); so does the trainer after
``prefix_sharing="auto"``'s first-batch check (``self_check.py``) turned sharing off (``refresh_forward_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class ForwardPlan:
    """``masked_branch``: when the masked forward runs (``"skipped for the run"``, ``"once per generation round"``
    or ``"in every loss call"``); ``masked_forward``: its form (``"prefill per prompt, no grad"``, ``"full, no
    grad"`` or ``"full, with gradient"``) and ``masked_forward_reason``; ``log_prob_forward``: every forward TRL routes
    through its log-prob method (``"packed per prompt group"`` or ``"plain per completion"``) and
    ``log_prob_reason``."""

    masked_branch: str
    masked_forward: str
    masked_forward_reason: str
    log_prob_forward: str
    log_prob_reason: str

    def describe(self) -> str:
        return (
            f"masked branch {self.masked_branch}, its forward {self.masked_forward} ({self.masked_forward_reason}); "
            f"log-prob forwards {self.log_prob_forward} ({self.log_prob_reason})"
        )


def forward_plan(args, masked_branch, prefix_sharing, model=None) -> ForwardPlan:
    """The plan of a trainer from its config and the decisions of its ``MaskedBranch`` and ``PrefixSharing``;
    given ``model``, prefix sharing's decision against that model as it is now (``PrefixSharing.reason_now``)."""
    if masked_branch.skipped:
        timing = "skipped for the run"
    else:
        timing = "once per generation round" if args.masked_branch == "rollout" else "in every loss call"
    if args.masked_branch_grad:
        form = "full, with gradient"
    else:
        form = "prefill per prompt, no grad" if masked_branch.plan.shared else "full, no grad"
    reason = prefix_sharing.reason if model is None else prefix_sharing.reason_now(model)
    packed = prefix_sharing.enabled and reason is None
    if packed:
        reason = f"{prefix_sharing.label}, supported here"
        if model is not None:
            reason += f"; {prefix_sharing.supported_description(model)}"
    elif prefix_sharing.mode == "auto" and not reason.startswith(prefix_sharing.label):
        reason = f"{prefix_sharing.label} off: {reason}"
    return ForwardPlan(
        masked_branch=timing,
        masked_forward=form,
        masked_forward_reason=masked_branch.plan.reason,
        log_prob_forward="packed per prompt group" if packed else "plain per completion",
        log_prob_reason=reason,
    )


class ForwardPlanAtTrainStart(TrainerCallback):
    """At ``train()`` start, after ``Trainer.train`` has set the model up (gradient checkpointing on): ``trainer``'s
    ``forward_plan`` read again against its model, and logged where it changed."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        refresh_forward_plan(self.trainer, "at train() start")


def refresh_forward_plan(trainer, when: str) -> None:
    """``trainer``'s ``forward_plan`` read again against its model now, and logged (saying ``when``) where it
    changed: at ``train()`` start, and after prefix sharing's first-batch check turned it off."""
    plan = forward_plan(trainer.args, trainer.masked_branch, trainer.prefix_sharing, trainer.model)
    if plan != trainer.forward_plan:
        logger.info("PAPO-G forward plan %s: %s", when, plan.describe())
    trainer.forward_plan = plan
