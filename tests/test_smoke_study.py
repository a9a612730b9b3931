"""The smoke workbook's method study (notebook 04 on ``params/smoke.yaml``): warm start 0 of the shortcut testbed in
the published design, its collapse gamma the one that warm start's own search found (rebuilt here from the search's
step logs, with each call's margin), and the parameters that carry it (``study_params``, ``study_collapse_gamma``,
``study_recipe_arm``)."""

import json
import math
from pathlib import Path

import mlflow
import pytest

from papo_nb.infra.smoke_paths import SMOKE_PARAMS
from papo_nb.testbed.policy import pinned_testbed, read_card
from papo_nb.workbook.config.params import ParamsError, load_params, study_params_applied
from papo_nb.workbook.study import arms, warm_starts
from papo_nb.workbook.study.arms import StudyRun
from papo_nb.workbook.study.collapse import collapse_margin, detect_collapse
from papo_nb.workbook.study.drift import (
    PRIMARY,
    arm_verdicts,
    counteract_claim,
    drift_rows,
    verdict_line,
    verdict_metrics,
)
from papo_nb.workbook.study.search import search_collapse_gamma

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "docs" / "study"
# what the smoke's study leaves out of the page's design (params/study_controls.yaml), and why: see params/smoke.yaml
LEFT_OUT = {
    "study_collapse_gamma": 3.35, "study_collapse_gammas": [1.0], "study_search_steps": 2, "study_search_seed": None,
    "study_recipe_arm": False, "study_control_betas": [], "study_control_learning_rates": [],
    "require_gpu_contract_probe": True,  # the notebooks' probe; a study run never asks for it (run_one)
}  # fmt: skip


def smoke_study():
    return study_params_applied(load_params(SMOKE_PARAMS))


def test_the_smoke_study_is_the_published_warm_start_0_design_less_its_searches_and_controls():
    page = load_params(ROOT / "params" / "study_controls.yaml").model_dump()
    ours = smoke_study().model_dump()
    workbook_only = {name for name in ours if not name.startswith("study_") and name in load_params(None).model_dump()}
    differ = {name for name in ours if ours[name] != page[name]}
    # the other notebooks' own settings (02, 05) differ; nothing a study run reads does, but what LEFT_OUT names
    study_reads = differ - {"calibration_batches", "eval_base_beside", "eval_benchmarks", "eval_checkpoint",
                            "eval_dataset", "format_prompt", "prefix_sharing"}  # fmt: skip
    assert study_reads == set(LEFT_OUT) and workbook_only
    assert {name: ours[name] for name in LEFT_OUT} == LEFT_OUT
    assert ours["model_name_or_path"] == ours["dataset"] == "testbed:shapes_shortcut"
    assert ours["prefix_sharing"] is False  # as the page's runs were trained: the same floats on the native path


def test_the_smoke_collapse_gamma_is_the_one_warm_start_0s_own_search_found():
    """Not a number of its own: the smallest gamma the shortcut page's search (seed 0, step logs) flagged, and the
    pooled page's PAPO-G gamma on warm start 0 is half of it, on the shipped weights."""
    runs = json.loads((STUDY / "shortcut_lora" / "runs.json").read_text())
    searched = [r for r in runs if r["arm"] in ("search", "papo_g_collapse") and r["seed"] == 0]
    assert [r["gamma"] for r in searched if not r["collapse"]["collapsed"]] == [0.2, 1.0, 2.24]
    collapsed = min(r["gamma"] for r in searched if r["collapse"]["collapsed"])
    assert smoke_study().study_collapse_gamma == collapsed == 3.35
    build = json.loads((STUDY / "shortcut_warm_starts" / "runs.json").read_text())["warm_starts"][0]
    assert build["weights_sha256"] == read_card(pinned_testbed("shapes_shortcut"))["weights_sha256"]
    assert {r["gamma"] for r in build["runs"] if r["arm"] == "papo_g_half"} == {0.5 * collapsed}


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("study_params={max_stepz: 3}", "'max_stepz' is not a workbook parameter it can set"),
        ("study_params={study_params: {}}", "'study_params' is not a workbook parameter it can set"),
        ("study_params={max_steps: 0}", "is invalid: max_steps: Input should be greater than or equal to 1"),
        ("study_params={study_collapse_gamma: -1.0}", "study_collapse_gamma: Input should be greater than 0"),
    ],
)
def test_study_params_name_the_bad_key_and_value_before_anything_runs(override, said):
    with pytest.raises(ParamsError, match="parameter 'study_params'") as caught:
        load_params(SMOKE_PARAMS, [override])
    assert said in str(caught.value)


def test_study_params_replace_the_workbook_values_for_the_study_alone():
    params = load_params(SMOKE_PARAMS)
    assert params.model_name_or_path == "testbed:shapes_boxed" and params.max_steps == 6  # 03 and 05's
    study = study_params_applied(params)
    assert study.max_steps == 40 and study.study_params == {} and study_params_applied(study) is study


def fake_run(arm: str, seed: int, gamma: float, score: float) -> StudyRun:
    return StudyRun(arm, seed, gamma, "", [], {PRIMARY: score, "avg_at_k/original/all": score}, {}, 0.0)


def test_a_given_collapse_gamma_trains_no_search_run_and_the_recipe_arm_can_be_left_out(mlflow_store, monkeypatch):
    monkeypatch.setattr(arms, "_start_scores", lambda params, data: {PRIMARY: 0.5, "avg_at_k/original/all": 0.5})
    trained = []

    def train(arm, seed, gamma, control=None, overrides=None):
        trained.append((arm, seed, gamma))
        return fake_run(arm, seed, gamma, 0.4 + gamma / 10)

    with mlflow.start_run():
        study = arms._calibrated_study(smoke_study(), train, None, log=lambda line: None)
    assert study.sweep == [] and study.collapse_gamma == 3.35 and study.collapse_found
    arms_per_seed = (("grpo", 0.0), ("papo_g_half", 1.675))  # no search run, no recipe arm
    assert trained == [(arm, seed, gamma) for seed in range(5) for arm, gamma in arms_per_seed]


def test_the_verdict_line_states_the_drift_and_each_arm_with_ci_p_and_mde():
    start = {PRIMARY: 0.50}
    results = {"grpo": {s: {PRIMARY: v} for s, v in enumerate((0.40, 0.42, 0.38))},
               "papo_g_half": {s: {PRIMARY: v} for s, v in enumerate((0.47, 0.48, 0.46))}}  # fmt: skip
    drift = drift_rows(start, results, metrics=(PRIMARY,))
    verdicts = arm_verdicts(results, {"papo_g_half": 1.675}, "grpo")
    line = verdict_line(drift, verdicts, counteract_claim(drift, verdicts, "grpo"), "grpo")
    assert line.startswith(
        "holds: papo_g_half (gamma 1.675) ends +0.070 above GRPO, making up 70% of GRPO's -0.100 drift. On "
    )
    assert "grpo 0.500 -> 0.400: drift -0.100 +/- 0.050 (p = " in line and ", 3 seeds); papo_g_half" in line
    assert "papo_g_half (gamma 1.675) - grpo +0.070 +/- 0.025 (p = 0.0067, MDE 0.033); each +/- is a 95% CI" in line

    metrics = verdict_metrics(drift, verdicts, "grpo")
    assert metrics["study/drift/grpo"] == pytest.approx(-0.10)
    assert metrics["study/vs_grpo/papo_g_half"] == pytest.approx(0.07)
    assert set(metrics) == {"study/drift/grpo", "study/drift_ci95/grpo", "study/vs_grpo/papo_g_half",
                            "study/vs_grpo_ci95/papo_g_half", "study/vs_grpo_p/papo_g_half",
                            "study/vs_grpo_mde/papo_g_half"}  # fmt: skip
    assert all(math.isfinite(v) for v in metrics.values())


def test_an_arm_that_beats_grpo_by_more_than_its_drift_is_said_to_end_above_the_warm_start():
    """Issue 61: the smoke workbook's 04 said "recovers +0.072 of GRPO's drift" of a drift of -0.059; the verdict
    says the arm beat GRPO by more than GRPO lost and where it ended against the warm start, from the same rows."""
    start = {PRIMARY: 0.465}
    results = {"grpo": {s: {PRIMARY: v} for s, v in enumerate((0.40, 0.42, 0.398))},
               "papo_g_half": {s: {PRIMARY: v} for s, v in enumerate((0.47, 0.49, 0.475))}}  # fmt: skip
    drift = drift_rows(start, results, metrics=(PRIMARY,))
    verdicts = arm_verdicts(results, {"papo_g_half": 1.675}, "grpo")
    claim = counteract_claim(drift, verdicts, "grpo")["verdict"]
    grpo, (row,) = drift[0], verdicts
    assert row["diff"] > -grpo["drift"] > 0
    assert claim == (
        f"holds: papo_g_half (gamma 1.675) ends {row['diff']:+.3f} above GRPO, more than GRPO's {grpo['drift']:+.3f} "
        f"drift: it ends {row['arm_mean'] - 0.465:+.3f} from the warm start ({row['arm_mean']:.3f} against 0.465)"
    )
    assert "recovers" not in claim


def test_one_warm_start_says_what_the_pooled_page_listing_its_weights_found():
    sha = read_card(pinned_testbed("shapes_shortcut"))["weights_sha256"]
    note = warm_starts.one_warm_start_note(sha, "lora", STUDY)
    assert "warm start 0 of the 6 that `docs/study/shortcut_warm_starts` pools" in note
    assert "PAPO-G minus GRPO: not detected (" in note and "not for the testbed" in note
    assert "warm start 0 of the 3 that `docs/study/shortcut_controls_full`" in warm_starts.one_warm_start_note(
        sha, "full", STUDY
    )
    assert "no pooled page" in warm_starts.one_warm_start_note("0" * 64, "lora", STUDY)


def test_warm_start_0s_collapse_search_rebuilt_from_its_step_logs_finds_its_gamma_and_states_each_margin():
    """The search as ``arms._calibrated_study`` runs it (``search.search_collapse_gamma``: the ladder, then two
    geometric bisections), each call answered by the collapse detector on the published run's step logs alone (no
    held-out item), finds 3.35 again; each call's margin says how near the detector came to firing."""
    logs = json.loads((STUDY / "shortcut_lora" / "step_logs.json").read_text())
    by_gamma = {r["gamma"]: r["steps"] for r in logs if r["arm"] in ("search", "papo_g_collapse") and r["seed"] == 0}
    calls = []

    def from_step_logs(gamma: float) -> dict:
        verdict = detect_collapse(by_gamma[gamma])
        calls.append((gamma, verdict["collapsed"], collapse_margin(by_gamma[gamma])))
        return verdict

    params = load_params(ROOT / "params" / "study_shortcut.yaml")  # the page's ladder and bisection steps
    tried, gamma, found = search_collapse_gamma(
        from_step_logs, params.study_collapse_gammas, healthy=params.perception_loss_weight,
        steps=params.study_search_steps,
    )  # fmt: skip
    assert (tried, gamma, found) == ([0.2, 1.0, 5.0, 2.24, 3.35], 3.35, True)
    assert gamma == smoke_study().study_collapse_gamma
    assert [(g, collapsed) for g, collapsed, _ in calls] == [(0.2, False), (1.0, False), (5.0, True), (2.24, False),
                                                             (3.35, True)]  # fmt: skip
    healthy, edge = calls[3][2], calls[4][2]
    # 2.24 stayed healthy although its KL rose past 4x: no entropy rose with it (each below its firing level)
    assert healthy["perception_kl_rise"] > 1 and max(healthy["entropy_rise"], healthy["masked_entropy_rise"]) < 1
    # 3.35 fired on a near call: the masked entropy 24% past its level (5.0's: about 4x)
    assert edge["masked_entropy_rise"] == pytest.approx(1.24, abs=0.01) and calls[2][2]["masked_entropy_rise"] > 3


def test_the_calibrated_params_search_each_warm_starts_gamma_on_step_logs_and_run_every_remedy_arm(
    mlflow_store, monkeypatch
):
    """params/study_calibrated.yaml (issue 56, items 1, 2 and 4), every run faked: the search on the search seed
    weighs no held-out item (no control scores), its margins are logged; the arms are the fractions 1/4 and 1/2 of
    the gamma found, the recipe's gamma, the double entropy loss at each weight on both terms at the recipe's gamma
    and at 1/2 and 1x, and the two matched controls, each at every seed."""
    monkeypatch.setattr(arms, "_start_scores", lambda params, data: {PRIMARY: 0.5, "avg_at_k/original/all": 0.5})
    monkeypatch.setattr(arms, "name_sweep_runs", lambda study: None)  # the fake runs have no MLflow run to name
    params = load_params(ROOT / "params" / "study_calibrated.yaml")
    trained, lines = [], []

    def train(arm, seed, gamma, control=None, overrides=None):
        trained.append((arm, seed, gamma, control, overrides or {}))
        logs = [{"step": s, "rewards/accuracy_reward/mean": 0.6 - gamma / 100} for s in range(1, 41)]
        collapsed = gamma >= 3.0  # where this fake policy breaks
        verdict = {"collapsed": collapsed, "mode": "fake" if collapsed else None, "margin": {"fake": gamma / 3.0}}
        return StudyRun(arm, seed, gamma, "", logs, {PRIMARY: 0.4, "avg_at_k/original/all": 0.4}, verdict, 0.0)

    with mlflow.start_run():
        study = arms._calibrated_study(params, train, None, log=lines.append)
    search = [(g, control) for arm, seed, g, control, _ in trained if arm == "search"]
    assert search == [(0.2, None), (1.0, None), (5.0, None), (2.24, None), (3.35, None)]  # step logs alone
    assert study.collapse_gamma == 3.35 and all(seed == 100 for arm, seed, *_ in trained if "search" in arm)
    assert any("search gamma=2.24" in line and "fake 0.75" in line for line in lines)  # each call's margin
    per_seed = {(arm, g, tuple(sorted(o.items()))) for arm, seed, g, _, o in trained if seed == 3}
    both = {w: (("masked_entropy_weight", w), ("original_entropy_weight", w)) for w in (0.05, 0.2)}
    assert {(arm, g) for arm, g, _ in per_seed} == {
        ("grpo", 0.0), ("papo_g", 0.02), ("papo_g_quarter", 0.8375), ("papo_g_half", 1.675), ("grpo_beta", 0.0),
        ("grpo_lr", 0.0), ("papo_g_entropy0.05", 0.02), ("papo_g_half_entropy0.05", 1.675),
        ("papo_g_x1_entropy0.05", 3.35), ("papo_g_entropy0.2", 0.02), ("papo_g_half_entropy0.2", 1.675),
        ("papo_g_x1_entropy0.2", 3.35),
    }  # fmt: skip
    assert ("papo_g_x1_entropy0.2", 3.35, both[0.2]) in per_seed and ("papo_g_half", 1.675, ()) in per_seed
    assert study.treatment() == "papo_g" and arms.plain_papo_arms(study.by_arm()) == [
        "papo_g", "papo_g_quarter", "papo_g_half"
    ]  # fmt: skip
