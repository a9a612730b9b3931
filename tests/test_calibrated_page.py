"""Issue 56's pooled page (``docs/measurements/calibrated_page.py``): the verdict's logic on a toy whose answer is
known, and the published page: rendered from its own files, each warm start's collapse gamma found again by the search
on the step logs its calls recorded."""

from __future__ import annotations

import json
from pathlib import Path

import calibrated_page as calibrated
import pytest
from test_warm_starts import toy_build

from papo_nb.testbed import policy as testbed_policy
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.study import warm_starts

ROOT = Path(__file__).resolve().parents[1]
BASE = [0.40, 0.42, 0.38, 0.41, 0.39]
ABOVE = [0.05, 0.06, 0.04, 0.05, 0.07]  # a margin the paired test detects, with spread


def toy(half_gain: float, placebo_gain: float, remedy_collapsed=()) -> dict:
    """Two warm starts that start at 0.45 and whose GRPO ends at ``BASE`` (drift about -0.05); PAPO-G at 1/2 and its
    remedy arm end ``half_gain`` times ``ABOVE`` above it, the placebo ``placebo_gain`` times."""
    arms = ["grpo", *calibrated.PLAIN, *calibrated.CONTROLS, "papo_g_half_entropy0.05", "papo_g_x1_entropy0.05"]
    by_arm = dict.fromkeys(arms, BASE)
    for arm, gain in (("papo_g_half", half_gain), ("papo_g_half_entropy0.05", half_gain),
                      ("placebo_kl_matched", placebo_gain)):  # fmt: skip
        by_arm[arm] = [x + d * gain for x, d in zip(BASE, ABOVE)]
    return {"params": "p.yaml", "warm_starts": [toy_build(b, 0.45, by_arm, remedy_collapsed) for b in (0, 1)]}


def test_the_verdict_says_which_arms_undo_the_drift_and_which_beat_every_control():
    data = toy(1.0, 0.0, remedy_collapsed={("papo_g_x1_entropy0.05", 0), ("papo_g_x1_entropy0.05", 3)})
    said = calibrated.verdict(data)
    assert "GRPO's drift on avg_at_k/original/vision, pooled over 10 runs on 2 warm starts, is -0.050" in said
    assert "PAPO-G undoes it at 1/2, 1/2 + entropy 0.05 (against GRPO:" in said  # its own end is the warm start's
    assert "1/4 not detected (+0.000" in said and "1x + entropy 0.05 not detected (+0.000; " in said
    assert "seed spread not estimable), 4 of 10 collapsed)" in said  # 1x + entropy: 2 on each warm start
    assert "Beating every control (" in said and "shown at 1/2, 1/2 + entropy 0.05 (1/2: - grpo_beta detected" in said
    same_as_placebo = calibrated.verdict(toy(1.0, 1.0))
    assert "shown by no PAPO-G arm" in same_as_placebo
    assert "- placebo_kl_matched not detected (+0.000" in same_as_placebo
    assert "does not undo it" in calibrated.verdict(toy(0.0, 0.0))


def test_an_arm_that_beats_grpo_but_ends_below_its_warm_start_does_not_undo_the_drift():
    data = toy(0.5, 0.0)  # half the margin: above GRPO, still 0.023 below the warm start
    row = calibrated.arm_row(data, "papo_g_half")
    assert row["against"]["grpo"]["p_value"] < 0.05 and row["own_drift"]["drift"] == pytest.approx(-0.023)
    assert not calibrated.undoes(row) and "does not undo it" in calibrated.verdict(data)


def test_remedy_arms_are_ordered_by_weight_then_gamma_and_labelled_by_fraction():
    data = {"warm_starts": [{"runs": [{"arm": a} for a in (
        "papo_g_entropy0.2", "papo_g_x1_entropy0.05", "papo_g_half_entropy0.2", "papo_g_entropy0.05",
        "papo_g_half_entropy0.05", "grpo")]}]}  # fmt: skip
    assert calibrated.remedy_arms(data) == [
        "papo_g_half_entropy0.05", "papo_g_x1_entropy0.05", "papo_g_entropy0.05", "papo_g_half_entropy0.2",
        "papo_g_entropy0.2",
    ]  # fmt: skip
    assert calibrated.label("papo_g_x1_entropy0.2") == "1x + entropy 0.2"
    assert calibrated.label("papo_g") == "0.02 (the recipe)"


def test_a_search_whose_calls_the_record_lacks_raises_instead_of_guessing():
    build = {"search": [{"gamma": 0.2, "step_logs": [{"step": s, "perception_kl": 0.01} for s in range(1, 11)]}]}
    with pytest.raises(KeyError):
        calibrated.rebuilt_search(build, [0.2, 1.0], healthy=0.02, steps=2)


def published() -> dict:
    return json.loads((calibrated.PAGE / warm_starts.RUNS_FILE).read_text())


def test_the_published_page_is_rendered_from_its_own_files_and_the_one_gamma_pages(tmp_path):
    page = tmp_path / calibrated.PAGE.name
    page.mkdir()
    (page / warm_starts.RUNS_FILE).write_text((calibrated.PAGE / warm_starts.RUNS_FILE).read_text())
    calibrated.rerender(page)
    assert (page / warm_starts.PAGE_FILE).read_text() == (calibrated.PAGE / warm_starts.PAGE_FILE).read_text()


def test_each_warm_starts_collapse_gamma_is_found_again_by_the_search_on_its_recorded_step_logs():
    """The search of ``arms._calibrated_study`` redone on every warm start: the same calls in the same order, and the
    gamma the page's arms ran at 1/4 and 1/2 of; each call was made on the search seed, not an arm's."""
    params = load_params(ROOT / "params" / "study_calibrated.yaml")
    for build in published()["warm_starts"]:
        tried, gamma, found = calibrated.rebuilt_search(
            build, params.study_collapse_gammas, params.perception_loss_weight, params.study_search_steps
        )
        assert tried == [call["gamma"] for call in build["search"]], build["build"]
        assert (gamma, found) == (build["collapse_gamma"], build["collapse_found"]), build["build"]
        assert {call["seed"] for call in build["search"]} == {params.study_search_seed}
        for arm, fraction in (("papo_g_quarter", 0.25), ("papo_g_half", 0.5), ("papo_g_x1_entropy0.05", 1.0)):
            assert {r["gamma"] for r in build["runs"] if r["arm"] == arm} == {float(f"{fraction * gamma:.4g}")}


def test_the_page_pools_six_warm_starts_build_0_the_shipped_one_every_arm_on_five_seeds():
    data = published()
    assert data["params"] == "params/study_calibrated.yaml"
    builds = [b["build"] for b in data["warm_starts"]]
    assert sorted(builds) == [0, 1, 2, 3, 4, 5]
    shipped = testbed_policy.read_card(testbed_policy.pinned_testbed("shapes_shortcut"))["weights_sha256"]
    assert [b["weights_sha256"] == shipped for b in data["warm_starts"]] == [b == 0 for b in builds]
    arms = ("grpo", *calibrated.PLAIN, *calibrated.CONTROLS, *calibrated.remedy_arms(data))
    assert len(calibrated.remedy_arms(data)) == 6
    for build in data["warm_starts"]:
        for arm in arms:
            seeds = sorted(r["seed"] for r in build["runs"] if r["arm"] == arm)
            assert seeds == [0, 1, 2, 3, 4], (build["build"], arm)


def test_its_grpo_runs_and_warm_start_scores_are_the_one_gamma_pages_run_for_run():
    """Both designs train GRPO on the same builds, seeds, data and float path: every GRPO run and each warm start's
    scores before RL agree exactly, so the two pages' PAPO-G arms are paired with one another through them."""
    one_gamma = json.loads((calibrated.ONE_GAMMA_PAGE / warm_starts.RUNS_FILE).read_text())["warm_starts"]
    for ours, theirs in zip(published()["warm_starts"], one_gamma, strict=True):
        assert (ours["build"], ours["weights_sha256"]) == (theirs["build"], theirs["weights_sha256"])
        assert ours["start_scores"] == theirs["start_scores"]
        grpo = [{r["seed"]: r["scores"] for r in build["runs"] if r["arm"] == "grpo"} for build in (ours, theirs)]
        assert grpo[0] == grpo[1] and len(grpo[0]) == 5, ours["build"]
