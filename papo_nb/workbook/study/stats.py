"""The study's statistics: mean +/- 95% CI per arm, paired tests against the control arm, and whether an accuracy
beats chance at all. The tables that show them are ``tables``; the paper's claims beside them are ``claims``.
"""

from __future__ import annotations

import math
from statistics import mean

from scipy import stats

from papo_nb.workbook.study.power import power_row


def mean_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Mean and the half-width of its Student-t confidence interval (NaN with fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    centre = mean(values)
    if n < 2:
        return centre, math.nan
    sd = stats.tstd(values)
    return centre, float(stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n))


def paired_test(treatment: list[float], control: list[float]) -> dict:
    """Paired difference treatment - control (same seeds, same data): mean, 95% CI and the paired t-test's
    two-sided p-value (NaN below 2 pairs or when every difference is equal)."""
    if len(treatment) != len(control):
        raise ValueError(f"paired test needs equal lengths, got {len(treatment)} and {len(control)}")
    diffs = [a - b for a, b in zip(treatment, control)]
    centre, half = mean_ci(diffs)
    p_value = math.nan
    if len(diffs) >= 2 and len(set(diffs)) > 1:
        p_value = float(stats.ttest_rel(treatment, control).pvalue)
    return {"diff": centre, "diff_ci95": half, "p_value": p_value, "pairs": len(diffs)}


def exact_paired_tests(treatment: list[float], control: list[float]) -> dict:
    """Two-sided p-values that lean on no normality: the exact sign test (binomial on the signs, ties dropped) and
    the exact Wilcoxon signed-rank test (zero differences dropped; NaN when fewer than one remains). With 5 pairs
    neither can go below 0.0625, however large the effect: the floor that makes the t-test's p lean on normality."""
    if len(treatment) != len(control):
        raise ValueError(f"exact tests need equal lengths, got {len(treatment)} and {len(control)}")
    diffs = [a - b for a, b in zip(treatment, control) if a != b]
    if not diffs:
        return {"sign_p": math.nan, "wilcoxon_p": math.nan}
    positive = sum(d > 0 for d in diffs)
    sign_p = float(stats.binomtest(positive, len(diffs), 0.5).pvalue)
    wilcoxon_p = float(stats.wilcoxon(diffs, method="exact").pvalue)
    return {"sign_p": sign_p, "wilcoxon_p": wilcoxon_p}


def paired_tests_with_power(treatment: list[float], control: list[float]) -> dict:
    """``paired_test`` with the exact sign and Wilcoxon p-values beside it and the MDE at 80% power: what a paired
    contrast on a study page reports."""
    return {
        **paired_test(treatment, control),
        **exact_paired_tests(treatment, control),
        "mde": power_row(treatment, control)["mde"],
    }


def equivalence_test(treatment: list[float], control: list[float], margin: float) -> dict:
    """TOST: two one-sided paired t-tests that the true difference lies within +-``margin``. ``p_value`` is the
    larger one-sided p; ``equivalent`` when it is below 0.05 (the 90% CI of the difference inside the margin). NaN
    below 2 pairs; with every difference equal, the difference is known exactly and p is 0 or 1."""
    if len(treatment) != len(control):
        raise ValueError(f"equivalence test needs equal lengths, got {len(treatment)} and {len(control)}")
    if not margin > 0:
        raise ValueError(f"margin={margin} must be positive")
    diffs = [a - b for a, b in zip(treatment, control)]
    if len(diffs) < 2:
        return {"margin": margin, "p_value": math.nan, "equivalent": False}
    centre, sd = mean(diffs), stats.tstd(diffs)
    if sd == 0:
        p_value = 0.0 if abs(centre) < margin else 1.0
    else:
        error, df = sd / math.sqrt(len(diffs)), len(diffs) - 1
        p_value = float(max(stats.t.sf((centre + margin) / error, df), stats.t.cdf((centre - margin) / error, df)))
    return {"margin": margin, "p_value": p_value, "equivalent": p_value < 0.05}


def summary_rows(results: dict[str, dict[int, dict]], metrics: list[str], control: str) -> list[dict]:
    """One row per (arm, metric): mean +/- 95% CI over seeds and, except for ``control``, the paired difference
    against it over the seeds both arms ran. ``results[arm][seed]`` maps metric names to values."""
    rows = []
    for arm, by_seed in results.items():
        for metric in metrics:
            seeds = sorted(s for s in by_seed if metric in by_seed[s])
            values = [by_seed[s][metric] for s in seeds]
            centre, half = mean_ci(values)
            row = {"arm": arm, "metric": metric, "seeds": len(values), "mean": centre, "ci95": half}
            if arm != control:
                paired = [s for s in seeds if metric in results[control].get(s, {})]
                test = paired_test([by_seed[s][metric] for s in paired], [results[control][s][metric] for s in paired])
                row.update({f"{k}_vs_{control}": v for k, v in test.items() if k != "pairs"})
            rows.append(row)
    return rows


def at_chance(values: list[float], chance: float, items: int, confidence: float = 0.95) -> bool:
    """True when an accuracy does not beat ``chance`` by more than its confidence interval, so no difference
    between methods can show in it. The interval is the seeds' Student-t interval with 2 or more seeds, else the
    binomial interval of a guesser's accuracy on ``items`` items (normal approximation)."""
    if not values:
        return True
    centre, half = mean_ci(values, confidence)
    if not math.isfinite(half):
        z = float(stats.norm.ppf(0.5 + confidence / 2))
        half = z * math.sqrt(chance * (1 - chance) / max(items, 1))
    return centre <= chance + half
