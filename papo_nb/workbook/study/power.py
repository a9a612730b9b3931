"""What the study could have seen: the minimum detectable paired effect, and verdicts that carry it.

A null is only worth stating beside the smallest difference the study would have detected. For a paired design
(every arm trained on the same seeds), the two-sided paired t-test on ``n`` seed pairs whose differences have
standard deviation ``sd`` detects a true mean difference ``delta`` with power

    P(|T| > t_{1 - alpha/2, n - 1}),  T ~ noncentral t(df = n - 1, nc = delta * sqrt(n) / sd),

and the minimum detectable effect (MDE) is the ``delta`` at which that power reaches the target (80%). ``sd`` is the
study's own seed-to-seed spread of the paired differences, so the MDE includes training noise, sampling noise of
avg@k and the finite held-out set together.
"""

from __future__ import annotations

import math
from statistics import stdev

from scipy import optimize, stats

ALPHA = 0.05  # two-sided
POWER = 0.80


def paired_power(delta: float, sd: float, pairs: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test to detect a true mean difference ``delta``."""
    if pairs < 2:
        raise ValueError(f"pairs = {pairs}: a paired t-test needs at least 2 pairs")
    if not sd > 0:
        raise ValueError(f"sd = {sd}: the paired differences' standard deviation must be positive")
    df = pairs - 1
    critical = stats.t.ppf(1 - alpha / 2, df)
    noncentrality = abs(delta) * math.sqrt(pairs) / sd
    far_tail = stats.nct.cdf(-critical, df, noncentrality)  # rejecting on the wrong side; scipy gives NaN when it
    return float(stats.nct.sf(critical, df, noncentrality) + (0.0 if math.isnan(far_tail) else far_tail))  # underflows


def minimum_detectable_effect(sd: float, pairs: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference detected with ``power`` (exact, through the noncentral t)."""
    if not 0 < power < 1:
        raise ValueError(f"power = {power}: allowed 0 < power < 1")
    low, high = 0.0, sd
    while paired_power(high, sd, pairs, alpha) < power:  # the MDE is a few sd at most for n >= 2
        high *= 2
    return float(optimize.brentq(lambda d: paired_power(d, sd, pairs, alpha) - power, low, high, xtol=1e-10))


def pairs_needed(sd: float, target: float, alpha: float = ALPHA, power: float = POWER, limit: int = 1000) -> int:
    """The fewest seed pairs whose MDE is at most ``target``."""
    if not target > 0:
        raise ValueError(f"target = {target}: the effect to detect must be positive")
    for pairs in range(2, limit + 1):
        if minimum_detectable_effect(sd, pairs, alpha, power) <= target:
            return pairs
    raise ValueError(f"target = {target}: more than {limit} pairs needed at sd = {sd}")


def power_row(treatment: list[float], control: list[float], target: float | None = None) -> dict:
    """The paired differences' spread, the MDE at 80% power and, with ``target``, the seeds it would take."""
    if len(treatment) != len(control):
        raise ValueError(f"paired values need equal lengths, got {len(treatment)} and {len(control)}")
    diffs = [a - b for a, b in zip(treatment, control)]
    row = {"pairs": len(diffs), "diff_sd": math.nan, "mde": math.nan, "pairs_for_target": None}
    if len(diffs) < 2:
        return row
    row["diff_sd"] = stdev(diffs)
    if row["diff_sd"] == 0:  # every seed gave the same difference: no spread to estimate power from
        return row
    row["mde"] = minimum_detectable_effect(row["diff_sd"], len(diffs))
    if target is not None:
        row["pairs_for_target"] = pairs_needed(row["diff_sd"], target)
    return row


def gain_detected(row: dict, alpha: float = ALPHA) -> bool:
    """A paired contrast row (``diff``, ``p_value``) shows a gain: positive, and the paired test rejects at
    ``alpha`` (a NaN difference or p shows none)."""
    return row["diff"] > 0 and row["p_value"] < alpha


def effect_verdict(diff: float, p_value: float, mde: float, alpha: float = ALPHA) -> str:
    """``detected higher (+x, p)`` or ``detected lower (-x, p)`` when the paired test rejects, the direction in words
    so a loss never reads as a finding in the method's favour; otherwise ``not detected (x; MDE y)``, so a null says
    how large an effect it rules out."""
    if not math.isfinite(diff):
        return "not measured"
    if math.isfinite(p_value) and p_value < alpha:
        return f"detected {'higher' if diff > 0 else 'lower'} ({diff:+.3f}, p = {p_value:.3g})"
    bound = f"MDE {mde:.3f}" if math.isfinite(mde) else "MDE unknown: seed spread not estimable"
    return f"not detected ({diff:+.3f}; {bound})"


def power_table(results: dict[str, dict[int, dict]], metrics: list[str], control: str, treatment: str,
                target: float = 0.02) -> list[dict]:  # fmt: skip
    """Per headline metric: the treatment - control paired differences' spread over the seeds both arms ran, the
    MDE at 80% power and the seeds it would take to bring it to ``target`` (the paper's gains are about 2 points)."""
    rows = []
    for metric in metrics:
        seeds = sorted(s for s in set(results[control]) & set(results[treatment]) if metric in results[control][s])
        ours = [results[treatment][s][metric] for s in seeds]
        base = [results[control][s][metric] for s in seeds]
        rows.append({"metric": metric, "target": target, **power_row(ours, base, target)})
    return rows
