"""The paper's claims beside what this study measured: one row per claim with the paper's words, the figures here
and a verdict that names the smallest effect the study could have seen when it saw none.
"""

from __future__ import annotations

import math
from functools import partial
from statistics import mean

from papo_nb.workbook.study.errors import DECOY, PRIOR
from papo_nb.workbook.study.power import effect_verdict, power_row
from papo_nb.workbook.study.stats import at_chance, exact_paired_tests, paired_test
from papo_nb.workbook.study.tables import NO_ITEMS

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
VISION_METRIC = "avg_at_k/original/vision"
ONE_SEED = "not tested: one seed (a paired test needs 2 or more)"
NOT_TESTABLE = "not testable here"


def _verdict(diff: float, p_value: float, alpha: float = 0.05, pairs: int = 2, mde: float = math.nan) -> str:
    """``detected higher (+x, p)`` / ``detected lower (-x, p)`` or ``not detected (+x; MDE y)``: a null always
    carries the smallest effect the study would have seen 80% of the time (``power.minimum_detectable_effect``)."""
    if not math.isfinite(diff):
        return NO_ITEMS
    if pairs < 2:
        return ONE_SEED
    return effect_verdict(diff, p_value, mde, alpha)


def _paired_p(test: dict) -> str:
    """The paired t-test's p with the exact sign and Wilcoxon p beside it, which lean on no normality."""
    if not math.isfinite(test["p_value"]):
        return "no p-value: one seed"
    exact = "; ".join(
        f"{name} p = {test[key]:.3g}" for name, key in (("sign", "sign_p"), ("Wilcoxon", "wilcoxon_p"))
        if math.isfinite(test.get(key, math.nan))
    )  # fmt: skip
    return f"paired p = {test['p_value']:.3g}" + (f"; exact {exact}" if exact else "")


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
    control, treatment = arms["control"], arms["treatment"]
    compare = partial(compare_arms, results, control, treatment)
    rows = [*accuracy_claims(compare), perception_errors_claim(compare), reliance_claim(compare)]
    rows.append(collapse_claim(collapse, treatment, arms["collapse"]))
    blind = [
        arm
        for arm in (control, treatment)
        if at_chance([r[VISION_METRIC] for r in results.get(arm, {}).values() if VISION_METRIC in r], chance,
                     vision_items)
    ]  # fmt: skip
    if blind:
        note = f"; {', '.join(blind)} at chance ({chance:.2f}) on vision-dependent items"
        for row in rows:
            row["here"] += note
            row["verdict"] = NOT_MEASURABLE
    return rows


def compare_arms(results: dict[str, dict[int, dict]], control: str, treatment: str, metric: str):
    """(paired test with its MDE, treatment mean, control mean) of ``metric`` over the seeds both arms ran."""
    seeds = sorted(s for s in set(results[control]) & set(results[treatment]) if metric in results[control][s])
    if not seeds:  # e.g. no text-answerable split in this dataset
        return {"diff": math.nan, "p_value": math.nan, "pairs": 0, "mde": math.nan}, math.nan, math.nan
    ours = [results[treatment][s][metric] for s in seeds]
    base = [results[control][s][metric] for s in seeds]
    test = {**paired_test(ours, base), **exact_paired_tests(ours, base), "mde": power_row(ours, base)["mde"]}
    return test, mean(ours), mean(base)


def _test_verdict(test: dict) -> str:
    return _verdict(test["diff"], test["p_value"], pairs=test["pairs"], mde=test["mde"])


def accuracy_claims(compare) -> list[dict]:
    """The overall and the vision-dependent accuracy claims; the vision row also says whether the gain is larger
    there than on the text-only split, and that it cannot be tested without one (the paper's claim is a
    comparison)."""
    rows = []
    for claim, metric in (("overall", "avg_at_k/original/all"), ("vision", VISION_METRIC)):
        test, ours, base = compare(metric)
        here = f"{ours:.3f} vs {base:.3f}: {_percent(ours, base)} ({_paired_p(test)})"
        rows.append({"claim": claim, "paper": PAPER_CLAIMS[claim], "here": here, "verdict": _test_verdict(test)})
    _, text_ours, text_base = compare("avg_at_k/original/text")
    _, vis_ours, vis_base = compare(VISION_METRIC)
    vision = rows[-1]
    if math.isnan(text_ours):
        vision["here"] += "; no text-only split in this dataset to compare with"
        if vision["verdict"] != ONE_SEED:
            vision["verdict"] = (
                f"{NOT_TESTABLE}: every held-out item is vision-dependent, so no gain can be larger on them than "
                f"elsewhere (vision split alone: {vision['verdict']})"
            )
    elif _relative(vis_ours, vis_base) <= _relative(text_ours, text_base) and vision["verdict"] != ONE_SEED:
        vision["here"] += f"; text-only split {_percent(text_ours, text_base)}"
        vision["verdict"] += "; gain not larger on the vision split"
    else:
        vision["here"] += f"; text-only split {_percent(text_ours, text_base)}"
    return rows


def perception_errors_claim(compare) -> dict:
    """The error split's prior class (``errors.PRIOR``: the number's colour, not shown, answered against the image)
    per clean prior-breaking item: the errors a perception term should remove. Without a language prior the
    errors cannot be classified, and the claim says so rather than proxying it by 1 - accuracy."""
    test, ours, base = compare(PRIOR)
    if not math.isfinite(base):
        return {
            "claim": "perception_errors", "paper": PAPER_CLAIMS["perception_errors"],
            "here": "no language prior here: an error cannot be told a perception error from the pixels",
            "verdict": f"{NOT_TESTABLE}: errors are classified only on a language-prior testbed",
        }  # fmt: skip
    _, decoy_ours, decoy_base = compare(DECOY)
    fewer = -_relative(ours, base)
    here = (
        f"answered the number's colour against the image, per clean prior-breaking item: {ours:.3f} vs {base:.3f}: "
        + (f"{fewer:+.1f}% fewer" if math.isfinite(fewer) else "no relative change (control at 0)")
        + f" ({_paired_p(test)})"
    )
    if math.isfinite(decoy_base):
        here += f"; reported the decoy: {decoy_ours:.3f} vs {decoy_base:.3f}"
    return {"claim": "perception_errors", "paper": PAPER_CLAIMS["perception_errors"], "here": here,
            "verdict": _test_verdict(test)}  # fmt: skip


def reliance_claim(compare) -> dict:
    test, gap_ours, gap_base = compare("avg_at_k/gap/vision")
    return {
        "claim": "reliance",
        "paper": PAPER_CLAIMS["reliance"],
        "here": f"original - masked accuracy, vision split: {gap_ours:.3f} vs {gap_base:.3f} ({_paired_p(test)})",
        "verdict": _test_verdict(test),
    }


def collapse_claim(collapse: dict[str, dict[int, dict]], treatment: str, collapsing: str) -> dict:
    """Holds when most runs of the collapsing arm were flagged and none of the treatment arm; not tested where no
    run trained at the collapse gamma (it was given, not searched)."""
    if collapsing not in collapse:
        return {"claim": "collapse", "paper": PAPER_CLAIMS["collapse"], "here": f"no {collapsing} run",
                "verdict": "not tested here: no run at the collapse gamma (given, not searched)"}  # fmt: skip
    flagged = {arm: sum(r["collapsed"] for r in by_seed.values()) for arm, by_seed in collapse.items()}
    runs = {arm: len(by_seed) for arm, by_seed in collapse.items()}
    holds = flagged.get(collapsing, 0) > runs.get(collapsing, 0) / 2 and flagged.get(treatment, 0) == 0
    return {
        "claim": "collapse",
        "paper": PAPER_CLAIMS["collapse"],
        "here": ", ".join(f"{arm}: {flagged[arm]}/{runs[arm]} runs flagged" for arm in collapse),
        "verdict": "holds here" if holds else "does not hold here",
    }
