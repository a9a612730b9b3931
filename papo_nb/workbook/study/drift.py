"""What RL does to perception, and whether PAPO-G counteracts it: each arm's change from the warm start (step 0)
to the end of training, and each PAPO-G arm against GRPO with the verdicts a reader needs.

Drift is measured, not assumed: every run is scored on the same held-out items as the warm-start policy, so an
arm's drift on a seed is its end score minus the warm start's (one policy, scored once), with a Student-t interval
over seeds. The per-arm verdict pairs each PAPO-G arm with GRPO on the same seeds: the difference with its 95% CI
and p, the TOST equivalence test at +-``EQUIVALENCE_MARGIN``, and the minimum detectable effect.
"""

from __future__ import annotations

import math
from statistics import mean

from scipy import stats as scipy_stats

from papo_nb.workbook.study.errors import DECOY, PRIOR, SHARE
from papo_nb.workbook.study.power import power_row
from papo_nb.workbook.study.stats import equivalence_test, exact_paired_tests, mean_ci, paired_test

EQUIVALENCE_MARGIN = 0.02  # 2 points: about the paper's gains, the smallest difference worth ruling in or out
PRIMARY = "avg_at_k/original/vision"  # prior-breaking items on a language-prior testbed: only reading scores
CONSISTENT = "avg_at_k/original/consistent"  # the in-distribution split: where the prior is right
DRIFT_METRICS = (
    PRIMARY, "greedy/original/vision", "avg_at_k/masked/vision", "avg_at_k/gap/vision", CONSISTENT, PRIOR, DECOY,
)  # fmt: skip


def drift_rows(start: dict[str, float], results: dict[str, dict[int, dict]], metrics=DRIFT_METRICS) -> list[dict]:
    """Per (arm, metric): the warm start's score, the arm's mean end score, the drift (end - start) with its 95% CI
    over seeds and the one-sample t-test's p that it is 0 (1 or 0 when every seed ended at one score)."""
    rows = []
    for arm, by_seed in results.items():
        for metric in metrics:
            ends = [scores[metric] for scores in by_seed.values() if metric in scores]
            if metric not in start or not ends:
                continue
            drift, half = mean_ci([end - start[metric] for end in ends])
            p_value = math.nan
            if len(ends) >= 2 and len(set(ends)) > 1:
                p_value = float(scipy_stats.ttest_1samp(ends, start[metric]).pvalue)
            elif len(ends) >= 2:  # every seed ended at one score: the drift is known exactly
                p_value = 1.0 if ends[0] == start[metric] else 0.0
            rows.append({
                "arm": arm, "metric": metric, "seeds": len(ends), "step_0": start[metric], "end": mean(ends),
                "drift": drift, "drift_ci95": half, "p_value": p_value,
            })  # fmt: skip
    return rows


def arm_verdicts(
    results: dict[str, dict[int, dict]], gammas: dict[str, float], control: str, metric: str = PRIMARY,
    margin: float = EQUIVALENCE_MARGIN,
) -> list[dict]:  # fmt: skip
    """Per arm other than ``control``: its gamma, the paired difference in ``metric`` with its 95% CI and p, TOST
    at +-``margin``, the MDE, the prior-following share of its errors beside the control's, and a verdict:
    better / worse (the paired test rejects), equivalent (TOST rejects), or inconclusive."""
    rows = []
    for arm, by_seed in results.items():
        if arm == control:
            continue
        seeds = sorted(s for s in set(by_seed) & set(results[control]) if metric in by_seed[s])
        ours = [by_seed[s][metric] for s in seeds]
        base = [results[control][s][metric] for s in seeds]
        test = paired_test(ours, base)
        tost = equivalence_test(ours, base, margin)  # NaN, not equivalent, below 2 pairs
        rows.append({
            "arm": arm, "gamma": gammas[arm], "pairs": len(seeds), "arm_mean": mean(ours), "control_mean": mean(base),
            "diff": test["diff"], "diff_ci95": test["diff_ci95"], "p_value": test["p_value"],
            **exact_paired_tests(ours, base), "tost_p": tost["p_value"], "mde": power_row(ours, base)["mde"],
            "prior_share": _mean_of(by_seed, seeds, SHARE),
            "control_prior_share": _mean_of(results[control], seeds, SHARE),
            "verdict": _verdict(test, tost, margin),
        })  # fmt: skip
    return rows


def _mean_of(by_seed: dict[int, dict], seeds: list[int], key: str) -> float:
    values = [by_seed[s][key] for s in seeds if math.isfinite(by_seed[s].get(key, math.nan))]
    return mean(values) if values else math.nan


def _verdict(test: dict, tost: dict, margin: float) -> str:
    if math.isfinite(test["p_value"]) and test["p_value"] < 0.05:
        return (
            f"{'better' if test['diff'] > 0 else 'worse'} than GRPO ({test['diff']:+.3f}, p = {test['p_value']:.2g})"
        )
    if tost["equivalent"]:
        return f"equivalent to GRPO within +-{margin:g} (TOST p = {tost['p_value']:.2g})"
    return f"inconclusive: neither a difference nor equivalence within +-{margin:g}"


def counteract_claim(drift: list[dict], verdicts: list[dict], control: str, metric: str = PRIMARY) -> dict:
    """The claim this design tests, in plain words: did the control (GRPO) drift off the image, and did a PAPO-G
    arm counteract it (better than the control on ``metric``), at which gamma and by how much."""
    grpo = next((row for row in drift if row["arm"] == control and row["metric"] == metric), None)
    if grpo is None:
        return {"claim": "counteracts drift", "here": "no step-0 score: drift not measured", "verdict": "not tested"}
    drifted = grpo["drift"] + grpo["drift_ci95"] < 0  # the whole 95% CI below 0
    here = f"GRPO {grpo['step_0']:.3f} -> {grpo['end']:.3f} ({grpo['drift']:+.3f} +/- {grpo['drift_ci95']:.3f} 95% CI)"
    better = [row for row in verdicts if row["verdict"].startswith("better")]
    here += "; " + "; ".join(
        f"{row['arm']} (gamma {row['gamma']:g}) - GRPO: {row['diff']:+.3f} +/- {row['diff_ci95']:.3f} 95% CI"
        for row in verdicts
    )
    if not drifted:
        verdict = "not tested: GRPO did not drift off the image here"
    elif better:
        verdict = "holds: " + recovery(max(better, key=lambda row: row["diff"]), grpo)
    else:
        verdict = "does not hold here: no PAPO-G arm beat GRPO"
    return {"claim": "counteracts drift", "here": here, "verdict": verdict}


def recovery(row: dict, grpo: dict) -> str:
    """How much of GRPO's drift an arm that beats GRPO makes up, said from its numbers: the share of the drift, or,
    when it beats GRPO by more than GRPO lost, that it ends above the warm start (its mean end against step 0)."""
    arm, lost, start = f"{row['arm']} (gamma {row['gamma']:g})", -grpo["drift"], grpo["step_0"]
    beats = f"{arm} ends {row['diff']:+.3f} above GRPO"
    if row["diff"] < lost:
        return f"{beats}, making up {row['diff'] / lost:.0%} of GRPO's {grpo['drift']:+.3f} drift"
    return (
        f"{beats}, more than GRPO's {grpo['drift']:+.3f} drift: it ends {row['arm_mean'] - start:+.3f} from the "
        f"warm start ({row['arm_mean']:.3f} against {start:.3f})"
    )


def verdict_line(drift: list[dict], verdicts: list[dict], claim: dict, control: str, metric: str = PRIMARY) -> str:
    """The calibrated study in one line, with its numbers: the claim's verdict, the control's drift with its 95% CI
    and p over seeds, and each arm minus the control with its CI, p and MDE (what a run too small to detect an
    effect could not have seen)."""
    grpo = next((row for row in drift if row["arm"] == control and row["metric"] == metric), None)
    if grpo is None:
        return f"{claim['verdict']}."
    arms = "; ".join(
        f"{row['arm']} (gamma {row['gamma']:g}) - {control} {row['diff']:+.3f} +/- {row['diff_ci95']:.3f} "
        f"(p = {row['p_value']:.2g}, MDE {row['mde']:.3f})"
        for row in verdicts
    )
    return (
        f"{claim['verdict']}. On {metric}, {control} {grpo['step_0']:.3f} -> {grpo['end']:.3f}: drift "
        f"{grpo['drift']:+.3f} +/- {grpo['drift_ci95']:.3f} (p = {grpo['p_value']:.2g}, {grpo['seeds']} seeds); "
        f"{arms}; each +/- is a 95% CI half-width over seeds."
    )


def verdict_metrics(drift: list[dict], verdicts: list[dict], control: str, metric: str = PRIMARY) -> dict:
    """``verdict_line``'s numbers as MLflow metrics: ``study/drift/<control>`` (and ``_ci95``), and per arm
    ``study/vs_<control>/<arm>`` with ``_ci95``, ``_p`` and ``_mde``."""
    values = {}
    for row in drift:
        if row["arm"] == control and row["metric"] == metric:
            values |= {f"study/drift/{control}": row["drift"], f"study/drift_ci95/{control}": row["drift_ci95"]}
    for row in verdicts:
        for key, name in (("diff", ""), ("diff_ci95", "_ci95"), ("p_value", "_p"), ("mde", "_mde")):
            values[f"study/vs_{control}{name}/{row['arm']}"] = row[key]
    return values
