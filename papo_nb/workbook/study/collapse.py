"""The study's collapse detector, read from per-step training logs.

The collapse symptoms are the PAPO paper's ("KL_prcp hacking", arXiv 2507.06448; the spec's PAPO_FACTS.md): the
perception loss (= -KL_prcp) falls from about -0.05 to about -1.0, both entropies rise, the high clip ratio rises from
about 5e-4 to about 7e-3 and the reward drops. One symptom is added that the paper does not list, because the
testbed showed it: the perception KL *vanishing*, the policy answering the same with and without the image.

The KL's absolute level is the paper's 3B/7B picture; a tiny policy hacks the KL from a lower base. So a KL that rises
several-fold while an entropy rises is the paper's KL_prcp hacking at any level (the 1.0-nat floor only marks a
blow-up that fires with any other symptom). Step logs cannot see every collapse: ``heldout_verdict`` also flags a run
whose held-out accuracy falls far below GRPO's on the same seed, and names a score of 0 what it is, broken output.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import mean, median


@dataclass
class CollapseRule:
    r"""When a run counts as collapsed, from per-step training logs.

    A step fires when the perception KL has blown up (the paper's KL_prcp hacking) or the accuracy reward has
    dropped, together with at least one other symptom. Every value is a mean over the last `window` logged values,
    compared with the median of the first `baseline_steps` logged values.

    Parameters:
        baseline_steps (`int`, defaults to `3`):
            Logged values that make each metric's baseline (the start of training).
        window (`int`, defaults to `5`):
            Logged values averaged at each step, so a few noisy batches do not fire the detector.
        kl_factor (`float`, defaults to `4.0`):
            The KL has blown up when it is at least this multiple of its baseline...
        kl_floor (`float`, defaults to `1.0`):
            ...and at least this many nats per token (the paper's collapsed perception loss is about -1.0).
        kl_vanish_fraction (`float`, defaults to `0.1`):
            The KL has vanished (not a paper symptom) when it is at most this fraction of its baseline.
        entropy_factor (`float`, defaults to `2.0`):
            An entropy (original or masked images) has risen when it is this multiple of its baseline...
        entropy_min_rise (`float`, defaults to `0.1`):
            ...and at least this many nats above it (a near-zero baseline would otherwise fire on noise).
        clip_high (`float`, defaults to `0.007`):
            High clip ratio at or above this counts (the paper's collapsed value; healthy is about 5e-4).
        reward_drop (`float`, defaults to `0.2`):
            The accuracy reward has dropped when it is this much below its baseline (rewards lie in [0, 1]).
        heldout_drop (`float`, defaults to `0.15`):
            A run whose held-out accuracy (avg@k, all items) lies this far below GRPO's on the same seed has
            collapsed, whatever its step logs show (``heldout_verdict``).
    """

    baseline_steps: int = field(default=3, metadata={"help": "Logged values that make each metric's baseline."})
    window: int = field(default=5, metadata={"help": "Logged values averaged at each step."})
    kl_factor: float = field(default=4.0, metadata={"help": "KL blow-up: this multiple of its baseline..."})
    kl_floor: float = field(default=1.0, metadata={"help": "...and at least this many nats per token."})
    kl_vanish_fraction: float = field(default=0.1, metadata={"help": "KL vanished: this fraction of baseline."})
    entropy_factor: float = field(default=2.0, metadata={"help": "Entropy rise: this multiple of its baseline..."})
    entropy_min_rise: float = field(default=0.1, metadata={"help": "...and at least this many nats above it."})
    clip_high: float = field(default=0.007, metadata={"help": "High clip ratio at or above this counts."})
    reward_drop: float = field(default=0.2, metadata={"help": "Accuracy reward this far below its baseline."})
    heldout_drop: float = field(
        default=0.15, metadata={"help": "Held-out accuracy this far below GRPO's on the same seed flags a collapse."}
    )


# symptom -> (metric in TRL's / the adapter's logs, whether the paper lists it)
SYMPTOMS = {
    "perception_kl_blowup": ("perception_kl", True),
    "perception_kl_rise": ("perception_kl", True),
    "perception_kl_vanished": ("perception_kl", False),
    "entropy_rise": ("entropy", True),
    "masked_entropy_rise": ("masked_entropy", True),
    "high_clip_ratio": ("clip_ratio/high_mean", True),
    "reward_drop": ("rewards/accuracy_reward/mean", True),
}
TRIGGERS = ("perception_kl_blowup", "reward_drop")
ENTROPY_RISES = {"entropy_rise", "masked_entropy_rise"}
HACKING = "KL_prcp hacking (paper)"
BLIND = "image-blind collapse (not the paper's)"
HELD_OUT_SCORE = "avg_at_k/original/all"


def _series(step_logs: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(h["step"]), float(h[key])) for h in step_logs if h.get(key) is not None and math.isfinite(h[key])]


def _holds(rule: CollapseRule, symptom: str, baseline: float, value: float) -> bool:
    if symptom == "perception_kl_blowup":
        return value >= max(rule.kl_factor * baseline, rule.kl_floor)
    # A rise or a fall is a ratio to the baseline, which a KL of 0 at the start has not: every value would be a
    # 4-fold "rise" of 0 and a value of 0 its "vanishing" too (a GRPO run whose masked branch never ran logs 0)
    if symptom == "perception_kl_rise":
        return baseline > 0 and value >= rule.kl_factor * baseline
    if symptom == "perception_kl_vanished":
        return baseline > 0 and value <= rule.kl_vanish_fraction * baseline
    if symptom in ("entropy_rise", "masked_entropy_rise"):
        return value >= rule.entropy_factor * baseline and value - baseline >= rule.entropy_min_rise
    if symptom == "high_clip_ratio":
        return value >= rule.clip_high
    return value <= baseline - rule.reward_drop


def _fires(holding: list[str]) -> tuple[bool, bool]:
    """(fires, is KL hacking) for the symptoms holding at one step: a several-fold KL rise with a rising entropy is
    hacking; otherwise a trigger needs one more symptom (a blow-up's rise does not count as another)."""
    hacking = "perception_kl_rise" in holding and bool(ENTROPY_RISES & set(holding))
    others = [symptom for symptom in holding if symptom != "perception_kl_rise"]
    hacking = hacking or ("perception_kl_blowup" in others and len(others) >= 2)
    return hacking or (any(t in others for t in TRIGGERS) and len(others) >= 2), hacking


def detect_collapse(step_logs: list[dict], rule: CollapseRule | None = None) -> dict:
    """``collapsed`` and ``step``: the first step where the KL rose several-fold with an entropy, or a trigger (KL
    blow-up or reward drop) held with at least one other symptom; ``mode`` says whether it looks like the paper's
    KL_prcp hacking (the KL rose) or not; ``first_seen`` is the first step each symptom held (None if never)."""
    rule = rule or CollapseRule()
    state: dict[str, dict] = {}
    for symptom, (key, _) in SYMPTOMS.items():
        series = _series(step_logs, key)
        if len(series) > rule.baseline_steps:
            state[symptom] = {"series": series, "baseline": median(v for _, v in series[: rule.baseline_steps])}
    first_seen: dict[str, int | None] = dict.fromkeys(SYMPTOMS)
    fired_at, fired_with, mode = None, [], None
    for step in sorted({s for item in state.values() for s, _ in item["series"]}):
        holding = []
        for symptom, item in state.items():
            recent = [v for s, v in item["series"] if s <= step][-rule.window :]
            if len(recent) == rule.window and _holds(rule, symptom, item["baseline"], mean(recent)):
                holding.append(symptom)
                first_seen[symptom] = first_seen[symptom] or step
        fires, hacking = _fires(holding)
        if fired_at is None and fires:
            fired_at, fired_with, mode = step, holding, HACKING if hacking else BLIND
    return {
        "collapsed": fired_at is not None,
        "step": fired_at,
        "mode": mode,
        "symptoms": fired_with,
        "first_seen": first_seen,
        "baselines": {symptom: item["baseline"] for symptom, item in state.items()},
        "rule": asdict(rule),
    }


def heldout_verdict(verdict: dict, scores: dict[str, float], control: dict[str, float] | None, rule: CollapseRule):
    """``verdict`` (``detect_collapse``'s) with the held-out evidence added: a score ``rule.heldout_drop`` or more
    below GRPO's on the same seed (``control``, None for GRPO itself) is a collapse the step logs may have missed
    (``detected_by`` says which evidence flagged it); a score of 0 is labelled broken output, not chance (a policy
    that never answered, as the random tiny model, is broken in every arm, which no gamma caused)."""
    score = scores[HELD_OUT_SCORE]
    below = control is not None and score <= control[HELD_OUT_SCORE] - rule.heldout_drop
    verdict = {**verdict, "heldout": {"score": score, "control": None if control is None else control[HELD_OUT_SCORE]}}
    verdict["detected_by"] = [name for name, hit in (("step logs", verdict["collapsed"]), ("held-out", below)) if hit]
    if below and not verdict["collapsed"]:
        verdict.update(collapsed=True, mode="held-out accuracy far below GRPO's")
    if score == 0.0:  # named for what it is; a collapse only where GRPO on the same seed scores (the drop above)
        broken = "broken output (held-out accuracy 0)"
        verdict["mode"] = f"{verdict['mode']}; {broken}" if verdict["mode"] else broken
    return verdict


def collapse_margin(step_logs: list[dict], rule: CollapseRule | None = None) -> dict[str, float]:
    """How near each of the paper's KL_prcp-hacking symptoms came to firing over the run: the largest windowed value
    (the mean of ``rule.window`` logged values, as ``detect_collapse`` reads them) over the level where it fires, so
    1.0 or more fired and 0.8 stopped 20% short. ``perception_kl_rise``: the KL over ``kl_factor`` times its
    baseline; each entropy: its rise over the larger of ``entropy_factor`` times the baseline and the baseline plus
    ``entropy_min_rise``. A search call's verdict with this beside it says how close the call was."""
    rule = rule or CollapseRule()
    margins = {}
    for symptom, factor in (("perception_kl_rise", rule.kl_factor), ("entropy_rise", None),
                            ("masked_entropy_rise", None)):  # fmt: skip
        values = [v for _, v in _series(step_logs, SYMPTOMS[symptom][0])]
        if len(values) <= rule.baseline_steps or len(values) < rule.window:
            continue
        baseline = median(values[: rule.baseline_steps])
        level = factor * baseline if factor else max(rule.entropy_factor * baseline, baseline + rule.entropy_min_rise)
        peak = max(mean(values[i - rule.window : i]) for i in range(rule.window, len(values) + 1))
        margins[symptom] = peak / level if level > 0 else math.nan
    return margins
