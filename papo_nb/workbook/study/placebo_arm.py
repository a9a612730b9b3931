"""The placebo's sections on a calibrated study page (the arms and their masks are ``placebo.py``'s).

Three paired contrasts, each over the page's seeds: the strongest PAPO-G arm against the placebo (the verdict: does
the gain need the mask to cover the square?), PAPO-G with the placebo's fill against the placebo (only *where* the
mask goes differs), and the placebo against GRPO (does the term's form alone hold GRPO back?). Each on prior-breaking
accuracy, the reliance gap, the in-distribution items, the error split's prior answers and the end-of-training
accuracy reward, with the paired t-test's CI and p beside the exact sign and Wilcoxon p and the MDE. Nothing here
computes a statistic of its own (``stats``, ``power``, ``controls.end_reward``).
"""

from __future__ import annotations

import math
from statistics import mean

from papo_nb.workbook.study import drift, errors, tables
from papo_nb.workbook.study import stats as study_stats
from papo_nb.workbook.study.arms import GRPO, Study, plain_papo_arms
from papo_nb.workbook.study.controls import END_REWARD_WINDOW, end_reward
from papo_nb.workbook.study.placebo import (
    MEAN_FILL_KL_MATCHED,
    MEAN_FILL_PAPO_G,
    PLACEBO,
    PLACEBO_CONTROLS,
    PLACEBO_KL_MATCHED,
)
from papo_nb.workbook.study.power import gain_detected

GAP = "avg_at_k/gap/vision"
TRAIN_ACCURACY = "train/accuracy_reward_end"
METRICS = (drift.PRIMARY, GAP, drift.CONSISTENT, errors.PRIOR, TRAIN_ACCURACY)


def strongest_papo_g(study: Study) -> str | None:
    """The PAPO-G arm of the largest gamma on every seed (the one the controls are matched to); None without one."""
    arms = {arm: runs for arm, runs in study.by_arm().items() if arm in plain_papo_arms(study.by_arm())}
    return max(arms, key=lambda arm: next(iter(arms[arm].values())).gamma) if arms else None


def arm_scores(study: Study) -> dict[str, dict[int, dict]]:
    """arm -> seed -> held-out scores with the end-of-training accuracy reward beside them."""
    return {
        arm: {seed: {**run.scores, TRAIN_ACCURACY: end_reward(run.step_logs)} for seed, run in runs.items()}
        for arm, runs in study.by_arm().items()
    }


def contrast_rows(scores: dict[str, dict[int, dict]], treatment: str, control: str) -> list[dict]:
    """``treatment - control`` paired over their common seeds on each of ``METRICS`` it has."""
    rows = []
    for metric in METRICS:
        seeds = sorted(s for s in set(scores[treatment]) & set(scores[control]) if metric in scores[control][s])
        ours = [scores[treatment][s][metric] for s in seeds]
        base = [scores[control][s][metric] for s in seeds]
        if not seeds or not all(map(math.isfinite, ours + base)):
            continue
        rows.append({
            "contrast": f"{treatment} - {control}", "metric": metric, "treatment": mean(ours), "control": mean(base),
            **study_stats.paired_tests_with_power(ours, base),
        })  # fmt: skip
    return rows


def perception_kl_rows(study: Study, arms: list[str]) -> list[dict]:
    """Each arm's perception KL: each run's mean over its logged steps, then the mean over seeds with its CI, and
    the smallest run mean (a placebo whose mask changes no pixel would log 0 on every step)."""
    rows = []
    for arm in arms:
        runs = study.by_arm().get(arm, {})
        per_run = [mean(r["perception_kl"] for r in run.step_logs if "perception_kl" in r) for run in runs.values()]
        if per_run:
            centre, half = study_stats.mean_ci(per_run)
            collapsed = sum(bool(run.collapse.get("collapsed")) for run in runs.values())
            rows.append({
                "arm": arm, "seeds": len(per_run), "mean": centre, "ci95": half, "smallest": min(per_run),
                "collapsed": f"{collapsed}/{len(runs)}",
            })  # fmt: skip
    return rows


def _said(row: dict) -> str:
    return (
        f"{row['diff']:+.3f} +/- {row['diff_ci95']:.3f} (paired t p = {row['p_value']:.2g}; exact sign p = "
        f"{row['sign_p']:.2g}; Wilcoxon p = {row['wilcoxon_p']:.2g}; {row['pairs']} seed pairs; MDE {row['mde']:.3f})"
    )


def placebo_verdict(rows: list[dict], treatment: str, placebo: str, collapsed: str) -> str:
    """In words: whether ``treatment`` beats ``placebo`` on prior-breaking accuracy (paired t, with the exact tests
    and the MDE beside it), the reliance gap's contrast, and how many placebo runs collapsed (``collapsed``, "k/n"):
    a placebo that wrecks the policy holds nothing back, it is beaten for another reason than perception."""
    by = {row["metric"]: row for row in rows if row["contrast"] == f"{treatment} - {placebo}"}
    main, gap = by[drift.PRIMARY], by.get(GAP)
    beats = gain_detected(main)
    head = (
        "keeps more prior-breaking accuracy than"
        if beats
        else "is not shown to keep more prior-breaking accuracy than"
    )
    text = f"{treatment} {head} {placebo}: {treatment} - {placebo} = {_said(main)} on prior-breaking avg@k"
    text += f"; on the reliance gap {_said(gap)}" if gap else ""
    return f"{text}; {collapsed} {placebo} runs collapsed"


def same_fill_rows(scores: dict[str, dict[int, dict]]) -> list[dict]:
    """The contrasts of PAPO-G with the placebo's fill against the placebo (at each gamma both ran)."""
    pairs = ((MEAN_FILL_KL_MATCHED, PLACEBO_KL_MATCHED), (MEAN_FILL_PAPO_G, PLACEBO))
    return [row for t, c in pairs if t in scores and c in scores for row in contrast_rows(scores, t, c)]


def where_row(rows: list[dict]) -> dict | None:
    """PAPO-G with the placebo's fill against the placebo at the same gamma, on prior-breaking accuracy: the matched
    gamma's pair where it ran, else the same-gamma pair; None without either."""
    for treatment, control in ((MEAN_FILL_KL_MATCHED, PLACEBO_KL_MATCHED), (MEAN_FILL_PAPO_G, PLACEBO)):
        for row in rows:
            if row["contrast"] == f"{treatment} - {control}" and row["metric"] == drift.PRIMARY:
                return row
    return None


def where_verdict(rows: list[dict]) -> str | None:
    """In words, ``where_row``: only the mask's place differs; does covering the square add accuracy?"""
    row = where_row(rows)
    if row is None:
        return None
    if gain_detected(row):
        return f"Covering the square adds prior-breaking accuracy: {row['contrast']} = {_said(row)}"
    return (
        f"Covering the square is not shown to add prior-breaking accuracy: {row['contrast']} = {_said(row)}, same "
        "fill and gamma, only the mask's place differs; so PAPO-G's margin over its placebo is not shown to come "
        "from what its mask hides (the fill, black against the mean colour, differs too)"
    )


def placebo_tables(study: Study) -> tuple[str, list[dict], list[dict]] | None:
    """(the strongest PAPO-G arm, the placebo's paired contrasts, the perception-KL rows); None without a placebo
    arm, GRPO and a PAPO-G arm."""
    treatment = strongest_papo_g(study)
    if PLACEBO not in study.by_arm() or GRPO not in study.by_arm() or treatment is None:
        return None
    scores = arm_scores(study)
    pairs = [(treatment, PLACEBO), (treatment, PLACEBO_KL_MATCHED), (MEAN_FILL_PAPO_G, PLACEBO),
             (MEAN_FILL_KL_MATCHED, PLACEBO_KL_MATCHED), (PLACEBO, GRPO), (PLACEBO_KL_MATCHED, GRPO)]  # fmt: skip
    rows = [row for t, c in pairs if t in scores and c in scores for row in contrast_rows(scores, t, c)]
    kl = perception_kl_rows(study, [PLACEBO, PLACEBO_KL_MATCHED, MEAN_FILL_PAPO_G, MEAN_FILL_KL_MATCHED, treatment])
    return treatment, rows, kl


def placebo_short(study: Study) -> str | None:
    """The summary table's cell: the strongest PAPO-G arm against each placebo on prior-breaking avg@k."""
    tables_ = placebo_tables(study)
    if tables_ is None:
        return None
    treatment, rows, kl = tables_
    collapsed = {row["arm"]: row["collapsed"] for row in kl}
    cells = []
    for row in rows:
        control = row["contrast"].removeprefix(f"{treatment} - ")
        if row["metric"] == drift.PRIMARY and control in PLACEBO_CONTROLS:
            said = "beats" if gain_detected(row) else "does not beat"
            cells.append(
                f"{said} {control} ({row['diff']:+.3f}, p = {row['p_value']:.2g}; MDE {row['mde']:.3f}; "
                f"{collapsed[control]} {control} runs collapsed)"
            )
    if (where := where_row(rows)) is not None:
        said = "adds" if gain_detected(where) else "does not add"
        cells.append(
            f"covering the square {said} accuracy at the same fill ({where['contrast']}: {where['diff']:+.3f}, "
            f"p = {where['p_value']:.2g}; MDE {where['mde']:.3f})"
        )
    return "; ".join(cells)


def placebo_sections(study: Study) -> list[str]:
    """The placebo's sections (none without a placebo arm, GRPO and a PAPO-G arm)."""
    tables_ = placebo_tables(study)
    if tables_ is None:
        return []
    treatment, rows, kl = tables_
    scores = arm_scores(study)
    gammas = {arm: next(iter(runs.values())).gamma for arm, runs in study.by_arm().items()}
    collapsed = {row["arm"]: row["collapsed"] for row in kl}
    verdicts = " ".join(
        f"**{placebo_verdict(rows, treatment, arm, collapsed[arm])}.**" for arm in PLACEBO_CONTROLS if arm in scores
    )
    if where := where_verdict(rows):
        verdicts += f" **{where}.**"
    kl_table = tables.records_markdown([{"arm": r["arm"], "gamma": gammas[r["arm"]], **r} for r in kl])
    matched = (
        f" `{PLACEBO_KL_MATCHED}` is the same placebo at gamma {gammas[PLACEBO_KL_MATCHED]:g}, where its term starts "
        f"as large as {treatment}'s (gamma scaled by the ratio of their mean perception KL over the first logged "
        "steps, `placebo.kl_matched_gamma`): at the same gamma the grey patches make the placebo's term several "
        "times larger than PAPO-G's."
        if PLACEBO_KL_MATCHED in scores
        else ""
    )
    same_fill = (
        f" Against `{MEAN_FILL_PAPO_G}` (PAPO-G at the same gamma with the same fill over its usual patches, the "
        f"square included) only where the mask goes differs; so between `{MEAN_FILL_KL_MATCHED}` and "
        f"`{PLACEBO_KL_MATCHED}` at the matched gamma."
        if MEAN_FILL_PAPO_G in scores
        else ""
    )
    return [
        "## The placebo: PAPO-G's term against a mask that removes no task information\n"
        f"{verdicts}\n\n"
        f"`{PLACEBO}` is PAPO-G at {treatment}'s gamma ({gammas[treatment]:g}) whose mask covers only background "
        "patches, never a patch that shows the square (the testbed's `square_units`, "
        "`PAPOGConfig.mask_excluded_column`), filled with the processor's mean colour (`mask_fill='mean'`: the "
        "background is black, so a black fill would "
        f"change no pixel and the term would be exactly 0); `papo_nb/workbook/study/placebo.py`.{matched}{same_fill} "
        "The perception KL, each run's mean over its logged steps: `mean` over seeds with its `ci95`, and the "
        "`smallest` run's (a mask that changed no pixel would log 0), and the runs the collapse detector flagged "
        "(`collapsed`; its modes are in the dose table and the runs' verdicts in runs.json):\n\n" + kl_table,
        "## The placebo's contrasts, paired over seeds\n"
        "`diff`: treatment - control with its 95% CI and the paired t-test's p; `sign_p` and `wilcoxon_p` the exact "
        "tests (5 pairs cannot go below 0.0625); `mde` the smallest difference these pairs detect 80% of the time; "
        f"`{TRAIN_ACCURACY}` the accuracy reward of the last {END_REWARD_WINDOW} logged rollout batches.\n\n"
        + tables.records_markdown(rows),
    ]
