"""Learning-signal health of a GRPO run: how many of its groups carried no signal.

A group whose completions all got the same reward has zero reward spread, so zero advantage: it moves the policy only
through the KL and PAPO terms. TRL logs the share of such groups per step as ``frac_reward_zero_std``. A run where
more than ``ZERO_STD_FLAG`` of the groups (averaged over its steps) had zero spread learned from less than half of
what it generated, and its results page says so.
"""

from __future__ import annotations

from mlflow import MlflowClient

ZERO_STD_METRIC = "frac_reward_zero_std"  # TRL's per-step share of groups with zero reward std
ZERO_STD_FLAG = 0.5  # above this mean share a run's page flags its learning signal as weak
SIGNAL_TAG = "papo_nb.signal_health"


def signal_health(client: MlflowClient, run_id: str) -> dict | None:
    """The run's zero-spread share per step and overall, and whether it is flagged; None for a run that trained
    nothing (no ``frac_reward_zero_std`` logged)."""
    history = sorted(client.get_metric_history(run_id, ZERO_STD_METRIC), key=lambda m: (m.step, m.timestamp))
    if not history:
        return None
    per_step = {m.step: m.value for m in history}  # the last value of a step logged twice
    share = sum(per_step.values()) / len(per_step)
    dead = [step for step, value in per_step.items() if value >= 1.0]
    flagged = share > ZERO_STD_FLAG
    message = (
        f"{'WEAK: ' if flagged else ''}{share:.0%} of the groups had zero reward spread (no advantage), averaged over "
        f"{len(per_step)} steps (flagged above {ZERO_STD_FLAG:.0%}); "
        + (f"no group carried signal at step(s) {', '.join(map(str, dead))}" if dead else "every step carried signal")
    )
    return {"share": share, "per_step": per_step, "dead_steps": dead, "flagged": flagged, "message": message}
