"""The VPPO arm on a calibrated study page: does VPPO, the second masked-branch method (token filtering
and advantage shaping on the perception KL, ``papo_nb.vppo``), keep the policy on the image where GRPO drifts
off it, beside PAPO-G?

Nothing here computes a statistic of its own: the drift and the verdict are ``drift``'s, the per-arm tables
``stats.summary_rows`` with ``tables.comparison_table`` (the page's other tables), the training reward
``controls.end_reward``'s window. The only words of its own are the verdict's, which says plainly when VPPO does not
drift less than GRPO and what the seeds could have detected (the MDE).
"""

from __future__ import annotations

import math
from statistics import mean

from papo_nb.workbook.study import drift, errors, tables
from papo_nb.workbook.study import stats as study_stats
from papo_nb.workbook.study.arms import GRPO, PAPO_G, PAPO_G_COLLAPSE, SEARCH, SWEEP, VPPO, Study
from papo_nb.workbook.study.controls import END_REWARD_WINDOW, end_reward
from papo_nb.workbook.study.power import gain_detected

GAP = "avg_at_k/gap/vision"
# held-out accuracy, the reliance gap and the error split: the current split's names and the older pages' (the
# scores a run recorded carry one or the other; a metric no run has is left out of the table)
HELD_OUT = (drift.PRIMARY, "avg_at_k/masked/vision", GAP, "greedy/original/vision", drift.CONSISTENT)
ERROR_SPLIT = (*errors.SPLIT_METRICS, *errors.LEGACY_SPLIT)
# the training reward at the end of training (the matched controls' window), accuracy and total (accuracy + format)
TRAIN_ACCURACY, TRAIN_REWARD = "train/accuracy_reward_end", "train/reward_end"
# VPPO's own per-step metrics (``VPPOTrainer``), averaged over its steps and then over seeds
DEPENDENCY = ("vppo/kept_token_share", "vppo/advantage_scale_max")


def arm_runs(study: Study) -> dict:
    """arm -> seed -> run, without the collapse arm and the search (runs of other seeds and gammas)."""
    return {arm: runs for arm, runs in study.by_arm().items() if arm not in (PAPO_G_COLLAPSE, SEARCH, SWEEP)}


def training_scores(study: Study) -> dict[str, dict[int, dict]]:
    """arm -> seed -> the end-of-training accuracy reward and total reward (mean of the last
    ``END_REWARD_WINDOW`` logged rollout batches), to be tabled like held-out scores."""
    return {
        arm: {
            seed: {
                TRAIN_ACCURACY: end_reward(run.step_logs),
                TRAIN_REWARD: end_reward(run.step_logs, key="reward"),
            }
            for seed, run in runs.items()
        }
        for arm, runs in arm_runs(study).items()
    }


def _paired_table(scores: dict[str, dict[int, dict]], metrics: tuple[str, ...]) -> str:
    present = [m for m in metrics if any(m in s for by_seed in scores.values() for s in by_seed.values())]
    rows = study_stats.summary_rows(scores, present, GRPO)
    return tables.markdown_table(tables.comparison_table(rows, GRPO))


def _beside(scores: dict[str, dict[int, dict]]) -> dict[str, dict[int, dict]]:
    """GRPO, VPPO and the PAPO-G arms over every seed, in that order (the matched controls are another page's
    question; the collapse arm ran one seed)."""
    order = [GRPO, VPPO, *(arm for arm in scores if arm.startswith(PAPO_G) and arm != PAPO_G_COLLAPSE)]
    return {arm: scores[arm] for arm in order if arm in scores}


def vppo_verdict(start: dict, scores: dict[str, dict[int, dict]]) -> dict:
    """VPPO against GRPO on the prior-breaking items: its drift beside GRPO's, the paired difference with its CI, p,
    TOST and MDE (``drift.arm_verdicts``), and the verdict in words."""
    pair = {GRPO: scores[GRPO], VPPO: scores[VPPO]}
    drifts = {row["arm"]: row for row in drift.drift_rows(start, pair, (drift.PRIMARY,))}
    row = drift.arm_verdicts(pair, {GRPO: 0.0, VPPO: 0.0}, GRPO)[0]
    ours, theirs = drifts[VPPO], drifts[GRPO]
    here = (
        f"VPPO drifts {ours['drift']:+.3f} +/- {ours['drift_ci95']:.3f} from the warm start's {ours['step_0']:.3f}, "
        f"GRPO {theirs['drift']:+.3f} +/- {theirs['drift_ci95']:.3f}; VPPO - GRPO = {row['diff']:+.3f} +/- "
        f"{row['diff_ci95']:.3f} (paired p = {row['p_value']:.2g}, {row['pairs']} seed pairs; TOST at "
        f"+-{drift.EQUIVALENCE_MARGIN:g}: p = {row['tost_p']:.2g}; MDE {row['mde']:.3f})"
    )
    effect = f"{row['diff']:+.3f}, p = {row['p_value']:.2g}"
    if gain_detected(row):
        verdict = f"VPPO drifts less than GRPO: it keeps {row['diff']:+.3f} of GRPO's loss (p = {row['p_value']:.2g})"
        short = f"less ({effect})"
    else:
        verdict = (
            f"VPPO does not drift less than GRPO here ({effect}); these {row['pairs']} seeds would have detected a "
            f"difference of {row['mde']:.3f} or more 80% of the time"
        )
        short = f"not less ({effect}; MDE {row['mde']:.3f})"
        if math.isfinite(row["tost_p"]) and row["tost_p"] < 0.05:
            verdict += f", and it is equivalent to GRPO within +-{drift.EQUIVALENCE_MARGIN:g}"
            short += f", equivalent within +-{drift.EQUIVALENCE_MARGIN:g}"
    numbers = {k: row[k] for k in ("diff", "diff_ci95", "p_value", "tost_p", "mde")}
    return {"verdict": verdict, "short": short, "here": here, **numbers}


def dependency_rows(study: Study) -> list[dict]:
    """VPPO's own per-step metrics: each run's mean over its logged steps, then the mean over seeds with its CI."""
    runs = arm_runs(study).get(VPPO, {})
    rows = []
    for key in DEPENDENCY:
        per_seed = [mean(values) for run in runs.values() if (values := [r[key] for r in run.step_logs if key in r])]
        if per_seed:
            centre, half = study_stats.mean_ci(per_seed)
            rows.append({"metric": key, "seeds": len(per_seed), "mean": centre, "ci95": half})
    return rows


def vppo_sections(study: Study) -> list[str]:
    """The VPPO sections of a calibrated page (none without a VPPO arm or a warm-start score)."""
    if VPPO not in study.by_arm() or GRPO not in study.by_arm() or not study.start_scores:
        return []
    scores = _beside(study.scores())
    claim = vppo_verdict(study.start_scores, scores)
    dependency = "\n".join(
        f"| {row['metric']} | {row['seeds']} | {row['mean']:.3f} ± {row['ci95']:.3f} |"
        for row in dependency_rows(study)
    )
    return [
        f"## Does VPPO drift less than GRPO?\n**{claim['verdict']}.** {claim['here']}.\n\n"
        "VPPO (`papo_nb.vppo`, the official k = 0.4 and band bottom 0.9) trains at gamma 0 with everything else "
        "as GRPO's, paired over the same seeds and warm start; its drift, reliance gap, error split and training "
        "reward are in the tables below, each arm with its 95% CI and its paired difference against GRPO.",
        "## VPPO beside GRPO and PAPO-G: held-out accuracy and the reliance gap (mean +/- 95% CI; paired difference "
        "against GRPO)\n\n" + _paired_table(scores, HELD_OUT),
        "## VPPO beside GRPO and PAPO-G: the error split (greedy, prior-breaking items)\n"
        "`followed_prior`/`prior`: answered the colour the question's number names, against the image; `misread`/"
        "`decoy`/`other`: another wrong answer; `prior_share`: the prior's share of the errors.\n\n"
        + _paired_table(scores, ERROR_SPLIT),
        f"## VPPO beside GRPO and PAPO-G: training reward (mean of the last {END_REWARD_WINDOW} logged rollout "
        "batches)\n`accuracy_reward_end`: the accuracy reward; `reward_end`: accuracy + format.\n\n"
        + _paired_table(_beside(training_scores(study)), (TRAIN_ACCURACY, TRAIN_REWARD))
        + "\n\nVPPO's own metrics, each run's mean over its steps: the share of completion tokens that carry the "
        "gradient, and the largest advantage scale of a step.\n\n| metric | seeds | mean ± 95% CI |\n|---|---:|---|\n"
        + dependency,
    ]
