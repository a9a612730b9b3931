"""The dose-response view of a study: runs grouped by gamma, paired seeds, end-of-training values, the figure."""

from __future__ import annotations

import math

import pytest

from papo_nb.workbook.study.arms import GRPO, PAPO_G, PAPO_G_COLLAPSE, SWEEP, Study, StudyRun
from papo_nb.workbook.study.dose import dose_markdown, dose_rows, plot_dose_response, runs_by_gamma


def _run(arm, seed, gamma, vision, masked, kl, collapsed=False):
    logs = [{"step": s, "perception_kl": kl * s, "entropy": 0.5, "masked_entropy": 0.7} for s in (1, 2, 3, 4)]
    scores = {
        "avg_at_k/original/vision": vision,
        "avg_at_k/masked/vision": masked,
        "avg_at_k/gap/vision": vision - masked,
    }
    return StudyRun(arm, seed, gamma, f"{arm}-{seed}", logs, scores, {"collapsed": collapsed, "step": None}, 1.0)


def _study():
    sweep = [_run(SWEEP, s, 5.0, 0.3, 0.3, 2.0, collapsed=s == 0) for s in (0, 1)]
    runs = [_run(GRPO, s, 0.0, 0.5 + 0.1 * s, 0.3, 0.1) for s in (0, 1)]
    runs += [_run(PAPO_G, s, 0.02, 0.52 + 0.1 * s, 0.3, 0.2) for s in (0, 1)]
    runs += [
        StudyRun(PAPO_G_COLLAPSE, r.seed, r.gamma, r.run_id, r.step_logs, r.scores, r.collapse, 1.0) for r in sweep
    ]
    return Study(sweep=sweep, collapse_gamma=5.0, collapse_found=True, runs=runs)


def test_runs_are_grouped_by_gamma_once_each():
    grouped = runs_by_gamma(_study())
    assert list(grouped) == [0.0, 0.02, 5.0] and all(len(by_seed) == 2 for by_seed in grouped.values())


def test_dose_rows_average_seeds_and_the_end_of_training():
    rows = {row["gamma"]: row for row in dose_rows(_study())}
    assert rows[0.0]["avg_at_k/original/vision"] == pytest.approx(0.55)
    # two seeds 0.5 and 0.6: t(0.975, 1) * sd / sqrt(2) = 12.706 * 0.0707 / 1.414
    assert rows[0.0]["avg_at_k/original/vision_ci95"] == pytest.approx(0.6353, abs=1e-3)
    assert rows[0.02]["perception_kl"] == pytest.approx(0.2 * 3)  # last 3 logged values: 0.4, 0.6, 0.8
    assert rows[5.0]["collapsed"] == 1 and rows[0.0]["collapsed"] == 0
    assert "avg_at_k/original/text" not in rows[0.0]


def test_markdown_says_no_items_for_a_missing_split_and_plots_every_panel():
    rows = dose_rows(_study())
    table = dose_markdown(rows)
    assert "no items" in table and "nan" not in table and table.count("\n") == len(rows) + 1
    fig = plot_dose_response(rows)
    assert [ax.get_xscale() for ax in fig.axes] == ["symlog"] * 4
    assert all(ax.lines for ax in fig.axes) and not math.isnan(rows[-1]["avg_at_k/gap/vision"])


def test_contrasts_pair_each_gamma_with_grpo_on_the_same_seeds():
    from papo_nb.workbook.study.dose import dose_contrasts, run_records

    records = run_records(_study())
    assert sorted((r["gamma"], r["seed"]) for r in records) == [(g, s) for g in (0.0, 0.02, 5.0) for s in (0, 1)]
    rows = {row["gamma"]: row for row in dose_contrasts(records)}
    assert list(rows) == [0.02, 5.0]
    # 0.02: +0.02 on both seeds, so no spread: not detected, and no MDE can be estimated
    assert rows[0.02]["avg_at_k/original/vision vs gamma 0"] == (
        "not detected (+0.020; MDE unknown: seed spread not estimable)"
    )
    # 5.0: vision 0.3 against 0.5 and 0.6 (diffs -0.2, -0.3: sd 0.0707, 2 pairs, p = 0.126)
    assert rows[5.0]["avg_at_k/original/vision vs gamma 0"].startswith("not detected (-0.250; MDE ")
    many = [{"gamma": g, "seed": s, "scores": {"avg_at_k/original/vision": 0.5 + s / 100 - (g > 0) * (0.1 + s / 1000)}}
            for g in (0.0, 1.0) for s in range(5)]  # fmt: skip
    assert dose_contrasts(many)[0]["avg_at_k/original/vision vs gamma 0"].startswith("detected lower (-0.102, p = ")


def test_a_difference_below_the_seed_spread_is_drawn_flat():
    from papo_nb.workbook.study.dose import honest_ylim

    # a KL of 0.0100 vs 0.0102 with a seed spread of 0.003: the axis spans the spread, the step is under 5% of it
    low, high = honest_ylim([0.0100, 0.0102], [0.003, 0.003])
    assert 0.0002 / (high - low) < 0.05
    # one seed (no spread): the axis still spans half the value, so 0.0002 on 0.01 is a small step, not a cliff
    low, high = honest_ylim([0.0100, 0.0102], [0.0, 0.0])
    assert 0.0002 / (high - low) < 0.05
    # a real change (0.01 to 0.5) fills the axis
    low, high = honest_ylim([0.01, 0.5], [0.0, 0.0])
    assert 0.49 / (high - low) > 0.8


def test_a_kl_logged_as_zero_at_every_step_is_not_measured_not_zero():
    """Issue 41 item 6: a skipped masked branch logs perception_kl 0 at every step; the dose table says "not
    measured" rather than a KL of 0.000."""
    study = _study()
    for run in study.runs:
        if run.arm == GRPO:
            run.step_logs = [{**row, "perception_kl": 0.0} for row in run.step_logs]
    rows = {row["gamma"]: row for row in dose_rows(study)}
    assert "perception_kl" not in rows[0.0] and rows[0.02]["perception_kl"] == pytest.approx(0.6)
    assert dose_markdown(list(rows.values())).splitlines()[2].count("not measured") == 1


@pytest.mark.parametrize("arm", ["grpo_lr", "vppo"])
def test_a_gamma_0_arm_other_than_grpo_is_kept_apart_from_the_dose_response(arm):
    """Issue 41: a matched control is GRPO held back another way, at gamma 0; issue 46: VPPO trains at gamma 0 too.
    Neither may replace GRPO in the dose rows or the contrasts, and their runs are still recorded on the page."""
    from papo_nb.workbook.study.dose import dose_contrasts, run_records

    study = _study()
    study.runs += [_run(arm, s, 0.0, 0.9, 0.3, 0.1) for s in (0, 1)]
    assert runs_by_gamma(study)[0.0][0].arm == GRPO
    records = run_records(study)
    assert sum(r["arm"] == arm for r in records) == 2
    assert {row["gamma"]: row for row in dose_rows(study)}[0.0]["avg_at_k/original/vision"] == pytest.approx(0.55)
    assert dose_contrasts(records) == dose_contrasts(run_records(_study()))
