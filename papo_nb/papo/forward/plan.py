"""The forward plan: what each forward of a run does, named once from the choices the trainer made at construction.

Four config fields shape the forward (``masked_branch``, ``masked_forward``, ``masked_branch_grad``,
``prefix_sharing``); the masked branch (``MaskedBranch.plan``) and prefix sharing (``PrefixSharing.reason``) each
decide their part against the model. The plan reads those decisions (it decides nothing again) into one frozen
object that the trainer logs once, so a reader of the run's log sees every forward's form and why.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def forward_plan(args, masked_branch, prefix_sharing) -> ForwardPlan:
    """The plan of a trainer from its config and the decisions of its ``MaskedBranch`` and ``PrefixSharing``."""
    if masked_branch.skipped:
        timing = "skipped for the run"
    else:
        timing = "once per generation round" if args.masked_branch == "rollout" else "in every loss call"
    if args.masked_branch_grad:
        form = "full, with gradient"
    else:
        form = "prefill per prompt, no grad" if masked_branch.plan.shared else "full, no grad"
    packed = prefix_sharing.enabled and prefix_sharing.reason is None
    return ForwardPlan(
        masked_branch=timing,
        masked_forward=form,
        masked_forward_reason=masked_branch.plan.reason,
        log_prob_forward="packed per prompt group" if packed else "plain per completion",
        log_prob_reason="prefix_sharing=True, supported here" if packed else prefix_sharing.reason,
    )
