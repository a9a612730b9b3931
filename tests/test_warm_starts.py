"""The study's contrasts over more than one warm start (issue 41, item 3): the per-warm-start and pooled arithmetic
on a toy whose answer is known, and the published page rendered from its own runs, its warm start 0 the controls
page's runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import warm_starts_page

from papo_nb.testbed import policy as testbed_policy
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.study import warm_starts
from papo_nb.workbook.study.drift import PRIMARY

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "study" / "shortcut_warm_starts"
CONTROLS_PAGE = ROOT / "docs" / "study" / "shortcut_controls_lora"
FULL_PAGE = ROOT / "docs" / "study" / "shortcut_controls_full"


def toy_build(build: int, start: float, by_arm: dict[str, list[float]], collapsed=()) -> dict:
    """A warm start whose every metric is the given score: ``by_arm`` lists each arm's score by seed."""
    runs = [
        {"arm": arm, "seed": seed, "gamma": 1.0, "scores": dict.fromkeys(warm_starts.METRICS, value),
         "collapsed": (arm, seed) in collapsed}
        for arm, values in by_arm.items()
        for seed, value in enumerate(values)
    ]  # fmt: skip
    start_scores = dict.fromkeys(warm_starts.METRICS, start)
    return {
        "build": build,
        "weights_sha256": f"{build}" * 64,
        "sft_steps": 1,
        "start_scores": start_scores,
        "runs": runs,
    }


TOY = {"params": "params/study_controls.yaml", "warm_starts": [
    toy_build(0, 0.5, {"grpo": [0.4, 0.4, 0.3], "papo_g_half": [0.5, 0.5, 0.5]}),  # drift -0.133, PAPO-G +0.133
    toy_build(1, 0.6, {"grpo": [0.6, 0.5, 0.7], "papo_g_half": [0.5, 0.5, 0.7]}, collapsed={("papo_g_half", 0)}),
]}  # fmt: skip


def test_each_warm_start_and_the_pool_pair_by_seed_within_a_warm_start():
    first, second, pooled = warm_starts.contrast_rows(TOY, "papo_g_half", "grpo", PRIMARY)
    assert first["diff"] == pytest.approx(0.4 / 3) and second["diff"] == pytest.approx(-0.1 / 3)
    assert (first["collapsed"], second["collapsed"], pooled["collapsed"]) == (0, 1, 1)
    assert pooled["pairs"] == 6 and pooled["diff"] == pytest.approx(0.1 / 2)
    assert pooled["positive_warm_starts"] == "1 of 2" and math.isfinite(pooled["between_p"])
    drifts = warm_starts.drift_rows(TOY, PRIMARY)
    assert [d["drift"] for d in drifts] == pytest.approx([-0.4 / 3, 0.0, -0.4 / 6])


def test_the_verdict_calls_the_gain_perception_specific_only_when_it_beats_every_control_and_the_mask_place_matters():
    base = [0.40, 0.42, 0.38, 0.41, 0.39]
    above = [0.05, 0.06, 0.04, 0.05, 0.07]  # a detected margin, with spread

    def build(b: int, place: float) -> dict:
        by_arm = dict.fromkeys(warm_starts.ARMS, base)
        by_arm["papo_g_half"] = [x + d for x, d in zip(base, above)]
        by_arm["mean_fill_papo_g_kl_matched"] = [x + d * place for x, d in zip(base, above)]
        return toy_build(b, 0.5, by_arm)

    specific = warm_starts.two_sentence_verdict({"params": "p.yaml", "warm_starts": [build(0, 1.0), build(1, 1.0)]})
    assert "Perception-specific: shown" in specific and "negative on 2 of 2" in specific
    same_place = warm_starts.two_sentence_verdict({"params": "p.yaml", "warm_starts": [build(0, 0.0), build(1, 0.0)]})
    assert "Perception-specific: not shown" in same_place
    assert "Perception-specific: not shown" in warm_starts.two_sentence_verdict(TOY)


def test_a_seed_one_arm_did_not_finish_and_a_missing_arm_are_left_out_of_the_pairs():
    data = {
        "params": "p.yaml",
        "warm_starts": [toy_build(0, 0.5, {"grpo": [0.4, 0.4, 0.3], "papo_g_half": [0.5, 0.5]})],
    }
    row, pooled = warm_starts.contrast_rows(data, "papo_g_half", "grpo", PRIMARY)
    assert row["pairs"] == 2 and row["diff"] == pytest.approx(0.1)
    no_control = warm_starts.contrast_rows(data, "papo_g_half", "grpo_beta", PRIMARY)[-1]
    assert no_control["pairs"] == 0 and math.isnan(no_control["diff"])
    assert "| 0 | `000000000000` | 1 | 1 | not run |" in warm_starts_page.render(data)


@pytest.mark.parametrize("page", [PAGE, FULL_PAGE], ids=lambda p: p.name)
def test_a_published_page_is_rendered_from_its_runs_each_warm_start_with_its_weights(page):
    data = json.loads((page / warm_starts.RUNS_FILE).read_text())
    assert (page / warm_starts.PAGE_FILE).read_text() == warm_starts_page.render(data)
    builds = [b["build"] for b in data["warm_starts"]]
    assert len(builds) == len(set(builds)) and len({b["weights_sha256"] for b in data["warm_starts"]}) == len(builds)
    shipped = testbed_policy.read_card(testbed_policy.pinned_testbed("shapes_shortcut"))["weights_sha256"]
    assert [b["weights_sha256"] == shipped for b in data["warm_starts"]] == [b == 0 for b in builds], "build 0 shipped"
    for build in data["warm_starts"]:
        arms = {r["arm"] for r in build["runs"]}
        assert set(warm_starts.ARMS) <= arms, (build["build"], set(warm_starts.ARMS) - arms)
        assert all(len([r for r in build["runs"] if r["arm"] == arm]) == 5 for arm in warm_starts.ARMS)


def test_the_warm_starts_page_pools_at_least_three_and_its_warm_start_0_is_the_controls_pages():
    data = json.loads((PAGE / warm_starts.RUNS_FILE).read_text())
    assert len(data["warm_starts"]) >= 3 and data["params"] == "params/study_controls.yaml"
    assert data["warm_starts"][0] == warm_starts.collect([], CONTROLS_PAGE)["warm_starts"][0]
    full = json.loads((FULL_PAGE / warm_starts.RUNS_FILE).read_text())
    assert (
        full["params"] == "params/study_controls_full.yaml" and load_params(ROOT / full["params"]).finetuning == "full"
    )
