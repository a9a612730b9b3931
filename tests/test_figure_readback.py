"""Every figure a notebook logs, read back from its matplotlib Figure (issue 61): each named line finite over its
axis, each point of the evidence drawn or counted in the figure as off-axis, no empty or duplicate panel, no line
drawn between measurements as if measured, the legend off the data. Evidence here is synthetic and shaped like the
smoke workbook's (8 of 24 calibration batches with a zero parent gradient, fp32 roundoff exactly 0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from figure_checks import (
    assert_readable,
    bars,
    legend_covers_a_bar,
    named,
    scatter_offsets,
    texts,
)

from papo_nb.papo.probe.contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from papo_nb.papo.probe.projection import POWER_MARGIN, TERM_NAMES
from papo_nb.workbook.verification.calibration import CalibrationPoint
from papo_nb.workbook.verification.calibration_plots import (
    plot_both_tests,
    plot_calibration,
    plot_false_alarms,
    plot_power,
)


def term_entry(batch: int, precision: str) -> dict:
    floor = 0.0 if precision == "fp32" else 1e-6 * (batch + 1)  # fp32 roundoff is exactly 0 on the CPU
    ratio = math.inf if floor == 0 else (5.0 if batch == 1 else 1e4)
    return dict(testable=True, coefficient=0.0 if floor == 0 else 3e-7, noise_floor=floor, grad_norm=0.01,
                detectable_coefficient=7.1 * floor, norm_rule_detectable_coefficient=0.1,
                injected_leak_over_floor=ratio, powered=math.isfinite(ratio) and ratio >= POWER_MARGIN)  # fmt: skip


def smoke_like_points() -> list[CalibrationPoint]:
    """2 phases x 2 precisions x 6 batches; batches 0 and 3 of every phase and precision, 8 of 24, had every group
    agree: a zero parent gradient (and so a zero difference and leak). masked_entropy never testable."""
    points = []
    for phase in ("phase1", "phase2"):
        for precision in ("fp32", "bf16"):
            for batch in range(6):
                parent = 0.0 if batch in (0, 3) else 10.0 ** (batch - 4)
                roundoff = 0.0 if precision == "fp32" else 1e-4 * parent
                terms = {name: term_entry(batch, precision) for name in TERM_NAMES[:2]} if parent else {}
                terms[TERM_NAMES[2]] = {"testable": False}
                for name in TERM_NAMES[:2]:
                    terms.setdefault(name, {"testable": False})
                tolerance = max(GAMMA_ZERO_GRADIENT_REL_TOL * parent, GAMMA_ZERO_GRADIENT_ABS_FLOOR)
                points.append(CalibrationPoint(phase, precision, batch, parent, roundoff, tolerance, 0.5 * parent,
                                               0.4 * parent, 1e-2, True, terms=terms))  # fmt: skip
    return points


def test_the_calibration_figure_draws_its_boundary_and_every_batch_zero_parent_gradients_on_a_labelled_floor():
    """Fails on 1f60324's figure: a zero parent gradient made the boundary's range -inf (every boundary value NaN)
    and its batches sat at x = 0, which a log axis drops (8 of the smoke workbook's 24)."""
    points = smoke_like_points()
    fig = plot_calibration(points)
    (ax,) = fig.axes
    assert_readable(fig)
    (boundary,) = [line for line in ax.lines if "tolerance boundary" in line.get_label()]
    x, y = (np.asarray(v, dtype=float) for v in boundary.get_data())
    assert np.allclose(y, np.maximum(GAMMA_ZERO_GRADIENT_REL_TOL * x, GAMMA_ZERO_GRADIENT_ABS_FLOOR))
    offsets = scatter_offsets(ax)
    assert len(offsets) == 3 * len(points), "every batch's roundoff, perception gradient and injected leak is drawn"
    assert x.min() <= offsets[:, 0].min() and x.max() >= offsets[:, 0].max(), "the boundary spans every batch"
    (column,) = [line for line in ax.lines if line.get_label().startswith("zero parent gradient")]
    x_floor = column.get_xdata()[0]
    assert x_floor < min(p.parent_grad_norm for p in points if p.parent_grad_norm > 0)
    assert np.isclose(offsets[:, 0], x_floor).sum() == 3 * 8
    assert column.get_label().endswith("8 of 24 batches")
    (floor_line,) = [line for line in ax.lines if line.get_label().startswith("exact zero")]
    zeros = sum(v == 0 for p in points for v in (p.grad_diff_norm, p.perception_grad_norm, p.injected_leak_diff))
    assert np.isclose(offsets[:, 1], floor_line.get_ydata()[0]).sum() == zeros
    assert floor_line.get_label().endswith(f"{zeros} points")
    assert "24 batches" in ax.get_title()


def test_both_tests_draw_every_tested_term_of_every_batch():
    points = smoke_like_points()
    fig = plot_both_tests(points)
    assert_readable(fig)
    left, right = fig.axes
    tested = sum(p.terms[name].get("testable", False) for p in points for name in TERM_NAMES)
    assert len(scatter_offsets(left)) == 2 * tested and len(scatter_offsets(right)) == 3 * tested


def test_the_power_figure_has_one_colour_per_term_and_counts_every_batch_and_term():
    """Issue 61: perception_kl and masked_entropy shared one colour (an empty bar series took the default), and a
    zero noise floor's infinite ratio was drawn at 1 in the 'powered' colour though the probe defers such a batch."""
    points = smoke_like_points()
    fig = plot_power(points)
    (ax,) = fig.axes
    assert_readable(fig)
    assert len(bars(ax)) + texts(ax).count("n/t") == len(points) * len(TERM_NAMES)
    handles = ax.get_legend().legend_handles
    by_term = {name: h for name in TERM_NAMES for h in handles if h.get_label().startswith(f"{name},")}
    assert sorted(by_term) == sorted(TERM_NAMES)
    colours = {name: tuple(h.get_facecolor()) for name, h in by_term.items()}
    assert len(set(colours.values())) == len(TERM_NAMES), colours
    assert by_term[TERM_NAMES[2]].get_label().endswith("not testable on any batch")
    for bar in bars(ax):  # a bar the probe would defer is hatched, whatever its height
        assert bar.get_height() > 0 and (bar.get_hatch() == "xx") == (bar.get_height() < POWER_MARGIN), bar
    infinite = sum(p.terms[n].get("injected_leak_over_floor") == math.inf for p in points for n in TERM_NAMES)
    assert any(h.get_label().endswith(f"drawn at 1): {infinite} bars") for h in handles)
    assert {tuple(b.get_facecolor()) for b in bars(ax)} <= {tuple(h.get_facecolor()) for h in by_term.values()}, (
        "every bar in its term's colour"
    )


def false_alarm_evaluations() -> list[dict]:
    rows = []
    for label, zeros in (("bf16", 0), ("fp32", 400)):
        for i in range(504):
            value = 0.0 if i < zeros else 10 ** (-3 + 2.5 * i / 504)
            rows.append({"label": label, "projection_statistic": value, "block_statistic": value / 2,
                         "old_rule_floors": 6 * min(2.0, 3 * value + 1e-3)})  # fmt: skip
    return rows


def test_the_false_alarm_titles_say_what_is_counted_and_every_evaluation_is_in_a_bin():
    evaluations = false_alarm_evaluations()
    fig = plot_false_alarms(evaluations)
    assert_readable(fig)
    for ax, label in zip(fig.axes, ("bf16", "fp32")):
        assert ax.get_title().startswith(f"{label}: 0 probe false alarms in 504 clean evaluations (old rule: ")
        heights = [b.get_height() for b in bars(ax)]
        assert sum(heights) == 2 * 504, "each evaluation in one bin of each histogram, exact zeros included"
    zero_line = [line for line in fig.axes[1].lines if line.get_label().startswith("statistic exactly 0")]
    assert len(zero_line) == 1 and zero_line[0].get_label().endswith(": 400")


# --------------------------------------------------------------------------------------------
# notebook 04
# --------------------------------------------------------------------------------------------


def study_without_sweep():
    """The smoke workbook's 04: a given collapse gamma (no sweep), GRPO and PAPO-G at one gamma, 5 seeds, every
    held-out item a vision item, the warm start scored (calibrated design)."""
    from papo_nb.workbook.study.arms import GRPO, Study, StudyRun

    runs = []
    for arm, gamma, level in ((GRPO, 0.0, 0.40), ("papo_g_half", 1.675, 0.48)):
        for seed in range(5):
            score = level + 0.01 * seed
            scores = {f"avg_at_k/{c}/{s}": (score if c == "original" else 0.25) for c in ("original", "masked")
                      for s in ("all", "vision")}  # fmt: skip
            scores |= {f"avg_at_k/gap/{s}": score - 0.25 for s in ("all", "vision")}
            logs = [{"step": t, "rewards/accuracy_reward/mean": 0.6, "perception_kl": 0.04, "entropy": 0.11,
                     "masked_entropy": 0.15, "clip_ratio/high_mean": 0.0} for t in range(1, 5)]  # fmt: skip
            runs.append(StudyRun(arm, seed, gamma, "", logs, scores, {"collapsed": False, "step": None}, 1.0))
    start = {"avg_at_k/original/vision": 0.465, "avg_at_k/masked/vision": 0.26, "avg_at_k/original/all": 0.465,
             "avg_at_k/masked/all": 0.26, "avg_at_k/gap/vision": 0.205}  # fmt: skip
    return Study(collapse_gamma=3.35, collapse_found=True, runs=runs, start_scores=start)


def test_the_learning_curves_have_no_empty_sweep_panel():
    from papo_nb.workbook.study.plots import CURVES, plot_learning_curves

    fig = plot_learning_curves(study_without_sweep())
    assert_readable(fig)
    assert len(fig.axes) == len(CURVES), [ax.get_title() for ax in fig.axes]
    assert not any("sweep" in ax.get_title() for ax in fig.axes)


def test_the_dose_response_draws_measured_gammas_only_and_the_warm_start():
    from papo_nb.workbook.study import dose

    study = study_without_sweep()
    rows = dose.dose_rows(study)
    fig = dose.plot_dose_response(rows, start=study.start_scores)
    assert_readable(fig)
    for ax in fig.axes:
        for line in ax.lines:  # a data line carries markers only: nothing drawn between two gammas
            if line.get_transform().contains_branch_seperately(ax.transData) == (True, True):
                assert line.get_linestyle() == "None", (ax.get_title(), line.get_label())
        assert not [c for c in ax.collections if type(c).__name__ == "FillBetweenPolyCollection"], ax.get_title()
    accuracy = fig.axes[0]
    warm = [line for line in accuracy.lines if line.get_label().startswith("warm start (step 0)")]
    assert sorted(line.get_ydata()[0] for line in warm) == [0.26, 0.465]


def test_the_accuracy_figure_has_no_duplicate_panel_and_draws_the_warm_start():
    from papo_nb.workbook.study.plots import plot_accuracy

    fig = plot_accuracy(study_without_sweep(), chance=0.25)
    assert_readable(fig)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["avg_at_k accuracy, vision items (every held-out item)"], titles
    (ax,) = fig.axes
    assert len(bars(ax)) == 4, "two arms, original and masked"
    labels = [h.get_label() for h in named(ax.lines)]
    assert "warm start (step 0), original: 0.465" in labels and "chance (0.25)" in labels


# --------------------------------------------------------------------------------------------
# notebooks 03 and 05
# --------------------------------------------------------------------------------------------


def test_the_evaluation_legend_covers_no_bar():
    from papo_nb.workbook.evaluation.report import plot_original_vs_masked

    keys = ("avg_at_k", "avg_at_k_masked", "greedy", "greedy_masked")
    table = [{"name": n, **dict(zip(keys, v))} for n, v in (
        ("testbed_text", (0.99, 0.99, 1.0, 1.0)), ("testbed_vision", (0.62, 0.35, 0.65, 0.35)),
        ("general", (0.99, 0.99, 1.0, 1.0)), ("vision_dependent", (0.62, 0.35, 0.65, 0.35)),
        ("overall", (0.81, 0.67, 0.82, 0.68)))]  # fmt: skip
    fig = plot_original_vs_masked(table, 4)
    assert_readable(fig)
    assert sum(len(bars(ax)) for ax in fig.axes) == 2 * 2 * len(table)
    assert legend_covers_a_bar(fig) == []


def test_the_training_curves_draw_every_logged_step():
    from papo_nb.workbook.training.figures import plot_training_curves

    steps = [{"step": s, "reward": 0.1 * s, "perception_loss": -0.01 * s, "entropy": 5.8, "masked_entropy": 5.9,
              "clip_ratio/high_mean": 0.0} for s in range(1, 7)]  # fmt: skip
    fig = plot_training_curves(steps)
    assert_readable(fig)
    assert all(len(line.get_xdata()) == 6 for ax in fig.axes for line in ax.lines)


def test_the_probe_figure_draws_every_tested_block():
    from papo_nb.workbook.results.probe_record import plot_probe

    blocks = {f"layer{i}.q_proj": {"perception_kl": {"testable": True, "statistic": 0.1 * (i + 1)},
                                   "masked_entropy": {"testable": False}} for i in range(4)}  # fmt: skip
    evidence = {"status": "passed", "block_leaks": blocks,
                "term_leaks": {"perception_kl": {"testable": True, "statistic": 0.2}}}  # fmt: skip
    fig = plot_probe(evidence)
    assert_readable(fig)
    (ax,) = fig.axes
    assert [b.get_height() for b in bars(ax)] == pytest.approx([0.1, 0.2, 0.3, 0.4])
