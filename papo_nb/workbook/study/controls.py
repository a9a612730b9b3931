"""Controls matched on regularisation: is PAPO-G's recovery of GRPO's drift perception, or any regulariser that keeps
GRPO from learning the shortcut?

The shortcut testbed's reward pays for following the prior, so an arm that learns less of the reward drifts less,
whatever holds it back. Each control is plain GRPO (gamma 0) with one knob turned to hold it back: a larger reference
KL weight (``beta``), or a smaller learning rate. Its setting is matched to the strongest PAPO-G arm by a short search
on the search seed (no arm's): each value of its ladder is trained once and the one whose end-of-training accuracy
reward (``END_REWARD_WINDOW`` logged rollout batches) lies closest to that PAPO-G arm's is kept.

A third control, the placebo (``placebo.py``), is PAPO-G's own term against a mask that removes no task information:
the same regulariser's form, without the perception. It is matched on gamma (the strongest PAPO-G arm's) or on the
term's starting size (``placebo_kl_matched``), not searched.

Matched on reward, not on reference KL: the drift is what the reward buys, so two arms that earned the same reward
exploited the shortcut equally; a reference KL measures how far the answers moved from the warm start, which a
perception term can move by itself (it changes which tokens are likely on masked images, not only on these).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import mean

from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.study.placebo import PLACEBO_CONTROLS
from papo_nb.workbook.study.power import gain_detected

REWARD_KEY = "rewards/accuracy_reward/mean"
END_REWARD_WINDOW = 10  # logged rollout batches averaged for "the end of training" (the study's measure)
GRPO_BETA, GRPO_LR = "grpo_beta", "grpo_lr"
CONTROL_PARAMS = {GRPO_BETA: "beta", GRPO_LR: "learning_rate"}  # each control arm and the knob it turns
CONTROL_ARMS = tuple(CONTROL_PARAMS)
CONTROL_SEARCH = "control_search"  # the matched controls' search runs (and the target's), on the search seed
COMPARED_CONTROLS = (*CONTROL_ARMS, *PLACEBO_CONTROLS)  # every control PAPO-G is weighed against, placebos included


def end_reward(step_logs: list[dict], window: int = END_REWARD_WINDOW, key: str = REWARD_KEY) -> float:
    """The mean accuracy reward (``key``: another logged reward) of the last ``window`` logged rollout batches (NaN
    when none was logged)."""
    values = [row[key] for row in step_logs if math.isfinite(row.get(key, math.nan))]
    return mean(values[-window:]) if values else math.nan


@dataclass
class ControlMatch:
    """One control's search: the target reward, every (value, end reward) tried, and the value kept."""

    arm: str
    target: float
    tried: list[tuple[float, float]] = field(default_factory=list)

    @property
    def value(self) -> float:
        """The ladder's value whose end reward lies closest to the target (the first of equals)."""
        return min(self.tried, key=lambda pair: abs(pair[1] - self.target))[0]

    @property
    def margin(self) -> float:
        """The kept value's end reward minus the target: how well the match held."""
        return dict(self.tried)[self.value] - self.target

    def rows(self) -> list[dict]:
        return [
            {"control": self.arm, "knob": CONTROL_PARAMS[self.arm], "value": value, "end_reward": reward,
             "target": self.target, "kept": value == self.value}
            for value, reward in self.tried
        ]  # fmt: skip


def match_control(arm: str, ladder: list[float], target: float, train: Callable[[float], float]) -> ControlMatch:
    """Train ``arm`` at each value of ``ladder`` (``train(value) -> end reward``) and keep the closest to
    ``target``; raises on an unknown arm, an empty ladder or a target that is not a number."""
    if arm not in CONTROL_PARAMS:
        raise ValueError(f"control arm={arm!r} is unknown; allowed: {list(CONTROL_PARAMS)}")
    if not ladder:
        raise ValueError(f"control {arm}: its ladder of {CONTROL_PARAMS[arm]} values is empty")
    if not math.isfinite(target):
        raise ValueError(f"control {arm}: target end reward {target!r} is not a number (no reward logged)")
    match = ControlMatch(arm, target)
    for value in ladder:
        match.tried.append((value, train(value)))
    return match


def comparison_rows(
    results: dict[str, dict[int, dict]], treatment: str, metrics: tuple[str, ...], paired_test
) -> list[dict]:  # fmt: skip
    """The treatment (the strongest PAPO-G arm) against each control and GRPO, paired over seeds on each of
    ``metrics``: treatment - control with its 95% CI and p (``paired_test``)."""
    rows = []
    for control in [arm for arm in ("grpo", *COMPARED_CONTROLS) if arm in results]:
        for metric in metrics:
            seeds = sorted(s for s in set(results[treatment]) & set(results[control]) if metric in results[control][s])
            if not seeds:
                continue
            test = paired_test(
                [results[treatment][s][metric] for s in seeds], [results[control][s][metric] for s in seeds]
            )
            rows.append({"against": control, "metric": metric, "pairs": len(seeds), **test})
    return rows


def control_verdict(rows: list[dict], treatment: str, primary: str, gap: str, where: dict | None = None) -> str:
    """Two sentences: whether ``treatment`` keeps more of ``primary`` (prior-breaking accuracy) and ``gap`` (the
    reliance gap) than every control (matched on reward, and the placebo where it ran), and which control came
    closest on ``primary``. ``where`` (``placebo_arm.where_row``: PAPO-G with the placebo's fill against the placebo,
    only the mask's place differing) must show a gain too before the gain is called perception-specific."""
    by = {(row["against"], row["metric"]): row for row in rows}
    controls = [arm for arm in COMPARED_CONTROLS if (arm, primary) in by]
    if not controls:
        return "No matched control ran: nothing here separates perception from regularisation."
    beats = [
        arm for arm in controls
        if all(gain_detected(by[arm, m]) for m in (primary, gap) if (arm, m) in by)
    ]  # fmt: skip
    closest = min(controls, key=lambda arm: by[arm, primary]["diff"])
    row = by[closest, primary]
    placebo = any(arm in PLACEBO_CONTROLS for arm in controls)
    every = "every control (the placebo included)" if placebo else "every matched control"
    first = (
        f"{treatment} keeps more prior-breaking accuracy and a larger reliance gap than {every} "
        "(paired p < 0.05 on both), so its gain here is perception-specific."
        if len(beats) == len(controls)
        else f"{treatment} does not beat {every} on both prior-breaking accuracy and the reliance gap "
        f"(it does against {', '.join(beats) or 'none'}), so its gain here is not shown to be perception-specific."
    )
    if len(beats) == len(controls) and where is not None and not gain_detected(where):
        first = (
            f"{treatment} keeps more prior-breaking accuracy and a larger reliance gap than {every} (paired p < 0.05 "
            f"on both), but with the placebo's fill covering the square does no better than the placebo "
            f"({where['contrast']} = {where['diff']:+.3f}, p = {where['p_value']:.2g}), so its gain here is not shown "
            "to be perception-specific."
        )
    second = (
        f"The closest control is {closest}: {treatment} - {closest} = {row['diff']:+.3f} +/- {row['diff_ci95']:.3f} "
        f"(p = {row['p_value']:.2g}, {row['pairs']} seed pairs) on prior-breaking avg@k."
    )
    return f"{first} {second}"


def match_controls(params: WorkbookParams, train, seed: int, strongest: tuple, log) -> list[ControlMatch]:
    """The matched controls (``study.controls``): the strongest PAPO-G arm trained on the search seed sets the
    target end reward, and each control's ladder is searched there (none without a ladder)."""
    ladders = {GRPO_BETA: params.study_control_betas, GRPO_LR: params.study_control_learning_rates}
    if not any(ladders.values()):
        return []
    arm, gamma, _ = strongest
    target = end_reward(train(f"{CONTROL_SEARCH}_{arm}", seed, gamma).step_logs)
    log(f"control target: {arm} (gamma {gamma:g}) on seed {seed} ends at accuracy reward {target:.3f}")
    matches = []
    for control, ladder in ladders.items():
        if not ladder:
            continue
        knob = CONTROL_PARAMS[control]

        def control_reward(value: float, knob: str = knob) -> float:
            return end_reward(train(CONTROL_SEARCH, seed, 0.0, overrides={knob: value}).step_logs)

        matches.append(match_control(control, list(ladder), target, control_reward))
        log(f"{control}: {knob} {matches[-1].value:g}, end reward {matches[-1].margin:+.3f} from the target")
    return matches
