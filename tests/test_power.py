"""The study's power arithmetic: the MDE against a simulation of the paired t-test, and verdicts that carry it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from papo_nb.workbook.study.power import (
    effect_verdict,
    minimum_detectable_effect,
    pairs_needed,
    power_row,
)


@pytest.mark.parametrize("pairs", [3, 6, 12])
def test_the_mde_is_detected_80_percent_of_the_time_in_simulation(pairs):
    sd = 0.03
    mde = minimum_detectable_effect(sd, pairs)
    rng = np.random.default_rng(pairs)
    diffs = rng.normal(mde, sd, size=(20_000, pairs))
    rejected = stats.ttest_1samp(diffs, 0.0, axis=1).pvalue < 0.05
    assert rejected.mean() == pytest.approx(0.80, abs=0.015)


def test_large_samples_reach_the_normal_approximation():
    # (z_0.975 + z_0.80) * sd / sqrt(n) = 2.8016 / 20 for n = 400, sd = 1
    assert minimum_detectable_effect(1.0, 400) == pytest.approx(2.8016 / 20, rel=0.005)


def test_three_seeds_need_a_difference_of_about_three_and_a_quarter_sd():
    # recorded: the noncentral-t solution for n = 3 (two-sided 5%, 80%); G*Power gives d = 3.26 for this design
    assert minimum_detectable_effect(1.0, 3) == pytest.approx(3.2640, abs=1e-3)


def test_pairs_needed_is_the_first_that_reaches_the_target():
    need = pairs_needed(0.03, 0.02)
    assert minimum_detectable_effect(0.03, need) <= 0.02 < minimum_detectable_effect(0.03, need - 1)


def test_power_row_without_spread_says_so():
    row = power_row([0.5, 0.6], [0.4, 0.5])  # both differences 0.1: no spread
    assert row["diff_sd"] == 0 and math.isnan(row["mde"])
    assert math.isnan(power_row([0.5], [0.4])["diff_sd"])
    with pytest.raises(ValueError, match="equal lengths"):
        power_row([0.5, 0.6], [0.4])


def test_verdicts_name_the_effect_or_the_mde():
    assert effect_verdict(0.031, 0.01, 0.02) == "detected higher (+0.031, p = 0.01)"
    assert effect_verdict(0.004, 0.42, 0.018) == "not detected (+0.004; MDE 0.018)"
    assert effect_verdict(-0.01, 0.6, math.nan) == "not detected (-0.010; MDE unknown: seed spread not estimable)"
    assert effect_verdict(math.nan, math.nan, 0.02) == "not measured"


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"sd": 0.0, "pairs": 3}, "sd = 0.0"), ({"sd": 1.0, "pairs": 1}, "pairs = 1")]
)
def test_bad_input_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        minimum_detectable_effect(**kwargs)
