"""Dose-response of the method study: every trained run grouped by gamma, so a reader sees whether image reliance
rises with gamma before the policy breaks.

Per gamma: held-out accuracy per split with original and masked images, the reliance gap (original - masked), the
perception KL and both entropies at the end of training (the mean of the last ``END_WINDOW`` logged values), and how
many of its runs the collapse detector flagged. Values are means over seeds with a 95% Student-t half-width.
"""

from __future__ import annotations

import math
from statistics import mean

from matplotlib.figure import Figure

from papo_nb.workbook.study.arms import VPPO, Study, StudyRun, perception_kl_measured
from papo_nb.workbook.study.controls import CONTROL_ARMS
from papo_nb.workbook.study.placebo import PLACEBO_ARMS
from papo_nb.workbook.study.power import effect_verdict, power_row
from papo_nb.workbook.study.search import is_entropy_arm
from papo_nb.workbook.study.stats import mean_ci, paired_test

END_WINDOW = 3  # logged steps averaged for "at the end of training"
SCORES = tuple(f"avg_at_k/{kind}/{split}" for split in ("vision", "text") for kind in ("original", "masked", "gap"))
END_METRICS = ("perception_kl", "entropy", "masked_entropy")
# arms that are not a point of the dose-response: the gamma-0 matched controls (GRPO held back another way), VPPO
# (another use of the perception KL), and the placebo arms, at a PAPO-G gamma with another mask; arms of their own
OFF_DOSE_ARMS = (*CONTROL_ARMS, VPPO, *PLACEBO_ARMS)


def off_dose(arm: str | None) -> bool:
    """Not a point of the dose-response: an ``OFF_DOSE_ARMS`` arm, or PAPO-G with the double entropy loss (at a
    gamma the plain arm also runs at)."""
    return arm in OFF_DOSE_ARMS or (arm is not None and is_entropy_arm(arm))


def _end_value(run: StudyRun, key: str) -> float:
    """The mean of the last logged values; NaN for a perception KL that was never measured (0 at every step)."""
    if key == "perception_kl" and not perception_kl_measured(run.step_logs):
        return math.nan
    values = [row[key] for row in run.step_logs if key in row]
    return mean(values[-END_WINDOW:]) if values else math.nan


def runs_by_gamma(study: Study) -> dict[float, dict[int, StudyRun]]:
    """gamma -> seed -> run, over the arms and the sweep (a run reused by two arms counts once, under the name it was
    trained as: a sweep or search run counted as the collapse arm stays a sweep or search run)."""
    grouped: dict[float, dict[int, StudyRun]] = {}
    for run in [*study.runs, *study.sweep]:
        if not off_dose(run.arm):
            grouped.setdefault(run.gamma, {})[run.seed] = run
    return dict(sorted(grouped.items()))


def dose_rows(study: Study) -> list[dict]:
    """One row per gamma: seeds, ``<metric>`` and ``<metric>_ci95`` for every score and end-of-training metric,
    and ``collapsed`` (runs flagged)."""
    rows = []
    for gamma, by_seed in runs_by_gamma(study).items():
        runs = [by_seed[s] for s in sorted(by_seed)]
        row = {"gamma": gamma, "seeds": len(runs), "collapsed": sum(bool(r.collapse["collapsed"]) for r in runs)}
        values = {key: [r.scores[key] for r in runs if key in r.scores] for key in SCORES}
        values |= {key: [v for r in runs if not math.isnan(v := _end_value(r, key))] for key in END_METRICS}
        for key, series in values.items():
            if series:
                row[key], row[f"{key}_ci95"] = mean_ci(series)
        rows.append(row)
    return rows


def dose_markdown(rows: list[dict]) -> str:
    """The table beside the figure: mean +/- CI per gamma ("no items" where a split is missing)."""
    columns = [*SCORES, *END_METRICS]
    lines = [
        "| gamma | seeds | " + " | ".join(columns) + " | collapsed |",
        "|---:|---:|" + "---:|" * len(columns) + "---:|",
    ]
    for row in rows:
        cells = []
        for key in columns:
            if key not in row:  # a score without items, or a KL no run measured (a skipped masked branch)
                cells.append("not measured" if key == "perception_kl" else "no items")
                continue
            half = row[f"{key}_ci95"]
            cells.append(f"{row[key]:.3f}" + (f" +/- {half:.3f}" if math.isfinite(half) else ""))
        lines.append(
            f"| {row['gamma']:g} | {row['seeds']} | " + " | ".join(cells) + f" | {row['collapsed']}/{row['seeds']} |"
        )
    return "\n".join(lines)


PANELS = (
    (("avg_at_k/original/vision", "avg_at_k/masked/vision"), "vision-dependent avg@k: original vs masked"),
    (("avg_at_k/gap/vision", "avg_at_k/gap/text"), "reliance gap (original - masked)"),
    (("perception_kl",), "perception KL at the end, nats/token"),
    (("entropy", "masked_entropy"), "entropy at the end: original vs masked images"),
)


# The y-axis spans at least this many seed-spread half-widths, and this share of the panel's largest value, so a
# difference below the seed spread (or a tiny one with a single seed) is drawn flat rather than as a cliff.
SPREADS_PER_AXIS = 4.0
MIN_RELATIVE_SPAN = 0.5


def honest_ylim(centres: list[float], halves: list[float]) -> tuple[float, float]:
    """y-limits around the drawn values and bands, widened to ``SPREADS_PER_AXIS`` half-widths and to
    ``MIN_RELATIVE_SPAN`` of the largest magnitude (at least 1e-6)."""
    low = min(c - h for c, h in zip(centres, halves, strict=True))
    high = max(c + h for c, h in zip(centres, halves, strict=True))
    span = max(high - low, SPREADS_PER_AXIS * max(halves), MIN_RELATIVE_SPAN * max(map(abs, centres)), 1e-6)
    middle = (low + high) / 2
    return middle - 0.55 * span, middle + 0.55 * span


def plot_dose_response(rows: list[dict], title: str = "", start: dict | None = None) -> Figure:
    """Each metric against gamma (symmetric log axis, linear through 0): per gamma run, the mean over seeds with its
    95% CI as an error bar, and no line between gammas (nothing between them was run); gammas with a flagged run are
    marked, and ``start`` (the warm start's held-out scores, step 0) is drawn where it has the panel's metric."""
    fig = Figure(figsize=(16, 4), layout="constrained")
    gammas = [row["gamma"] for row in rows]
    positive = [g for g in gammas if g > 0]
    start = start or {}
    for ax, (keys, panel) in zip(fig.subplots(1, len(PANELS)), PANELS):
        drawn: tuple[list[float], list[float]] = ([], [])
        for key in keys:
            points = [(row["gamma"], row[key], row[f"{key}_ci95"]) for row in rows if key in row]
            if not points:
                continue
            xs, centre, half = zip(*points)
            half = [h if math.isfinite(h) else 0.0 for h in half]
            bars = ax.errorbar(xs, centre, yerr=half, fmt="o", capsize=4, label=f"{key.split('/', 1)[-1]}")
            drawn[0].extend(centre)
            drawn[1].extend(half)
            if key in start:
                ax.axhline(start[key], color=bars[0].get_color(), linestyle="--", linewidth=1,
                           label=f"warm start (step 0): {start[key]:.3f}")  # fmt: skip
                drawn[0].append(start[key])
                drawn[1].append(0.0)
        if drawn[0]:
            ax.set_ylim(*honest_ylim(*drawn))
        flagged = [row["gamma"] for row in rows if row["collapsed"]]
        for gamma in flagged:
            label = f"a run flagged as collapsed ({len(flagged)} gammas)" if gamma == flagged[0] else "_flagged"
            ax.axvline(gamma, color="tab:red", linestyle=":", linewidth=1, label=label)
        if positive:
            ax.set_xscale("symlog", linthresh=min(positive))
        # gamma is never negative (autoscaling would open the symlog axis's negative side); a margin on both sides
        # so the end points' error bars are drawn whole
        ax.set_xlim(-min(positive or [1.0]) / 4, 1.6 * max(positive or [1.0]))
        ax.set_xlabel("gamma (perception_loss_weight)")
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        title
        or "Dose-response: mean over seeds with its 95% CI at each gamma run (no line: gammas between them were "
        "not run), dashed = the warm start, dotted red = a run flagged as collapsed"
    )
    return fig


CONTRASTS = ("avg_at_k/original/vision", "avg_at_k/gap/vision")  # the headline and the reliance gap


def run_records(study: Study) -> list[dict]:
    """Every trained run once, as plain records (``arm``, ``gamma``, ``seed``, ``scores``, the collapse verdict):
    what a results page keeps so its contrasts can be recomputed by the code on main."""
    return [
        {"arm": run.arm, "gamma": run.gamma, "seed": run.seed, "scores": run.scores, "collapse": _verdict_record(run)}
        for run in _every_run(study)
    ]


def _every_run(study: Study) -> list[StudyRun]:
    """Every trained run once: by gamma (``runs_by_gamma``), then the off-dose arms' runs (controls, VPPO)."""
    dosed = [run for _, by_seed in runs_by_gamma(study).items() for _, run in sorted(by_seed.items())]
    return dosed + [run for run in study.runs if off_dose(run.arm)]


def _verdict_record(run: StudyRun) -> dict:
    return {key: run.collapse.get(key) for key in ("collapsed", "step", "mode", "symptoms", "detected_by")}


def step_log_records(study: Study) -> list[dict]:
    """Every trained run's per-step training metrics (4 significant digits), so each collapse label on a page can
    be rechecked from the page alone (``collapse.detect_collapse`` on ``steps``)."""
    return [
        {"arm": run.arm, "gamma": run.gamma, "seed": run.seed,
         "steps": [{k: float(f"{v:.4g}") for k, v in row.items()} for row in run.step_logs]}
        for run in _every_run(study)
    ]  # fmt: skip


def dose_contrasts(records: list[dict]) -> list[dict]:
    """Each gamma > 0 against gamma 0 (GRPO), paired over the seeds both ran, on ``CONTRASTS``: the mean paired
    difference, its p-value, the MDE at 80% power and the verdict (``power.effect_verdict``)."""
    scores: dict[float, dict[int, dict]] = {}
    for record in records:
        if not off_dose(record.get("arm")):
            scores.setdefault(record["gamma"], {})[record["seed"]] = record["scores"]
    control = scores.get(0.0, {})
    rows = []
    for gamma in sorted(g for g in scores if g > 0):
        row = {"gamma": gamma}
        for metric in CONTRASTS:
            seeds = sorted(s for s in set(scores[gamma]) & set(control) if metric in control[s])
            ours, base = [scores[gamma][s][metric] for s in seeds], [control[s][metric] for s in seeds]
            test = paired_test(ours, base)
            row[f"{metric} vs gamma 0"] = effect_verdict(test["diff"], test["p_value"], power_row(ours, base)["mde"])
        rows.append(row)
    return rows
