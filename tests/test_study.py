"""The method study: the collapse detector, the statistics, the claims table, and the reduced study run end to end
through papermill with its evidence read back from MLflow."""

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest
from mlflow import MlflowClient
from scipy import stats

from papo_nb.testbed.policy import read_card
from papo_nb.workbook.config import evidence_names as evidence
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY
from papo_nb.workbook.study import arms
from papo_nb.workbook.study.arms import ARM_COLOURS
from papo_nb.workbook.study.claims import claims_table
from papo_nb.workbook.study.collapse import CollapseRule, detect_collapse, heldout_verdict
from papo_nb.workbook.study.errors import CLEAN, DECOY, OTHER, PRIOR, PRIOR_IS_DECOY, SHARE, error_split
from papo_nb.workbook.study.search import fraction_arm, search_collapse_gamma
from papo_nb.workbook.study.stats import at_chance, equivalence_test, mean_ci, paired_test, summary_rows
from papo_nb.workbook.study.tables import comparison_table, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def logs(n=30, *, kl=lambda s: 0.2, entropy=lambda s: 0.1, masked=lambda s: 0.3, clip=lambda s: 0.0, acc=None):
    acc = acc or (lambda s: 0.6)
    return [
        {
            "step": s,
            "perception_kl": kl(s),
            "entropy": entropy(s),
            "masked_entropy": masked(s),
            "clip_ratio/high_mean": clip(s),
            "rewards/accuracy_reward/mean": acc(s),
        }
        for s in range(1, n + 1)
    ]


# ---- collapse detector ----


def test_a_healthy_run_is_not_flagged():
    noisy = logs(kl=lambda s: 0.2 + 0.1 * (s % 3), acc=lambda s: 0.5 + 0.1 * (s % 2))
    verdict = detect_collapse(noisy)
    assert not verdict["collapsed"] and verdict["step"] is None and verdict["mode"] is None


def test_kl_prcp_hacking_fires_at_the_step_the_paper_symptoms_join():
    # perception loss -0.05 -> -1.2 and both entropies rising from step 15: the paper's picture
    hacked = logs(
        kl=lambda s: 0.05 if s < 15 else 1.2,
        entropy=lambda s: 0.1 if s < 15 else 0.6,
        masked=lambda s: 0.3 if s < 15 else 1.0,
    )
    verdict = detect_collapse(hacked, CollapseRule(window=3))
    assert verdict["collapsed"] and verdict["mode"] == "KL_prcp hacking (paper)"
    # window 3: at step 15 the KL's mean (0.05 + 0.05 + 1.2) / 3 = 0.43 is 8.7x its baseline and the entropy's
    # (0.1 + 0.1 + 0.6) / 3 = 0.27 is 2.7x and 0.17 nats above its own: a several-fold rise with a rising entropy
    assert verdict["step"] == 15
    assert {"perception_kl_rise", "entropy_rise"} <= set(verdict["symptoms"])  # the masked one joins at 16


def test_kl_hacking_below_the_one_nat_floor_is_still_the_papers_pattern():
    """shapes_prior's collapses: the KL rose about 8x to well under 1 nat, both entropies rising."""
    hacked = logs(kl=lambda s: 0.05 if s < 12 else 0.4, masked=lambda s: 0.3 if s < 12 else 0.9)
    verdict = detect_collapse(hacked)
    assert verdict["collapsed"] and verdict["mode"] == "KL_prcp hacking (paper)"
    assert "perception_kl_blowup" not in verdict["symptoms"]
    # the same rise with flat entropies and reward is no collapse
    assert not detect_collapse(logs(kl=lambda s: 0.05 if s < 12 else 0.4))["collapsed"]


def test_held_out_evidence_flags_what_the_step_logs_miss_and_names_broken_output():
    quiet = detect_collapse(logs())
    grpo = {"avg_at_k/original/all": 0.54}
    far_below = heldout_verdict(quiet, {"avg_at_k/original/all": 0.334}, grpo, CollapseRule())
    assert far_below["collapsed"] and far_below["detected_by"] == ["held-out"]
    assert far_below["mode"] == "held-out accuracy far below GRPO's"
    near = heldout_verdict(quiet, {"avg_at_k/original/all": 0.45}, grpo, CollapseRule())
    assert not near["collapsed"] and near["detected_by"] == []
    broken = heldout_verdict(quiet, {"avg_at_k/original/all": 0.0}, grpo, CollapseRule())
    assert broken["collapsed"] and "broken output" in broken["mode"] and "chance" not in broken["mode"]
    never_answered = heldout_verdict(quiet, {"avg_at_k/original/all": 0.0}, None, CollapseRule())  # GRPO at 0
    assert not never_answered["collapsed"] and never_answered["mode"] == "broken output (held-out accuracy 0)"


def test_one_symptom_alone_does_not_fire():
    assert not detect_collapse(logs(kl=lambda s: 0.05 if s < 10 else 2.0))["collapsed"]  # KL up, nothing else
    assert not detect_collapse(logs(acc=lambda s: 0.6 if s < 10 else 0.2))["collapsed"]  # reward down alone


def test_an_image_blind_collapse_is_flagged_as_not_the_papers():
    blind = logs(kl=lambda s: 0.3 if s < 12 else 0.0, acc=lambda s: 0.7 if s < 12 else 0.15)
    verdict = detect_collapse(blind)
    assert verdict["collapsed"] and verdict["mode"] == "image-blind collapse (not the paper's)"
    assert set(verdict["symptoms"]) == {"perception_kl_vanished", "reward_drop"}
    assert 12 < verdict["step"] <= 12 + CollapseRule().window


def test_a_zero_kl_baseline_is_neither_a_rise_nor_a_vanishing():
    """Issue 41 item 9: a KL logged as 0 from the start (a skipped masked branch) has no ratio to rise or fall by,
    so a GRPO-like run whose entropy rises reads as no collapse, not as KL hacking; a KL that does blow up past the
    floor still counts."""
    rising_entropy = logs(kl=lambda s: 0.0, entropy=lambda s: 0.1 if s < 12 else 0.6)
    verdict = detect_collapse(rising_entropy)
    assert not verdict["collapsed"] and verdict["mode"] is None
    assert (
        verdict["first_seen"]["perception_kl_rise"] is None and verdict["first_seen"]["perception_kl_vanished"] is None
    )
    assert verdict["first_seen"]["entropy_rise"] is not None  # the entropy did rise: only the KL's ratios are off
    blowup = detect_collapse(logs(kl=lambda s: 0.0 if s < 12 else 2.0, acc=lambda s: 0.6 if s < 12 else 0.2))
    assert blowup["collapsed"] and "perception_kl_blowup" in blowup["symptoms"]
    assert "perception_kl_rise" not in blowup["symptoms"]


def test_sparse_reward_logs_still_work():
    """With two optimizer steps per rollout batch TRL logs the reward on every other step only."""
    sparse = [
        {k: v for k, v in row.items() if k != "rewards/accuracy_reward/mean" or row["step"] % 2}
        for row in logs(kl=lambda s: 0.3 if s < 12 else 0.0, acc=lambda s: 0.7 if s < 12 else 0.15)
    ]
    assert detect_collapse(sparse)["collapsed"]


def test_a_study_run_that_logs_a_zero_kl_while_measuring_fails():
    """Issue 41 item 6: with ``measure_perception_kl`` on (or gamma > 0) a run whose logged perception KL is 0 at
    every step did not run its masked branch, and the study stops there instead of reporting the zeros."""
    from types import SimpleNamespace

    from papo_nb.workbook.study.arms import perception_kl_measured, require_measured_kl

    zeros, measured = logs(kl=lambda s: 0.0), logs(kl=lambda s: 0.01 * s)
    assert not perception_kl_measured(zeros) and perception_kl_measured(measured)
    # a confident policy's KL rounds to 0 in fp32 while its masked entropy still moves: the branch ran
    rounded = [{"perception_kl": 0.0, "masked_entropy": 0.05006, "original_entropy": 0.05008}]
    assert perception_kl_measured(rounded)
    assert not perception_kl_measured([{"perception_kl": 0.0, "masked_entropy": 0.05, "original_entropy": 0.05}])
    on, off = SimpleNamespace(measure_perception_kl=True), SimpleNamespace(measure_perception_kl=False)
    with pytest.raises(RuntimeError, match="grpo .*seed 3.*measure_perception_kl=True.*0 at all 30 steps"):
        require_measured_kl(on, "grpo", 3, 0.0, zeros)
    with pytest.raises(RuntimeError, match="papo_g .*gamma 0.02"):
        require_measured_kl(off, "papo_g", 0, 0.02, zeros)
    require_measured_kl(on, "grpo", 3, 0.0, measured)
    require_measured_kl(off, "grpo", 3, 0.0, zeros)  # not asked to measure: GRPO's skipped branch is right


# ---- statistics ----


def test_mean_ci_is_the_student_t_interval():
    centre, half = mean_ci([1.0, 2.0, 3.0])
    assert centre == 2.0 and half == pytest.approx(stats.t.ppf(0.975, 2) * 1.0 / math.sqrt(3))
    assert math.isnan(mean_ci([0.5])[1]) and math.isnan(mean_ci([])[0])


def test_paired_test_matches_a_hand_computed_t_test():
    result = paired_test([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # differences 1, 2, 3: t = 2 / (1 / sqrt 3)
    assert result["diff"] == 2.0 and result["pairs"] == 3
    assert result["p_value"] == pytest.approx(2 * stats.t.sf(2 * math.sqrt(3), 2))
    assert math.isnan(paired_test([1.0], [0.0])["p_value"])
    with pytest.raises(ValueError, match="equal lengths"):
        paired_test([1.0, 2.0], [1.0])


def fake_results(gain):
    base = {"avg_at_k/original/all": 0.5, "avg_at_k/original/vision": 0.4, "avg_at_k/original/text": 0.7}
    base["avg_at_k/gap/vision"] = 0.1
    base[PRIOR], base[DECOY] = 0.3, 0.1  # a gain of reading is a fall of the prior's errors (the error split)
    noise = {0: 0.0, 1: 0.01, 2: -0.01}
    spread = {0: 1.0, 1: 1.2, 2: 0.8}  # the paired gain varies a little across seeds, as real gains do
    effect = {PRIOR: -1.0, DECOY: 0.0, **{k: 2.0 if "vision" in k else 1.0 for k in base if "error" not in k}}
    return {
        "grpo": {s: {k: v + n for k, v in base.items()} for s, n in noise.items()},
        "papo_g": {s: {k: v + n + spread[s] * gain * effect[k] for k, v in base.items()} for s, n in noise.items()},
        "papo_g_collapse": {s: {k: v - 0.2 for k, v in base.items()} for s in noise},
    }


CHANCE = {"chance": 0.25, "vision_items": 128}  # the testbed's four colours, its reduced study's held-out set


def test_equivalence_is_two_one_sided_tests_at_the_margin():
    control = [0.50, 0.52, 0.48, 0.51, 0.49]
    close = [c + d for c, d in zip(control, (0.004, -0.003, 0.002, 0.0, -0.001))]
    result = equivalence_test(close, control, margin=0.02)
    diffs = [a - b for a, b in zip(close, control)]
    error = stats.tstd(diffs) / math.sqrt(len(diffs))
    lower = stats.t.sf((statistics.mean(diffs) + 0.02) / error, len(diffs) - 1)
    upper = stats.t.cdf((statistics.mean(diffs) - 0.02) / error, len(diffs) - 1)
    assert result["p_value"] == pytest.approx(max(lower, upper)) and result["equivalent"]
    shifted = [c + 0.05 for c in close]  # 5 points off: far outside a 2-point margin
    assert not equivalence_test(shifted, control, margin=0.02)["equivalent"]
    with pytest.raises(ValueError, match="margin"):
        equivalence_test(close, control, margin=0)


def test_the_collapse_search_climbs_then_bisects_below_the_first_collapse():
    tried = []

    def collapses_from(threshold):
        def train(gamma):
            tried.append(gamma)
            return {"collapsed": gamma >= threshold}

        return train

    gammas, gamma, found = search_collapse_gamma(collapses_from(2.0), [0.2, 1.0, 5.0, 20.0], healthy=0.02, steps=2)
    # 0.2 and 1 healthy, 5 collapses; sqrt(1 * 5) = 2.24 collapses, sqrt(1 * 2.24) = 1.5 does not
    assert gammas == tried == [0.2, 1.0, 5.0, 2.24, 1.5] and gamma == 2.24 and found
    tried.clear()
    assert search_collapse_gamma(collapses_from(99.0), [0.2, 1.0], healthy=0.02, steps=2) == ([0.2, 1.0], 1.0, False)
    assert fraction_arm(0.5) == "papo_g_half" and fraction_arm(0.3) == "papo_g_x0.3"


def test_prior_breaking_errors_split_into_the_prior_the_decoy_and_other():
    """Issue 41 item 2: where the decoy is not the number's colour, an error is the prior (a colour not shown), the
    decoy (a colour shown) or other; where it is, an answer with that colour is counted apart."""
    golds = ["red", "green", "blue", "yellow", "red", "green", "blue"]
    priors = ["blue", "red", "green", "red", "green", "blue", "red"]
    decoys = ["yellow", "yellow", "red", "blue", "green", "blue", "red"]  # the last three: decoy is the prior
    answers = ["red", "red", "red", "green", "green", "blue", None]
    # clean: right; the prior; the decoy; another colour. Tied: the named colour twice, then no answer
    split = error_split(answers, golds, priors, decoys)
    assert split[CLEAN] == 4 and split[PRIOR] == split[DECOY] == split[OTHER] == pytest.approx(1 / 4)
    assert split[SHARE] == pytest.approx(1 / 3) and split[PRIOR_IS_DECOY] == pytest.approx(2 / 3)
    assert math.isnan(error_split(golds, golds, priors, decoys)[SHARE])
    with pytest.raises(ValueError, match="prior-breaking items only"):
        error_split(["red"], ["red"], ["red"], ["blue"])


def test_the_decoy_is_read_from_the_pixels_as_the_colour_beside_the_answer():
    import random

    from papo_nb.testbed import perception
    from papo_nb.workbook.study.errors import decoy_colour

    rng = random.Random(3)
    for _ in range(40):
        item = perception.make_item(rng, "vision", prior_rate=0.0, decoy_share=(0.1, 0.7), prior_decoy=False)
        shown = {c for _, c in item["image"].getcolors()} - {(0, 0, 0), perception.COLOURS[item["answer"]]}
        assert [perception.COLOURS[decoy_colour(item["image"], item["answer"])]] == list(shown)


def test_summary_rows_pair_each_arm_with_grpo():
    rows = summary_rows(fake_results(0.05), ["avg_at_k/original/all"], control="grpo")
    papo = next(r for r in rows if r["arm"] == "papo_g")
    assert papo["diff_vs_grpo"] == pytest.approx(0.05) and papo["seeds"] == 3
    assert "diff_vs_grpo" not in next(r for r in rows if r["arm"] == "grpo")
    table = comparison_table(rows, control="grpo")
    assert table[0]["papo_g - grpo"] == "0.050 ± 0.025 (p=0.013)"  # diffs 0.05, 0.06, 0.04
    assert markdown_table(table).splitlines()[0].startswith("| metric | grpo | papo_g | papo_g - grpo |")


def test_claims_table_says_plainly_what_holds():
    collapse = {
        "grpo": {s: {"collapsed": False} for s in range(3)},
        "papo_g": {s: {"collapsed": False} for s in range(3)},
        "papo_g_collapse": {s: {"collapsed": True} for s in range(3)},
    }
    arms = {"control": "grpo", "treatment": "papo_g", "collapse": "papo_g_collapse"}
    better = {r["claim"]: r["verdict"] for r in claims_table(fake_results(0.05), collapse, arms, **CHANCE)}
    assert better == {  # paired diffs 0.05, 0.06, 0.04 (vision twice that)
        "overall": "detected higher (+0.050, p = 0.0131)",
        "vision": "detected higher (+0.100, p = 0.0131)",
        "perception_errors": "detected lower (-0.050, p = 0.0131)",
        "reliance": "detected higher (+0.100, p = 0.0131)",
        "collapse": "holds here",
    }
    collapse["papo_g_collapse"] = {s: {"collapsed": False} for s in range(3)}
    worse = {r["claim"]: r["verdict"] for r in claims_table(fake_results(-0.05), collapse, arms, **CHANCE)}
    assert worse["overall"] == "detected lower (-0.050, p = 0.0131)" and worse["collapse"] == "does not hold here"
    assert worse["vision"].endswith("; gain not larger on the vision split")
    # paired diffs +0.01, -0.008, +0.004 (sd 0.0092): not detected, and the MDE of 3 pairs is 3.264 sd
    noisy = fake_results(0.0)
    for seed, shift in {0: 0.01, 1: -0.008, 2: 0.004}.items():
        noisy["papo_g"][seed] = {k: v + shift for k, v in noisy["papo_g"][seed].items()}
    null = {r["claim"]: r["verdict"] for r in claims_table(noisy, collapse, arms, **CHANCE)}
    assert null["overall"] == "not detected (+0.002; MDE 0.030)"


def test_a_policy_at_chance_makes_every_claim_not_measurable_never_false():
    collapse = {arm: {s: {"collapsed": False} for s in range(3)} for arm in ("grpo", "papo_g", "papo_g_collapse")}
    arms = {"control": "grpo", "treatment": "papo_g", "collapse": "papo_g_collapse"}
    blind = fake_results(-0.05)
    for seed, scores in blind["grpo"].items():  # a control arm that answers nothing right, as the random tiny model
        blind["grpo"][seed] = dict.fromkeys(scores, 0.0)
    rows = claims_table(blind, collapse, arms, **CHANCE)
    assert {r["verdict"] for r in rows} == {"not measurable: policy at chance"}
    assert "grpo at chance (0.25) on vision-dependent items" in rows[0]["here"]
    assert "nan" not in " ".join(r["here"] for r in rows)  # grpo at 0: no relative change to state
    # the same arms one notch above chance: the ordinary verdicts come back
    assert (
        claims_table(fake_results(-0.05), collapse, arms, **CHANCE)[0]["verdict"]
        == "detected lower (-0.050, p = 0.0131)"
    )


def test_a_one_seed_study_says_it_tested_nothing_and_prints_no_nan():
    collapse = {arm: {0: {"collapsed": False}} for arm in ("grpo", "papo_g", "papo_g_collapse")}
    arms = {"control": "grpo", "treatment": "papo_g", "collapse": "papo_g_collapse"}
    one_seed = {arm: {0: by_seed[0]} for arm, by_seed in fake_results(0.05).items()}
    rows = {r["claim"]: r for r in claims_table(one_seed, collapse, arms, **CHANCE)}
    for claim in ("overall", "vision", "perception_errors", "reliance"):
        assert rows[claim]["verdict"] == "not tested: one seed (a paired test needs 2 or more)", rows[claim]
        assert "nan" not in rows[claim]["here"], rows[claim]
    assert "no p-value: one seed" in rows["overall"]["here"]


def test_at_chance_uses_the_seeds_interval_or_a_guessers_on_one_seed():
    assert at_chance([0.26, 0.24, 0.27], chance=0.25, items=128)  # the seeds' interval covers chance
    assert not at_chance([0.40, 0.41, 0.39], chance=0.25, items=128)
    # one seed: a guesser's 95% interval on 24 items is 0.25 +/- 0.173, on 600 items +/- 0.035
    assert at_chance([0.40], chance=0.25, items=24) and not at_chance([0.40], chance=0.25, items=600)
    assert at_chance([], chance=0.25, items=24)


def test_a_metric_without_items_prints_no_items_not_nan():
    rows = summary_rows({"grpo": {0: {}}, "papo_g": {0: {}}}, ["avg_at_k/original/text"], control="grpo")
    table = comparison_table(rows, control="grpo")
    assert table == [
        {"metric": "avg_at_k/original/text", "grpo": "no items", "papo_g": "no items", "papo_g - grpo": "no items"}
    ]
    single = {arm: {0: by_seed[0]} for arm, by_seed in fake_results(0.05).items()}
    line = comparison_table(summary_rows(single, ["avg_at_k/original/all"], control="grpo"), "grpo")[0]
    assert line["papo_g - grpo"] == "0.050 (p: needs 2+ seeds)" and line["grpo"] == "0.500"


# ---- the reduced study, end to end ----

# Held-out scores the reduced study recorded (params/study_reduced.yaml, seed 0) from the shipped testbed weights, the
# same on the native AVX-512 and the avx2 path. The weights are the same everywhere, but RL training's float path is
# not, so another machine may sample other answers: the tolerance is statistical, about two binomial standard
# deviations (vision avg@4: 16 items x 4 samples; text greedy: 8 items; the gap is the difference of two such scores).
RECORDED_EVAL = {
    "grpo": {
        "eval/avg_at_k/original/vision": 0.734375,
        "eval/greedy/masked/text": 1.0,
        "eval/avg_at_k/gap/vision": 0.25,
    },
    "papo_g": {
        "eval/avg_at_k/original/vision": 0.734375,
        "eval/greedy/masked/text": 1.0,
        "eval/avg_at_k/gap/vision": 0.25,
    },
    "papo_g_collapse": {  # the sweep's run at the chosen gamma (20), named as its arm
        "eval/avg_at_k/original/vision": 0.734375,
        "eval/greedy/masked/text": 1.0,
        "eval/avg_at_k/gap/vision": 0.265625,
    },
}
TOLERANCE = {
    "eval/avg_at_k/original/vision": 8 / 64,
    "eval/greedy/masked/text": 3 / 8,
    "eval/avg_at_k/gap/vision": 12 / 64,
}


@pytest.fixture(scope="module")
def reduced_study(tmp_path_factory, testbed_path):
    from papo_nb.infra.notebooks import run_workbook

    folder = tmp_path_factory.mktemp("study")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAPO_NB_CACHE", str(folder / "cache"))  # testbed:shapes is the shipped policy: nothing to build
        patch.chdir(folder)  # the page's relative folder is the caller's, not the notebook's
        result = run_workbook(
            [ROOT / "notebooks" / "04_method_study.ipynb"],
            ROOT / "params" / "study_reduced.yaml",
            ["study_report_dir=page"],
            run_root=folder / "runs",
            tracking_uri=f"sqlite:///{folder}/mlflow.db",
        )
    assert result.ok, result.failure_message
    return result


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.model
def test_reduced_study_logs_nested_runs_figures_and_tables(reduced_study, testbed_path):
    client = MlflowClient(reduced_study.tracking_uri)
    notebook_run = client.get_run(reduced_study.notebooks[0].run_id)
    children = client.search_runs(
        [notebook_run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{notebook_run.info.run_id}'"
    )
    arms = sorted(r.data.tags["papo_nb.study_arm"] for r in children)
    # the collapse arm's one seed is the sweep's run, not trained twice, and named as its arm
    assert arms == ["grpo", "papo_g", "papo_g_collapse"]
    for child in children:
        metrics, arm = child.data.metrics, child.data.tags["papo_nb.study_arm"]
        for key, recorded in RECORDED_EVAL[arm].items():
            assert metrics[key] == pytest.approx(recorded, abs=TOLERANCE[key] + 1e-9), (arm, key, metrics[key])
        assert child.info.run_name.startswith(f"{arm}-") and child.data.params["arm"] == arm
        assert child.data.tags["mlflow.runColor"] == ARM_COLOURS[arm]
        assert metrics[HELDOUT_ACCURACY] == metrics["eval/greedy/original/all"]  # one column with 03 and 05
        history = client.get_metric_history(child.info.run_id, "perception_kl")  # TRL's names, as 03 logs them
        assert len(history) == 4 and all(math.isfinite(m.value) for m in history)
        assert client.get_metric_history(child.info.run_id, "entropy")
        assert client.get_metric_history(child.info.run_id, "clip_ratio/high_mean")
        assert "completions.json" in {a.path for a in client.list_artifacts(child.info.run_id)}
        collapse = json.loads(Path(client.download_artifacts(child.info.run_id, evidence.ARM_COLLAPSE)).read_text())
        assert set(collapse) >= {"collapsed", "step", "mode", "symptoms"}
    gammas = {r.data.tags["papo_nb.study_arm"]: float(r.data.params["gamma"]) for r in children}
    assert {r.data.params["finetuning"] for r in children} == {"lora"}
    assert gammas == {"grpo": 0.0, "papo_g": 0.02, "papo_g_collapse": 20.0}
    assert notebook_run.data.metrics["study/collapse_gamma"] == 20.0
    # the card is exact on any machine: greedy answers of the shipped weights, logged as the notebook read them
    shipped = read_card(testbed_path)["greedy_accuracy"]["original/vision"]
    assert notebook_run.data.metrics["testbed/greedy_accuracy/original/vision"] == shipped
    artifacts = {
        a.path for folder in ("figures", "evidence") for a in client.list_artifacts(notebook_run.info.run_id, folder)
    }
    assert {"figures/study_curves.png", "figures/study_accuracy.png", "figures/study_dose_response.png"} <= artifacts
    assert {evidence.STUDY_TABLE, evidence.PAPER_CLAIMS, evidence.COLLAPSE_SWEEP} <= artifacts
    assert {evidence.DOSE_RESPONSE, evidence.DOSE_RESPONSE_MD, evidence.STUDY_POWER} <= artifacts
    assert evidence.DOSE_CONTRASTS in artifacts and "evidence/results.md" in artifacts
    dose = json.loads(Path(client.download_artifacts(notebook_run.info.run_id, evidence.DOSE_RESPONSE)).read_text())
    gamma_column = dose["columns"].index("gamma")
    assert [row[gamma_column] for row in dose["data"]] == [0.0, 0.02, 20.0]  # GRPO, the recipe's, the sweep
    claims = json.loads(Path(client.download_artifacts(notebook_run.info.run_id, evidence.PAPER_CLAIMS)).read_text())
    assert len(claims["data"]) == 5


@pytest.mark.slow
@pytest.mark.notebook
@pytest.mark.model
def test_reduced_study_writes_its_results_page(reduced_study, tmp_path):
    from publish_study import README_MARKERS, summary_markdown
    from publish_study import main as publish_main

    page_dir = Path(reduced_study.run_dir).parent.parent / "page"
    page = (page_dir / "results.md").read_text()
    sections = ("## Settings", "build card", "## Dose-response", "## Power", "## The paper's claims", "## Runtime")
    assert all(section in page for section in sections), page
    assert "| 0.02 | 1 |" in page and "| 20 | 1 |" in page  # a dose-response row per gamma, one seed each
    assert {p.name for p in page_dir.glob("*.png")} == {"dose_response.png", "accuracy.png", "curves.png"}
    card = json.loads((page_dir / "testbed_card.json").read_text())
    assert card["testbed"] == "shapes" and "build_seconds" not in card
    summary = json.loads((page_dir / "summary.json").read_text())
    assert summary["seeds"] == [0] and summary["finetuning"] == "lora" and summary["collapse_gamma"] == 20.0
    vision = summary["papo_g_vs_grpo"]["avg_at_k/original/vision"]
    assert vision["verdict"].startswith("not detected") and "MDE unknown" in vision["verdict"]  # one seed: no spread
    assert [row["gamma"] for row in json.loads((page_dir / "dose_response.json").read_text())] == [0.0, 0.02, 20.0]
    # publish's command redraws the figure from the page's table and writes the summary into README's block
    shutil.copytree(page_dir, tmp_path / "study" / "page")
    (tmp_path / "study" / "page" / "dose_response.png").unlink()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_MARKERS[0]}\nstale\n{README_MARKERS[1]}\nrest\n")
    publish_main(tmp_path / "study", [(readme, f"{(tmp_path / 'study').as_posix()}/")])
    assert (tmp_path / "study" / "page" / "dose_response.png").stat().st_size > 0
    row = summary_markdown(tmp_path / "study").splitlines()[2]
    assert row.startswith("| [page](page/results.md) | testbed:shapes | lora | [0] |"), row
    assert row.replace("(page/", f"({(tmp_path / 'study').as_posix()}/page/") in readme.read_text()
    assert "stale" not in readme.read_text() and readme.read_text().endswith("rest\n")


def test_claims_table_without_a_text_split_says_so():
    """The shapes task (the smoke run's) has only vision-dependent items."""
    results = {
        arm: {s: {k: v for k, v in by_seed[s].items() if "/text" not in k} for s in by_seed}
        for arm, by_seed in fake_results(0.05).items()
    }
    collapse = {arm: {s: {"collapsed": False} for s in range(3)} for arm in results}
    arms = {"control": "grpo", "treatment": "papo_g", "collapse": "papo_g_collapse"}
    vision = next(r for r in claims_table(results, collapse, arms, **CHANCE) if r["claim"] == "vision")
    assert "no text-only split" in vision["here"]
    assert vision["verdict"].startswith("not testable here: every held-out item is vision-dependent")
    assert vision["verdict"].endswith("(vision split alone: detected higher (+0.100, p = 0.0131))")


def test_claims_state_exact_p_values_and_what_cannot_be_tested():
    """Issue 41 item 8: beside the t-test, the exact sign and Wilcoxon p (3 pairs, all one sign: 2 / 2^3 = 0.25
    for both, the floor of 3 pairs); without a language prior the perception-error claim is not testable here."""
    collapse = {arm: {s: {"collapsed": False} for s in range(3)} for arm in ("grpo", "papo_g", "papo_g_collapse")}
    arms = {"control": "grpo", "treatment": "papo_g", "collapse": "papo_g_collapse"}
    rows = {r["claim"]: r for r in claims_table(fake_results(0.05), collapse, arms, **CHANCE)}
    assert "paired p = 0.0131; exact sign p = 0.25; Wilcoxon p = 0.25" in rows["overall"]["here"]
    assert "answered the number's colour against the image" in rows["perception_errors"]["here"]
    no_prior = {arm: {s: {k: v for k, v in r.items() if k != PRIOR} for s, r in by.items()}
                for arm, by in fake_results(0.05).items()}  # fmt: skip
    row = next(r for r in claims_table(no_prior, collapse, arms, **CHANCE) if r["claim"] == "perception_errors")
    assert row["verdict"].startswith("not testable here") and "1 - accuracy" not in row["here"]


def test_equal_differences_on_every_seed_say_so_rather_than_asking_for_seeds():
    same = {"grpo": {s: {"m": 0.5 + s / 10} for s in range(3)}, "papo_g": {s: {"m": 0.5 + s / 10} for s in range(3)}}
    line = comparison_table(summary_rows(same, ["m"], control="grpo"), "grpo")[0]
    assert line["papo_g - grpo"] == "0.000 ± 0.000 (p: none, every seed gave the same difference)"


@pytest.mark.model
@pytest.mark.slow
def test_the_calibrated_design_scores_step_0_searches_one_seed_and_pairs_every_arm(mlflow_store, tmp_path):
    """The calibrated design end to end on the prior testbed, at a size that tests the wiring, not the method: the
    warm start scored once, the search on the first seed, every arm (GRPO, the recipe's gamma, a fraction of the
    collapse gamma) at every seed, each verdict weighing the held-out evidence, and the page's sections."""
    import mlflow

    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study import publish
    from papo_nb.workbook.study.arms import run_study

    params = load_params(ROOT / "params" / "study_reduced.yaml").model_copy(
        update={
            "model_name_or_path": "testbed:shapes_prior", "dataset": "testbed:shapes_prior", "max_steps": 2,
            "n_train_prompts": 8, "n_eval_prompts": 12, "per_device_train_batch_size": 8, "study_seeds": [0, 1],
            "study_collapse_gammas": [20.0], "study_gamma_fractions": [0.5], "study_search_steps": 1,
            "study_eval_samples": 2, "measure_perception_kl": True, "study_control_learning_rates": [0.001],
        }
    )  # fmt: skip
    with mlflow.start_run():
        study = run_study(params, tmp_path / "runs", log=lambda line: None)
    assert "avg_at_k/original/vision" in study.start_scores and PRIOR in study.start_scores
    assert "avg_at_k/original/consistent" in study.start_scores  # the in-distribution split beside it
    assert [(r.arm, r.seed) for r in study.sweep] == [("search", 0)] and study.collapse_gamma == 20.0
    half = 0.5 * study.collapse_gamma
    assert sorted((r.arm, r.seed, r.gamma) for r in study.runs if r.arm != "papo_g_collapse") == [
        ("grpo", 0, 0.0), ("grpo", 1, 0.0), ("grpo_lr", 0, 0.0), ("grpo_lr", 1, 0.0), ("papo_g", 0, 0.02),
        ("papo_g", 1, 0.02), ("papo_g_half", 0, half), ("papo_g_half", 1, half),
    ]  # fmt: skip
    # the matched control: its ladder searched on the search seed against papo_g_half's end reward there
    (match,) = study.controls
    assert match.arm == "grpo_lr" and match.value == 0.001 and math.isfinite(match.target)
    assert all("detected_by" in r.collapse for r in [*study.sweep, *study.runs])
    grpo_logs = next(r for r in study.runs if r.arm == "grpo").step_logs
    assert any(row.get("perception_kl", 0) > 0 for row in grpo_logs)  # measured at gamma 0
    sections = "\n".join(publish.calibrated_sections(study))
    for heading in ("counteract GRPO's drift", "Drift:", "Collapse-gamma search", "Each arm against GRPO",
                    "The matched controls", "The error split"):  # fmt: skip
        assert heading in sections
    assert "papo_g_half" in sections and "nan" not in sections.split("Collapse-gamma")[0].split("Drift:")[1]
    publish.write_page_files(tmp_path / "page", study, {}, {})
    rows, verdict = publish.page_control_tables(tmp_path / "page")  # recomputed from the page's runs.json
    assert {row["against"] for row in rows} == {"grpo", "grpo_lr"} and f"**{verdict}**" in sections
    logs = json.loads((tmp_path / "page" / publish.STEP_LOGS).read_text())
    assert {(r["arm"], r["seed"]) for r in logs} >= {("grpo", 0), ("papo_g_half", 1), ("search", 0), ("grpo_lr", 1)}
    trained = {(r.arm, r.seed): r for r in [*study.sweep, *study.runs]}
    for record in logs:  # every step-log label can be recomputed from the page alone
        assert detect_collapse(record["steps"])["step"] == trained[record["arm"], record["seed"]].collapse["step"]


def test_drift_is_the_end_minus_the_warm_start_and_the_claim_says_which_arm_counteracts_it():
    from papo_nb.workbook.study.drift import PRIMARY, arm_verdicts, counteract_claim, drift_rows

    start = {PRIMARY: 0.50}
    grpo = {s: {PRIMARY: v, SHARE: 0.6} for s, v in enumerate((0.30, 0.32, 0.28))}
    half = {s: {PRIMARY: v, SHARE: 0.3} for s, v in enumerate((0.40, 0.41, 0.39))}
    same = {s: {PRIMARY: grpo[s][PRIMARY] + d, SHARE: 0.6} for s, d in enumerate((0.002, -0.001, 0.0))}
    results = {"grpo": grpo, "papo_g_half": half, "papo_g": same}
    rows = {row["arm"]: row for row in drift_rows(start, results, metrics=(PRIMARY,))}
    assert rows["grpo"]["drift"] == pytest.approx(-0.20) and rows["grpo"]["step_0"] == 0.50
    assert rows["grpo"]["drift"] + rows["grpo"]["drift_ci95"] < 0 and rows["grpo"]["p_value"] < 0.01
    verdicts = {r["arm"]: r for r in arm_verdicts(results, {"papo_g_half": 1.0, "papo_g": 0.02}, "grpo")}
    assert verdicts["papo_g_half"]["verdict"].startswith("better than GRPO (+0.100")
    assert verdicts["papo_g_half"]["prior_share"] == 0.3 and verdicts["papo_g_half"]["control_prior_share"] == 0.6
    assert verdicts["papo_g"]["verdict"].startswith("equivalent to GRPO within +-0.02")
    claim = counteract_claim(list(rows.values()), list(verdicts.values()), "grpo")
    assert (
        claim["verdict"] == "holds: papo_g_half (gamma 1) ends +0.100 above GRPO, making up 50% of GRPO's -0.200 drift"
    )
    # no drift, nothing to counteract: the claim is not tested, whatever the arms do
    flat = {row["arm"]: row for row in drift_rows({PRIMARY: 0.30}, results, metrics=(PRIMARY,))}
    assert counteract_claim(list(flat.values()), list(verdicts.values()), "grpo")["verdict"].startswith("not tested")


@pytest.mark.model
@pytest.mark.slow
def test_a_fresh_shortcut_warm_start_meets_its_card():
    """Issue 41: one warm start rebuilt fresh (shapes_shortcut, seed 0, this CPU's kernels) meets its goal and reads
    its images about as the shipped one does. Not bit for bit: BLAS dispatches on the real CPU whatever
    ``ATEN_CPU_CAPABILITY`` says, so even a ``default``-path build differs between machines (on an AVX2 EPYC: 1070
    steps, held-out 0.427, against the shipped 490 steps, 0.4375; issue 41's AVX2 build 0.401; docs/study.md's
    table: 0.40-0.44 for seed 0 across paths). ``.ci/run`` runs it once, not again on the second path."""
    import tempfile

    from papo_nb.testbed import policy as testbed_policy

    with tempfile.TemporaryDirectory() as cache:
        card = testbed_policy.read_card(testbed_policy.build_testbed("shapes_shortcut", seed=0, cache_dir=cache))
    shipped = testbed_policy.read_card(testbed_policy.pinned_testbed("shapes_shortcut"))
    stop = card["validation_checks"][-1]
    assert card["sft_stopped_by_validation"] and card["testbed"] == shipped["testbed"]
    assert card["vision_band"][0] <= stop["vision"] <= card["vision_band"][1]
    assert stop["blind_prior"] >= card["blind_prior_floor"]
    accuracy = card["greedy_accuracy"]
    assert accuracy["original/vision"] == pytest.approx(shipped["greedy_accuracy"]["original/vision"], abs=0.06)
    assert accuracy["original/vision"] > accuracy["masked_1.0/vision"]  # it reads the image


@pytest.mark.model
@pytest.mark.slow
def test_grpo_drifts_off_the_image_and_a_learning_rate_control_ends_above_it(mlflow_store, tmp_path):
    """The published drift, rechecked fresh on the shipped warm start: GRPO (seed 0, the study's settings) trained on
    this CPU's kernels falls 5 points or more on the prior-breaking items and names the number's colour, unseen,
    more often; the learning-rate control (the ladder's smallest step, the one the controls page kept) ends above
    it (statistical: training's float path differs between machines; seed 0 fell 8 points in issue 41's check)."""
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study.arms import eval_dataset, evaluate_policy
    from papo_nb.workbook.study.drift import PRIMARY
    from papo_nb.workbook.training.builder import load_policy, prepare_training

    params = load_params(ROOT / "params" / "study_shortcut.yaml").model_copy(
        update={"perception_loss_weight": 0.0, "n_eval_prompts": 128}
    )
    data = eval_dataset(params)

    def score(model, processor):
        return evaluate_policy(
            model, processor, data, samples=2, mask_ratio=params.mask_ratio, seed=params.seed, max_new_tokens=10
        )

    def trained(run_params, name):
        trainer, _, _ = prepare_training(
            run_params, tmp_path / name, save_strategy="no", require_gpu_contract_probe=False
        )
        trainer.train()
        return score(trainer.model, trainer.processing_class)

    start = score(*load_policy(params))
    grpo = trained(params, "grpo")
    assert grpo[PRIMARY] <= start[PRIMARY] - 0.05, (start[PRIMARY], grpo[PRIMARY])
    assert grpo[PRIOR] > start[PRIOR], (start[PRIOR], grpo[PRIOR])  # it names the unseen number's colour more
    smallest = min(load_params(ROOT / "params" / "study_controls.yaml").study_control_learning_rates)
    control = trained(params.model_copy(update={"learning_rate": smallest}), "grpo_lr")
    assert control[PRIMARY] > grpo[PRIMARY], (start[PRIMARY], grpo[PRIMARY], control[PRIMARY])


def test_the_held_out_set_adds_an_in_distribution_split_beside_the_prior_breaking_one():
    """Issue 41 item 7: on a language-prior testbed the study also scores prior-consistent items, apart, so each
    arm's cost where the prior is right is shown; ``all`` and ``vision`` stay the prior-breaking held-out set."""
    from papo_nb.testbed.perception import prior_answer
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.evaluation.eval_review import prompt_text
    from papo_nb.workbook.study.arms import eval_dataset, held_out_splits

    params = load_params(ROOT / "params" / "study_shortcut.yaml").model_copy(update={"n_eval_prompts": 24})
    data = eval_dataset(params)
    splits = held_out_splits(data)
    assert len(data) == 36 and splits["all"] == splits["vision"] == list(range(24)) and "text" not in splits
    assert splits["consistent"] == list(range(24, 36))
    named = [prior_answer(prompt_text(p)) for p in data["prompt"]]
    assert all(named[i] != data["answer"][i] for i in splits["vision"])
    assert all(named[i] == data["answer"][i] for i in splits["consistent"])


def test_a_control_is_matched_on_end_reward_and_the_verdict_names_the_closest():
    """Issue 41 item 1: each control's ladder is trained once and the value whose end-of-training accuracy reward
    lies closest to the strongest PAPO-G arm's is kept; the verdict calls the gain perception-specific only if that
    arm beats every control on both prior-breaking accuracy and the reliance gap."""
    from papo_nb.workbook.study.controls import comparison_rows, control_verdict, end_reward, match_control

    assert end_reward(logs(12, acc=lambda s: 0.5 if s <= 2 else 0.7)) == pytest.approx(0.7)
    assert math.isnan(end_reward([{"step": 1}]))
    rewards = {0.5: 0.66, 2.0: 0.61, 8.0: 0.52}
    match = match_control("grpo_beta", list(rewards), 0.58, rewards.__getitem__)
    assert match.value == 2.0 and match.margin == pytest.approx(0.03) and [r["kept"] for r in match.rows()] == [
        False, True, False,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="control arm='grpo_entropy' is unknown; allowed"):
        match_control("grpo_entropy", [1.0], 0.5, rewards.__getitem__)
    with pytest.raises(ValueError, match="ladder of learning_rate values is empty"):
        match_control("grpo_lr", [], 0.5, rewards.__getitem__)
    primary, gap = "avg_at_k/original/vision", "avg_at_k/gap/vision"

    def arm(level, spread=(0.0, 0.01, -0.01, 0.005, -0.004)):
        return {s: {primary: level + d, gap: level / 4 + d} for s, d in enumerate(spread)}

    results = {"grpo": arm(0.30), "grpo_beta": arm(0.40), "grpo_lr": arm(0.33), "papo_g_half": arm(0.45)}
    results["papo_g_half"] = {s: {k: v + 0.003 * s for k, v in r.items()} for s, r in results["papo_g_half"].items()}
    rows = comparison_rows(results, "papo_g_half", (primary, gap), paired_test)
    verdict = control_verdict(rows, "papo_g_half", primary, gap)
    assert verdict.startswith("papo_g_half keeps more prior-breaking accuracy and a larger reliance gap than every")
    assert "The closest control is grpo_beta: papo_g_half - grpo_beta = +0.056" in verdict
    results["grpo_beta"] = {s: {k: v + 0.01 for k, v in r.items()} for s, r in results["papo_g_half"].items()}
    verdict = control_verdict(comparison_rows(results, "papo_g_half", (primary, gap), paired_test), "papo_g_half",
                              primary, gap)  # fmt: skip
    assert "does not beat every matched control" in verdict and "(it does against grpo_lr)" in verdict
    assert control_verdict([], "papo_g_half", primary, gap).startswith("No matched control ran")


def test_the_placebo_is_weighed_as_a_control_and_pairs_only_with_the_pages_exact_grpo():
    """Issue 41: the placebo (PAPO-G's term against a background-only mask) joins the controls the strongest PAPO-G
    arm must beat, its arms carry their mask options, and its runs pair with a page only where this run's GRPO scored
    exactly the page's on every seed."""
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.study.controls import comparison_rows, control_verdict
    from papo_nb.workbook.study.dose import OFF_DOSE_ARMS
    from papo_nb.workbook.study.placebo import MEAN_FILL_PAPO_G, PLACEBO, arm_params, check_pairing, kl_matched_gamma

    primary, gap = "avg_at_k/original/vision", "avg_at_k/gap/vision"
    spread = (0.0, 0.01, -0.01, 0.005, -0.004)
    results = {
        arm: {s: {primary: level + d + 0.002 * s * (arm == "papo_g_half"), gap: level / 4 + d} for s, d in
              enumerate(spread)}
        for arm, level in (("grpo", 0.30), ("grpo_beta", 0.40), ("papo_g_half", 0.45), (PLACEBO, 0.44))
    }  # fmt: skip
    rows = comparison_rows(results, "papo_g_half", (primary, gap), paired_test)
    assert {row["against"] for row in rows} == {"grpo", "grpo_beta", PLACEBO}
    verdict = control_verdict(rows, "papo_g_half", primary, gap)
    assert "than every control (the placebo included)" not in verdict  # the gap ties the placebo: not beaten
    assert (
        "does not beat every control (the placebo included)" in verdict and "The closest control is placebo" in verdict
    )
    assert {PLACEBO, MEAN_FILL_PAPO_G} <= set(OFF_DOSE_ARMS), "a placebo arm is never a point of the dose-response"

    params = load_params(ROOT / "params" / "study_controls.yaml", [])
    placebo = arm_params(params, PLACEBO)
    assert (placebo.mask_fill, placebo.mask_excluded_column) == ("mean", "square_units")
    assert (arm_params(params, MEAN_FILL_PAPO_G).mask_excluded_column, params.mask_fill) == (None, "black")
    with pytest.raises(ValueError, match=r"placebo arm='grpo' is unknown; allowed: \['placebo', 'placebo_kl_matched'"):
        arm_params(params, "grpo")

    # the matched gamma scales by the ratio of the first 3 logged steps' mean perception KL (later steps are not read)
    papo_logs = [[{"perception_kl": v} for v in (0.04, 0.06, 0.05, 9.0)], [{"step": 1}, {"perception_kl": 0.05}]]
    placebo_logs = [[{"perception_kl": v} for v in (0.2, 0.3, 0.25, 0.0)]]
    assert kl_matched_gamma(1.675, papo_logs, placebo_logs) == pytest.approx(1.675 * 0.05 / 0.25)
    with pytest.raises(ValueError, match=r"the placebo runs logged no positive perception_kl \(\[0.0\]\)"):
        kl_matched_gamma(1.675, papo_logs, [[{"perception_kl": 0.0}]])

    page = {0: {primary: 0.4, gap: 0.1}, 1: {primary: 0.5, gap: 0.2}}
    check_pairing({0: dict(page[0]), 1: dict(page[1])}, page, [0, 1])
    with pytest.raises(ValueError, match=r"seed 1: this run's GRPO is not the page's \(differs on \['avg_at_k/gap"):
        check_pairing({0: page[0], 1: {primary: 0.5, gap: 0.2 + 1e-12}}, page, [0, 1])
    with pytest.raises(ValueError, match="seed 2: GRPO ran here: False, on the page: False; not paired"):
        check_pairing(page, page, [2])


def test_every_arm_a_study_runs_has_a_colour_of_its_own():
    """The overlays and MLflow's run colours tell each arm apart: controls and placebos too, none left on the
    catch-all colour, no two arms alike."""
    from papo_nb.workbook.study.controls import CONTROL_ARMS
    from papo_nb.workbook.study.placebo import PLACEBO_ARMS
    from papo_nb.workbook.study.search import FRACTION_NAMES

    run = {arms.GRPO, arms.PAPO_G, arms.PAPO_G_COLLAPSE, arms.VPPO, *CONTROL_ARMS, *PLACEBO_ARMS}
    run |= set(map(fraction_arm, FRACTION_NAMES))
    assert run <= ARM_COLOURS.keys(), sorted(run - ARM_COLOURS.keys())
    colours = [ARM_COLOURS[arm] for arm in run]
    assert len(set(colours)) == len(colours) and arms.OTHER_ARM_COLOUR not in colours
