"""The study's numbers: the collapse detector, mean +/- 95% CI per arm, paired tests against GRPO, the paper's claims.

The collapse symptoms are the PAPO paper's ("KL_prcp hacking", arXiv 2507.06448; the spec's PAPO_FACTS.md): the
perception loss (= -KL_prcp) falls from about -0.05 to about -1.0, both entropies rise, the high clip ratio rises from
about 5e-4 to about 7e-3 and the reward drops. One symptom is added that the paper does not list, because the
testbed showed it: the perception KL *vanishing*, the policy answering the same with and without the image.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import mean, median

from scipy import stats

from papo_nb.workbook.study.power import effect_verdict, power_row

# --------------------------------------------------------------------------------------------
# collapse detector
# --------------------------------------------------------------------------------------------


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


# symptom -> (metric in TRL's / the adapter's logs, whether the paper lists it)
SYMPTOMS = {
    "perception_kl_blowup": ("perception_kl", True),
    "perception_kl_vanished": ("perception_kl", False),
    "entropy_rise": ("entropy", True),
    "masked_entropy_rise": ("masked_entropy", True),
    "high_clip_ratio": ("clip_ratio/high_mean", True),
    "reward_drop": ("rewards/accuracy_reward/mean", True),
}
TRIGGERS = ("perception_kl_blowup", "reward_drop")


def _series(step_logs: list[dict], key: str) -> list[tuple[int, float]]:
    return [(int(h["step"]), float(h[key])) for h in step_logs if h.get(key) is not None and math.isfinite(h[key])]


def _holds(rule: CollapseRule, symptom: str, baseline: float, value: float) -> bool:
    if symptom == "perception_kl_blowup":
        return value >= max(rule.kl_factor * baseline, rule.kl_floor)
    if symptom == "perception_kl_vanished":
        return value <= rule.kl_vanish_fraction * baseline
    if symptom in ("entropy_rise", "masked_entropy_rise"):
        return value >= rule.entropy_factor * baseline and value - baseline >= rule.entropy_min_rise
    if symptom == "high_clip_ratio":
        return value >= rule.clip_high
    return value <= baseline - rule.reward_drop


def detect_collapse(step_logs: list[dict], rule: CollapseRule | None = None) -> dict:
    """``collapsed`` and ``step``: the first step where a trigger (KL blow-up or reward drop) held with at least one
    other symptom; ``mode`` says whether it looks like the paper's KL_prcp hacking (the KL blew up) or not;
    ``first_seen`` is the first step each symptom held (None if never)."""
    rule = rule or CollapseRule()
    state: dict[str, dict] = {}
    for symptom, (key, _) in SYMPTOMS.items():
        series = _series(step_logs, key)
        if len(series) > rule.baseline_steps:
            state[symptom] = {"series": series, "baseline": median(v for _, v in series[: rule.baseline_steps])}
    first_seen: dict[str, int | None] = dict.fromkeys(SYMPTOMS)
    fired_at, fired_with = None, []
    for step in sorted({s for item in state.values() for s, _ in item["series"]}):
        holding = []
        for symptom, item in state.items():
            recent = [v for s, v in item["series"] if s <= step][-rule.window :]
            if len(recent) == rule.window and _holds(rule, symptom, item["baseline"], mean(recent)):
                holding.append(symptom)
                first_seen[symptom] = first_seen[symptom] or step
        if fired_at is None and any(t in holding for t in TRIGGERS) and len(holding) >= 2:
            fired_at, fired_with = step, holding
    mode = None
    if fired_at is not None:
        mode = (
            "KL_prcp hacking (paper)"
            if "perception_kl_blowup" in fired_with
            else "image-blind collapse (not the paper's)"
        )
    return {
        "collapsed": fired_at is not None,
        "step": fired_at,
        "mode": mode,
        "symptoms": fired_with,
        "first_seen": first_seen,
        "baselines": {symptom: item["baseline"] for symptom, item in state.items()},
        "rule": asdict(rule),
    }


# --------------------------------------------------------------------------------------------
# confidence intervals and paired tests
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# the paper's claims beside what this study measured
# --------------------------------------------------------------------------------------------

# Quoted from the paper's abstract (arXiv 2507.06448, https://arxiv.org/html/2507.06448) and its analysis of
# KL_prcp hacking (numbers as collected in the project's PAPO_FACTS.md).
PAPER_CLAIMS = {
    "overall": "overall improvements of 4.4% (relative, avg@8, PAPO-G vs GRPO)",
    "vision": "more pronounced, approaching 8.0%, on tasks with high vision dependency",
    "perception_errors": "a substantial reduction (30.5%) in perception errors",
    "reliance": "the policy learns to depend on the image (the KL_prcp term's aim)",
    "collapse": "too large a gamma collapses (KL_prcp hacking): gamma 0.04 did at 3B",
}


NOT_MEASURABLE = "not measurable: policy at chance"
NO_ITEMS = "no items"


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


ONE_SEED = "not tested: one seed (a paired test needs 2 or more)"


def _verdict(diff: float, p_value: float, alpha: float = 0.05, pairs: int = 2, mde: float = math.nan) -> str:
    """``detected (+x, p)`` or ``not detected (+x; MDE y)``: a null always carries the smallest effect the study
    would have seen 80% of the time (``power.minimum_detectable_effect``)."""
    if not math.isfinite(diff):
        return NO_ITEMS
    if pairs < 2:
        return ONE_SEED
    return effect_verdict(diff, p_value, mde, alpha)


def _paired_p(test: dict) -> str:
    return f"paired p = {test['p_value']:.3g}" if math.isfinite(test["p_value"]) else "no p-value: one seed"


def _percent(treatment: float, control: float) -> str:
    """The relative change as text; with a control at 0 there is none to state."""
    change = _relative(treatment, control)
    return f"{change:+.1f}%" if math.isfinite(change) else "no relative change (control at 0)"


def _relative(treatment: float, control: float) -> float:
    return 100.0 * (treatment - control) / control if control else math.nan


def claims_table(
    results: dict[str, dict[int, dict]], collapse: dict[str, dict[int, dict]], arms: dict, *, chance: float,
    vision_items: int,
) -> list[dict]:  # fmt: skip
    """Rows (claim, paper, here, verdict). ``arms`` names the control, treatment and collapse arms; the metric
    names are those of ``study.evaluate_policy``. ``chance`` is a guesser's accuracy on the ``vision_items``
    vision-dependent held-out items: when the control or the treatment arm does not beat it (``at_chance``), nothing
    the claims compare can be measured and every verdict says so (``NOT_MEASURABLE``), never "does not hold"."""
    control, treatment, collapsing = arms["control"], arms["treatment"], arms["collapse"]
    vision_metric = "avg_at_k/original/vision"
    blind = [
        arm
        for arm in (control, treatment)
        if at_chance([r[vision_metric] for r in results.get(arm, {}).values() if vision_metric in r], chance,
                     vision_items)
    ]  # fmt: skip

    def compare(metric: str):
        seeds = sorted(s for s in set(results[control]) & set(results[treatment]) if metric in results[control][s])
        if not seeds:  # e.g. no text-answerable split in this dataset
            return {"diff": math.nan, "p_value": math.nan, "pairs": 0, "mde": math.nan}, math.nan, math.nan
        ours = [results[treatment][s][metric] for s in seeds]
        base = [results[control][s][metric] for s in seeds]
        return {**paired_test(ours, base), "mde": power_row(ours, base)["mde"]}, mean(ours), mean(base)

    rows = []
    for claim, metric in (("overall", "avg_at_k/original/all"), ("vision", "avg_at_k/original/vision")):
        test, ours, base = compare(metric)
        here = f"{ours:.3f} vs {base:.3f}: {_percent(ours, base)} ({_paired_p(test)})"
        rows.append(
            {
                "claim": claim,
                "paper": PAPER_CLAIMS[claim],
                "here": here,
                "verdict": _verdict(test["diff"], test["p_value"], pairs=test["pairs"], mde=test["mde"]),
            }
        )
    _, text_ours, text_base = compare("avg_at_k/original/text")
    vis_test, vis_ours, vis_base = compare("avg_at_k/original/vision")
    if math.isnan(text_ours):
        rows[-1]["here"] += "; no text-only split in this dataset to compare with"
    elif _relative(vis_ours, vis_base) <= _relative(text_ours, text_base) and rows[-1]["verdict"] != ONE_SEED:
        rows[-1]["here"] += f"; text-only split {_percent(text_ours, text_base)}"
        rows[-1]["verdict"] += "; gain not larger on the vision split"
    else:
        rows[-1]["here"] += f"; text-only split {_percent(text_ours, text_base)}"
    errors_ours, errors_base = 1 - vis_ours, 1 - vis_base
    reduction = -_relative(errors_ours, errors_base)
    rows.append({
        "claim": "perception_errors",
        "paper": PAPER_CLAIMS["perception_errors"],
        "here": f"errors on vision-dependent items {errors_ours:.3f} vs {errors_base:.3f}: {reduction:+.1f}% fewer "
        "(proxy: the paper classified errors by hand)",
        "verdict": _verdict(vis_test["diff"], vis_test["p_value"], pairs=vis_test["pairs"], mde=vis_test["mde"]),
    })  # fmt: skip
    gap_test, gap_ours, gap_base = compare("avg_at_k/gap/vision")
    rows.append({
        "claim": "reliance",
        "paper": PAPER_CLAIMS["reliance"],
        "here": f"original - masked accuracy, vision split: {gap_ours:.3f} vs {gap_base:.3f} ({_paired_p(gap_test)})",
        "verdict": _verdict(gap_test["diff"], gap_test["p_value"], pairs=gap_test["pairs"], mde=gap_test["mde"]),
    })  # fmt: skip
    flagged = {arm: sum(r["collapsed"] for r in by_seed.values()) for arm, by_seed in collapse.items()}
    runs = {arm: len(by_seed) for arm, by_seed in collapse.items()}
    collapse_holds = flagged.get(collapsing, 0) > runs.get(collapsing, 0) / 2 and flagged.get(treatment, 0) == 0
    rows.append({
        "claim": "collapse",
        "paper": PAPER_CLAIMS["collapse"],
        "here": ", ".join(f"{arm}: {flagged[arm]}/{runs[arm]} runs flagged" for arm in collapse),
        "verdict": "holds here" if collapse_holds else "does not hold here",
    })  # fmt: skip
    if blind:
        note = f"; {', '.join(blind)} at chance ({chance:.2f}) on vision-dependent items"
        for row in rows:
            row["here"] += note
            row["verdict"] = NOT_MEASURABLE
    return rows


# --------------------------------------------------------------------------------------------
# presentation
# --------------------------------------------------------------------------------------------

TABLE_METRICS = (
    "avg_at_k/original/all",
    "avg_at_k/original/vision",
    "avg_at_k/original/text",
    "avg_at_k/masked/vision",
    "avg_at_k/gap/vision",
    "greedy/original/all",
    "greedy/original/vision",
    "greedy/original/text",
    "greedy/gap/vision",
)


def _pm(centre: float, half: float) -> str:
    if not math.isfinite(centre):
        return NO_ITEMS
    return f"{centre:.3f}" if math.isnan(half) else f"{centre:.3f} ± {half:.3f}"


def _p(p_value: float, seeds: int) -> str:
    if math.isfinite(p_value):
        return f"p={p_value:.2g}"
    return "p: needs 2+ seeds" if seeds < 2 else "p: none, every seed gave the same difference"


def comparison_table(rows: list[dict], control: str) -> list[dict]:
    """``summary_rows`` pivoted for reading: one row per metric, ``mean ± 95% CI`` per arm, and per other arm its
    paired difference against ``control`` with the paired t-test's p-value."""
    table: dict[str, dict] = {}
    for row in rows:
        line = table.setdefault(row["metric"], {"metric": row["metric"]})
        line[row["arm"]] = _pm(row["mean"], row["ci95"])
        if row["arm"] != control:
            diff = _pm(row[f"diff_vs_{control}"], row[f"diff_ci95_vs_{control}"])
            p_value = row[f"p_value_vs_{control}"]
            line[f"{row['arm']} - {control}"] = diff if diff == NO_ITEMS else f"{diff} ({_p(p_value, row['seeds'])})"
    return list(table.values())


def markdown_table(rows: list[dict]) -> str:
    """A GitHub-markdown table of dict rows (the keys of the first row are the columns)."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
