"""PAPO-G against the black-fill background placebo on the grey testbed (issue 56, item 3): the verdict's three
outcomes on toys whose answer is known, and the published page rendered from its own data file, its headline numbers
recomputed from the runs by hand."""

from __future__ import annotations

import json
import random
from pathlib import Path
from statistics import mean

import background_placebo_page as background_placebo
import pytest

from papo_nb.testbed import policy as testbed_policy
from papo_nb.workbook.study import warm_starts
from papo_nb.workbook.study.drift import PRIMARY

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "study" / "shortcut_grey_placebo"
PLACEBO = "placebo_black_kl_matched"


def toy(shift: float, spread: float, builds: int = 3, seeds: int = 5) -> dict:
    """Every arm at one score per seed, PAPO-G ``shift`` above the KL-matched placebo with noise of ``spread``."""
    rng = random.Random(0)
    warm = []
    for build in range(builds):
        base = [0.4 + 0.02 * rng.random() for _ in range(seeds)]
        by_arm = dict.fromkeys(background_placebo.ARMS, base)
        by_arm["papo_g_half"] = [b + shift + spread * (rng.random() - 0.5) for b in base]
        runs = [
            {"arm": arm, "seed": s, "gamma": 1.0, "collapsed": False,
             "scores": dict.fromkeys(warm_starts.METRICS, value)}
            for arm, values in by_arm.items() for s, value in enumerate(values)
        ]  # fmt: skip
        warm.append({"build": build, "weights_sha256": f"{build}" * 64, "sft_steps": 1, "runs": runs,
                     "start_scores": dict.fromkeys(warm_starts.METRICS, 0.45)})  # fmt: skip
    return {"params": "params/study_background_placebo.yaml", "warm_starts": warm}


def test_the_verdict_tells_a_place_effect_from_equivalence_from_neither():
    assert ": a gain the paired test detects;" in background_placebo.verdict(toy(0.05, 0.01))
    assert ": equivalent within +-0.02;" in background_placebo.verdict(toy(0.0, 0.004))
    assert "inconclusive at this power" in background_placebo.verdict(toy(0.0, 0.2, builds=1, seeds=3))
    collapsed = toy(0.05, 0.01)
    for build in collapsed["warm_starts"]:
        for run in build["runs"]:
            run["collapsed"] = run["arm"] == PLACEBO
            run["gamma"] = 8.0 if run["arm"] == PLACEBO else 1.0
    said = background_placebo.verdict(collapsed)
    assert "(8 to 8 times PAPO-G's)" in said and "15 of 15 placebo runs collapsed, so there it weighs" in said
    page = background_placebo.render(toy(0.05, 0.01))
    assert "| papo_g_half - placebo_black_kl_matched | warm start 2 |" in page and "## avg_at_k/gap/vision" in page


def test_the_published_page_is_rendered_from_its_data_file_alone():
    data = json.loads((PAGE / background_placebo.RUNS_FILE).read_text())
    assert (PAGE / warm_starts.PAGE_FILE).read_text() == background_placebo.render(data)
    assert not (PAGE / warm_starts.RUNS_FILE).exists(), "runs.json is a notebook 04 page's name to publish"


def test_the_page_runs_at_least_three_warm_starts_of_the_grey_testbed_five_seeds_an_arm():
    data = json.loads((PAGE / background_placebo.RUNS_FILE).read_text())
    assert data["params"] == "params/study_background_placebo.yaml"
    builds = [b["build"] for b in data["warm_starts"]]
    assert len(builds) >= 3 and builds == list(range(len(builds)))
    assert len({b["weights_sha256"] for b in data["warm_starts"]}) == len(builds)
    shipped = testbed_policy.read_card(testbed_policy.pinned_testbed("shapes_shortcut_grey"))["weights_sha256"]
    assert data["warm_starts"][0]["weights_sha256"] == shipped
    for build in data["warm_starts"]:
        for arm in background_placebo.ARMS:
            seeds = sorted(r["seed"] for r in build["runs"] if r["arm"] == arm)
            assert seeds == [0, 1, 2, 3, 4], (build["build"], arm)
        papo = {r["gamma"] for r in build["runs"] if r["arm"] == "papo_g_half"}
        assert {r["gamma"] for r in build["runs"] if r["arm"] == "placebo_black"} == papo  # at PAPO-G's gamma


@pytest.mark.parametrize("control", [PLACEBO, "grpo"])
def test_the_headline_differences_are_the_runs_paired_by_hand(control):
    """The pooled difference the page states, recomputed from the data file's runs without the page's code: the mean
    over every (warm start, seed) of PAPO-G's prior-breaking avg@4 minus the control's."""
    data = json.loads((PAGE / background_placebo.RUNS_FILE).read_text())
    diffs = []
    for build in data["warm_starts"]:
        score = {(r["arm"], r["seed"]): r["scores"][PRIMARY] for r in build["runs"]}
        diffs += [score["papo_g_half", s] - score[control, s] for s in range(5)]
    page = (PAGE / warm_starts.PAGE_FILE).read_text()
    row = f"| papo_g_half - {control} | pooled | {mean(diffs):+.3f} +/- "
    assert len(diffs) == 5 * len(data["warm_starts"]) and row in page.split(f"## {PRIMARY}\n")[1], row
    verdict = page.split("## Verdict\n\n")[1].split("\n")[0]
    assert f"{mean(diffs):+.3f}" in verdict


def test_the_grpo_drift_is_its_end_minus_the_warm_starts_score_by_hand():
    data = json.loads((PAGE / background_placebo.RUNS_FILE).read_text())
    drifts = [
        r["scores"][PRIMARY] - build["start_scores"][PRIMARY]
        for build in data["warm_starts"] for r in build["runs"] if r["arm"] == "grpo"
    ]  # fmt: skip
    page = (PAGE / warm_starts.PAGE_FILE).read_text()
    assert len(drifts) == 5 * len(data["warm_starts"]) and f"| pooled |  |  | {mean(drifts):+.3f} +/- " in page
    assert f"GRPO's drift from the warm start is {mean(drifts):+.3f}" in page


@pytest.mark.model
@pytest.mark.slow
def test_a_warm_start_trains_its_study_then_the_black_placebo_at_papo_gs_and_the_kl_matched_gamma(tmp_path):
    """``train_warm_start`` end to end on the shipped grey build, at a size that tests the wiring, not the method:
    the placebo at PAPO-G's gamma, then at that gamma scaled by the two arms' first logged perception KLs, every run
    paired on the study's seed, the record naming the shipped weights, and a page written and re-rendered from it."""
    from warm_start_runs import train_warm_start

    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study.placebo import KL_MATCH_STEPS

    params_file = "params/study_background_placebo.yaml"
    params = load_params(ROOT / params_file).model_copy(
        update={
            "max_steps": 2, "n_train_prompts": 8, "n_eval_prompts": 12, "per_device_train_batch_size": 8,
            "study_seeds": [0], "study_collapse_gammas": [20.0], "study_search_steps": 1, "study_eval_samples": 2,
        }
    )  # fmt: skip
    folder = testbed_policy.pinned_testbed("shapes_shortcut_grey")
    placebos = ("placebo_black", PLACEBO)
    record = train_warm_start(params, params_file, 0, folder, tmp_path, "papo_g_half", placebos, "wiring")
    assert json.loads((tmp_path / "results.json").read_text()) == record
    assert record["card"]["weights_sha256"] == testbed_policy.read_card(folder)["weights_sha256"]
    runs = {r["arm"]: r for r in record["runs"] if r["arm"] != "papo_g_collapse"}
    assert sorted(runs) == ["grpo", "papo_g_half", "placebo_black", PLACEBO] and runs["grpo"]["gamma"] == 0.0
    assert runs["placebo_black"]["gamma"] == runs["papo_g_half"]["gamma"] == 0.5 * record["collapse_gamma"]

    def first_kl(arm: str) -> float:
        return mean(row["perception_kl"] for row in runs[arm]["step_logs"][:KL_MATCH_STEPS] if "perception_kl" in row)

    matched = runs["papo_g_half"]["gamma"] * first_kl("papo_g_half") / first_kl("placebo_black")
    assert runs[PLACEBO]["gamma"] == record["kl_matched_gamma"] == round(matched, 3)
    page = background_placebo.write_page(tmp_path / "page", [tmp_path])
    data = json.loads((tmp_path / "page" / background_placebo.RUNS_FILE).read_text())
    assert page.read_text() == background_placebo.render(data) and len(data["warm_starts"][0]["runs"]) == 4
