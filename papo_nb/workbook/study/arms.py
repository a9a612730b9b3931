"""The method study behind notebook 04: GRPO against PAPO-G, paired over seeds, on a policy that reads its images.

Every arm is trained through the real ``PAPOGTrainer`` (TRL's GRPOTrainer, LoRA) built by ``workbook.builder``, with
everything but gamma equal. The sweep design has three: GRPO (gamma = 0), PAPO-G at the recipe's gamma
(``perception_loss_weight``), and PAPO-G at the smallest gamma of a logged sweep (``study_collapse_gammas``, every
seed) that the collapse detector flags on most seeds; the sweep with GRPO and the recipe's gamma is the study's
dose-response (``workbook.study.dose``). The calibrated design searches the collapse gamma on one seed and runs
PAPO-G at fractions of it (``workbook.study.search``), with the warm start's own scores as step 0. Either design
adds a VPPO arm (``VPPOTrainer`` at gamma 0, everything else as GRPO) at every seed when ``study_vppo`` is set.
Every (arm, seed) is an MLflow run nested under the notebook's run, with its per-step training metrics, its
held-out evaluation and the collapse verdict. Seeds pair the arms: the same seed gives the same training data,
sampling and masks in every arm, and all runs are scored on one held-out set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import mlflow
from datasets import concatenate_datasets
from mlflow import MlflowClient

from papo_nb.testbed.perception import TESTBED_RECIPES, held_out_items, prior_answer, testbed_name
from papo_nb.testbed.rewards import accuracy_reward, normalise_answer
from papo_nb.workbook.config.evidence_names import ARM_COLLAPSE
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.evaluation.benchmarks import score_items
from papo_nb.workbook.evaluation.eval_review import prompt_text
from papo_nb.workbook.study.collapse import CollapseRule, collapse_margin, detect_collapse, heldout_verdict
from papo_nb.workbook.study.controls import CONTROL_PARAMS, GRPO_BETA, GRPO_LR, ControlMatch, match_controls
from papo_nb.workbook.study.errors import prior_errors
from papo_nb.workbook.study.placebo import (
    MEAN_FILL_KL_MATCHED,
    MEAN_FILL_PAPO_G,
    PLACEBO,
    PLACEBO_BLACK,
    PLACEBO_BLACK_KL_MATCHED,
    PLACEBO_KL_MATCHED,
)
from papo_nb.workbook.study.search import (
    FRACTION_NAMES,
    entropy_arms,
    fraction_arm,
    is_entropy_arm,
    search_collapse_gamma,
)
from papo_nb.workbook.training.builder import EVAL_SEED_OFFSET, load_datasets, load_policy, prepare_training
from papo_nb.workbook.training.completions import log_completions

GRPO, PAPO_G, PAPO_G_COLLAPSE = "grpo", "papo_g", "papo_g_collapse"
VPPO = "vppo"  # with study_vppo: VPPOTrainer at gamma 0 (token filtering and advantage shaping), else as GRPO
SWEEP, SEARCH = "sweep", "search"
CONSISTENT_SEED_OFFSET = 1  # the in-distribution held-out items: a stream of their own
# One colour per arm in the figures and in MLflow (the ``mlflow.runColor`` tag): matplotlib's tab:blue, tab:green,
# tab:red and tab:gray, and for the calibrated design's fraction arms tab:purple, tab:brown, tab:pink and (1x) tab20's
# light purple.
ARM_COLOURS = {
    GRPO: "#1f77b4", PAPO_G: "#2ca02c", PAPO_G_COLLAPSE: "#d62728", SWEEP: "#7f7f7f", SEARCH: "#7f7f7f",
    VPPO: "#bcbd22",  # tab:olive
    **dict(zip(map(fraction_arm, FRACTION_NAMES), ("#9467bd", "#8c564b", "#e377c2", "#c5b0d5"))),
    # the controls: GRPO's in GRPO's blues, the placebos in orange, PAPO-G with the placebo's fill in PAPO-G's greens
    GRPO_BETA: "#aec7e8", GRPO_LR: "#393b79", PLACEBO: "#ff7f0e", PLACEBO_KL_MATCHED: "#ffbb78",
    MEAN_FILL_PAPO_G: "#98df8a", MEAN_FILL_KL_MATCHED: "#637939",
    PLACEBO_BLACK: "#bd9e39", PLACEBO_BLACK_KL_MATCHED: "#e7ba52",  # the black-fill placebos in golds
}  # fmt: skip
OTHER_ARM_COLOUR = "#17becf"  # tab:cyan: a fraction arm without a name of its own
SPLITS = ("all", "vision", "text", "consistent")  # held_out_splits
# Metrics logged per training step (TRL's and the adapter's names).
STEP_METRICS = (
    "reward",
    "rewards/accuracy_reward/mean",
    "perception_kl",
    "entropy",
    "masked_entropy",
    "original_entropy",  # beside masked_entropy: the masked branch ran where they differ (perception_kl_measured)
    "clip_ratio/high_mean",
    "perception_gamma",
    "vppo/kept_token_share",
    "vppo/advantage_scale_max",
)


@dataclass
class StudyRun:
    """One trained (arm, seed): its MLflow run, per-step logs, held-out scores and collapse verdict."""

    arm: str
    seed: int
    gamma: float
    run_id: str
    step_logs: list[dict]
    scores: dict[str, float]
    collapse: dict
    seconds: float


@dataclass
class Study:
    """Everything the notebook shows: the sweep, the chosen collapse gamma and the arms' runs."""

    sweep: list[StudyRun] = field(default_factory=list)
    collapse_gamma: float | None = None
    collapse_found: bool = False
    runs: list[StudyRun] = field(default_factory=list)
    start_scores: dict[str, float] = field(default_factory=dict)  # the warm start's, before RL (calibrated design)
    controls: list[ControlMatch] = field(default_factory=list)  # the matched controls' searches (calibrated design)

    def by_arm(self) -> dict[str, dict[int, StudyRun]]:
        arms: dict[str, dict[int, StudyRun]] = {}
        for run in self.runs:
            arms.setdefault(run.arm, {})[run.seed] = run
        return arms

    def scores(self) -> dict[str, dict[int, dict]]:
        return {arm: {s: r.scores for s, r in runs.items()} for arm, runs in self.by_arm().items()}

    def collapses(self) -> dict[str, dict[int, dict]]:
        return {arm: {s: r.collapse for s, r in runs.items()} for arm, runs in self.by_arm().items()}

    def treatment(self) -> str:
        """The arm the power table and the paper's claims set against GRPO: PAPO-G at the recipe's gamma where it
        ran, else the PAPO-G arm at the largest fraction of the collapse gamma (``study_recipe_arm`` off)."""
        arms = self.by_arm()
        if PAPO_G in arms or not plain_papo_arms(arms):
            return PAPO_G
        return max(plain_papo_arms(arms), key=lambda arm: next(iter(arms[arm].values())).gamma)


def plain_papo_arms(arms) -> list[str]:
    """The PAPO-G arms among ``arms`` (names), at any gamma, without the double entropy loss; not the collapse arm
    (a search run reused at one seed)."""
    return [arm for arm in arms if arm.startswith(PAPO_G) and arm != PAPO_G_COLLAPSE and not is_entropy_arm(arm)]


# --------------------------------------------------------------------------------------------
# held-out evaluation
# --------------------------------------------------------------------------------------------


def eval_dataset(params: WorkbookParams):
    """The one held-out set every run is scored on (from the notebook's seed, not the run's). On a language-prior
    testbed, half as many prior-consistent items follow the prior-breaking ones: the in-distribution split
    (``consistent``), where the prior is right, so each arm's cost there is shown."""
    held_out = load_datasets(params)[1]
    name = testbed_name(params.dataset)
    if name is None or TESTBED_RECIPES[name].prior_rate is None or params.n_eval_prompts < 2:
        return held_out
    seed = params.seed + EVAL_SEED_OFFSET + CONSISTENT_SEED_OFFSET
    consistent = held_out_items(name, params.n_eval_prompts // 2, seed, prior_rate=1.0)
    return concatenate_datasets([held_out, consistent.cast(held_out.features)])


def held_out_splits(data) -> dict[str, list[int]]:
    """Row indices of each split: ``all`` the held-out distribution (prior-breaking vision items and text items),
    ``vision`` and ``text`` within it, and ``consistent`` the vision items whose number names their answer."""
    vision = list(data["vision_dependent"]) if "vision_dependent" in data.column_names else [True] * len(data)
    named = [prior_answer(prompt_text(prompt)) for prompt in data["prompt"]]
    consistent = [v and n == normalise_answer(str(a)) for v, n, a in zip(vision, named, data["answer"])]
    rows = {
        "all": [i for i, c in enumerate(consistent) if not c],
        "vision": [i for i, (v, c) in enumerate(zip(vision, consistent)) if v and not c],
        "text": [i for i, v in enumerate(vision) if not v],
        "consistent": [i for i, c in enumerate(consistent) if c],
    }
    return {split: keep for split, keep in rows.items() if keep}


def evaluate_policy(model, processor, data, *, samples: int, mask_ratio: float, seed: int, max_new_tokens: int):
    """Greedy and avg@``samples`` (temperature 1.0) accuracy, with original and masked images (the official 14x14
    squares at ``mask_ratio``, one fixed mask per item), per split (all, vision-dependent, text-answerable), and
    the perception-reliance gap (original - masked): ``benchmark_eval.score_items`` graded by the shapes reward.
    Keys: ``<greedy|avg_at_k>/<original|masked|gap>/<split>``; with a language prior also the split of the greedy
    errors into followed-the-prior and misread (``errors.prior_errors``).

    Datasets without a ``vision_dependent`` column (the shapes task) count every item as vision-dependent."""
    answers = list(data["answer"])
    per_item = score_items(
        model, processor, list(data["prompt"]), answers, list(data["image"]), grade=accuracy_reward, samples=samples,
        max_new_tokens=max_new_tokens, mask_ratio=mask_ratio, seed=seed, batch_size=64,
    )  # fmt: skip
    scores = {}
    for split, keep in held_out_splits(data).items():
        for name, values in per_item.items():
            scores[f"{name}/{split}"] = mean(values[i] for i in keep)
        for kind in ("greedy", "avg_at_k"):
            scores[f"{kind}/gap/{split}"] = scores[f"{kind}/original/{split}"] - scores[f"{kind}/masked/{split}"]
    return scores | prior_errors(model, processor, data, max_new_tokens=max_new_tokens)


# --------------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------------


def _step_rows(log_history: list[dict]) -> list[dict]:
    """Per-step metrics; with several optimizer steps per rollout batch TRL logs reward only on the first."""
    return [
        {"step": h["step"], **{k: float(h[k]) for k in STEP_METRICS if k in h}}
        for h in log_history
        if "step" in h and any(k in h for k in STEP_METRICS)
    ]


def perception_kl_measured(step_logs: list[dict]) -> bool:
    """True when the masked branch ran: some logged perception KL is not 0, or the masked entropy differs from the
    original one. A skipped branch logs neither (older runs logged a KL of 0 and the original entropy under the
    masked name); a confident policy's real KL can round to 0 in fp32 at every step, its two entropies do not meet."""

    def entropies_differ(row: dict) -> bool:
        return (
            "masked_entropy" in row and "original_entropy" in row and row["masked_entropy"] != row["original_entropy"]
        )

    return any(row.get("perception_kl", 0.0) != 0.0 or entropies_differ(row) for row in step_logs)


def require_measured_kl(params: WorkbookParams, arm: str, seed: int, gamma: float, step_logs: list[dict]) -> None:
    """Raise when a run should have measured its perception KL (``measure_perception_kl`` on, or a perception term
    on) and logged 0 at every step: a study that read those zeros as a KL would report an artefact."""
    if (params.measure_perception_kl or gamma > 0) and not perception_kl_measured(step_logs):
        raise RuntimeError(
            f"study run {arm} (seed {seed}, gamma {gamma:g}): measure_perception_kl="
            f"{params.measure_perception_kl} but the logged perception_kl is 0 at all {len(step_logs)} steps: the "
            "masked branch did not run"
        )


def run_one(
    params: WorkbookParams,
    arm: str,
    seed: int,
    gamma: float,
    data,
    work_dir: Path,
    rule: CollapseRule,
    control: dict[str, float] | None = None,
    overrides: dict[str, float] | None = None,
) -> StudyRun:
    """Train one (arm, seed) from the notebook's params with only seed and gamma changed (and ``overrides``, a
    matched control's knob), score it, log it as an MLflow run nested under the active run. With ``control``
    (GRPO's held-out scores on this seed) the collapse verdict also weighs the held-out evidence
    (``collapse.heldout_verdict``)."""
    overrides = overrides or {}
    run_params = params.model_copy(update={"seed": seed, "perception_loss_weight": gamma, **overrides})
    if arm == VPPO:
        run_params = run_params.model_copy(update={"method": "vppo"})
    start = time.perf_counter()
    parent = mlflow.active_run()
    # nested=True alone files the child in the default experiment; it belongs beside its parent
    experiment_id = parent.info.experiment_id if parent is not None else None
    with mlflow.start_run(
        run_name=f"{arm}-gamma{gamma:g}-seed{seed}", nested=True, experiment_id=experiment_id
    ) as run:
        mlflow.set_tags({"papo_nb.kind": "study_run", "papo_nb.study_seed": str(seed)})
        if arm not in (SWEEP, SEARCH):  # a sweep run's arm is known once the sweep is over (name_sweep_runs)
            name_arm(MlflowClient(), run.info.run_id, arm)
        mlflow.log_params(
            {"seed": seed, "gamma": gamma, "max_steps": params.max_steps, "finetuning": params.finetuning, **overrides}
        )
        folder = work_dir / "-".join([f"{arm}-g{gamma:g}-s{seed}", *(f"{k}{v:g}" for k, v in overrides.items())])
        trainer, _, _ = prepare_training(run_params, folder, save_strategy="no", require_gpu_contract_probe=False)
        trainer.train()
        # The last step's rollouts beside their images and masks, as notebook 03's run shows them (a small table)
        log_completions(MlflowClient(), run.info.run_id, trainer, trainer.state.global_step)
        step_logs = _step_rows(trainer.state.log_history)
        require_measured_kl(run_params, arm, seed, gamma, step_logs)
        for row in step_logs:  # TRL's own names, as notebook 03's run logs them (metric_keys)
            mlflow.log_metrics({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        scores = _log_scores(trainer, data, params)
        collapse = _log_collapse(step_logs, scores, rule, control, heldout=control is not None or arm == GRPO)
        seconds = time.perf_counter() - start
        mlflow.log_metric("study/run_seconds", seconds)
        del trainer
    return StudyRun(arm, seed, gamma, run.info.run_id, step_logs, scores, collapse, seconds)


def _log_scores(trainer, data, params: WorkbookParams) -> dict[str, float]:
    """The trained policy's held-out scores (``evaluate_policy``), logged under ``eval/`` and as the headline."""
    scores = evaluate_policy(
        trainer.model,
        trainer.processing_class,
        data,
        samples=params.study_eval_samples,
        mask_ratio=params.mask_ratio,
        seed=params.seed,
        max_new_tokens=params.max_completion_length,
    )
    mlflow.log_metrics({f"eval/{k}": v for k, v in scores.items()})
    mlflow.log_metric(HELDOUT_ACCURACY, scores["greedy/original/all"])
    return scores


def _log_collapse(step_logs: list[dict], scores: dict[str, float], rule: CollapseRule, control, *, heldout: bool):
    """The run's collapse verdict from its step logs (with ``heldout``, weighed with its held-out ``scores`` against
    ``control``'s: ``collapse.heldout_verdict``), logged as ``ARM_COLLAPSE`` and two metrics."""
    collapse = detect_collapse(step_logs, rule) | {"margin": collapse_margin(step_logs, rule)}
    if heldout:
        collapse = heldout_verdict(collapse, scores, control, rule)
    mlflow.log_dict(collapse, ARM_COLLAPSE)
    mlflow.log_metrics({"collapse/flagged": float(collapse["collapsed"]), "collapse/step": collapse["step"] or -1})
    return collapse


def name_arm(client: MlflowClient, run_id: str, arm: str) -> None:
    """One name and one colour per arm everywhere: the ``arm`` param, the ``papo_nb.study_arm`` tag, the run name's
    first word and the ``mlflow.runColor`` tag."""
    name = client.get_run(run_id).info.run_name
    client.log_param(run_id, "arm", arm)
    client.set_tag(run_id, "papo_nb.study_arm", arm)
    client.set_tag(run_id, "mlflow.runColor", ARM_COLOURS.get(arm, OTHER_ARM_COLOUR))
    client.set_tag(run_id, "mlflow.runName", f"{arm}-{name.split('-', 1)[1]}")


def name_sweep_runs(study: Study) -> None:
    """The sweep's (or search's) runs at the chosen collapse gamma are the collapse arm's (not trained twice): named
    so in MLflow as in the tables; its other gammas stay ``sweep`` (``search``)."""
    client = MlflowClient()
    for run in study.sweep:
        name_arm(client, run.run_id, PAPO_G_COLLAPSE if run.gamma == study.collapse_gamma else run.arm)


# --------------------------------------------------------------------------------------------
# the study
# --------------------------------------------------------------------------------------------


def run_study(params: WorkbookParams, work_dir: str | Path, rule: CollapseRule | None = None, log=print) -> Study:
    """The study in one of two designs. With ``study_gamma_fractions`` set: the warm-start policy scored once (step
    0), the collapse gamma searched on the first seed (``search``), then GRPO, PAPO-G at the recipe's gamma and at
    each fraction of the collapse gamma over ``study_seeds``. Otherwise the dose-response sweep (every gamma of
    ``study_collapse_gammas`` at every seed, paired like the arms), then GRPO and PAPO-G at the recipe's gamma; the
    collapse arm is the sweep's runs at the smallest gamma flagged on most seeds (the largest when none is)."""
    rule = rule or CollapseRule()
    work_dir = Path(work_dir)
    data = eval_dataset(params)

    def train(arm: str, seed: int, gamma: float, control: dict | None = None, overrides=None) -> StudyRun:
        return run_one(params, arm, seed, gamma, data, work_dir, rule, control, overrides)

    design = _calibrated_study if params.study_gamma_fractions else _sweep_study
    return design(params, train, data, log)


def _sweep_study(params: WorkbookParams, train, data, log) -> Study:
    seeds = list(params.study_seeds)
    study = Study()
    for gamma in sorted(params.study_collapse_gammas):
        for seed in seeds:
            run = train(SWEEP, seed, gamma)
            study.sweep.append(run)
            log(f"sweep gamma={gamma:g} seed={seed}: collapsed={run.collapse['collapsed']} at {run.collapse['step']}")
    by_gamma: dict[float, list[StudyRun]] = {}
    for run in study.sweep:
        by_gamma.setdefault(run.gamma, []).append(run)
    flagged = [g for g, runs in sorted(by_gamma.items()) if sum(r.collapse["collapsed"] for r in runs) > len(runs) / 2]
    study.collapse_found = bool(flagged)
    study.collapse_gamma = flagged[0] if flagged else max(by_gamma)
    _record_collapse_gamma(study)
    for seed in seeds:
        for arm, gamma, _ in ((GRPO, 0.0, {}), (PAPO_G, params.perception_loss_weight, {}), *_vppo_arm(params)):
            run = train(arm, seed, gamma)
            study.runs.append(run)
            log(f"{arm} seed={seed}: avg_at_k {run.scores['avg_at_k/original/all']:.3f}, {run.seconds:.0f} s")
    study.runs.extend(_as_arm(run, PAPO_G_COLLAPSE) for run in by_gamma[study.collapse_gamma])
    return study


def _calibrated_study(params: WorkbookParams, train, data, log) -> Study:
    seeds = list(params.study_seeds)
    study = Study(start_scores=_start_scores(params, data))
    log(f"step 0 (the warm start): avg_at_k {study.start_scores['avg_at_k/original/all']:.3f}")
    # On a seed no arm uses the search reads the step logs alone; on the first arm seed (the earlier design) it also
    # weighs held-out accuracy against GRPO's on that seed
    search_seed = seeds[0] if params.study_search_seed is None else params.study_search_seed
    grpo = {seeds[0]: train(GRPO, seeds[0], 0.0)} if search_seed == seeds[0] else {}

    def search_run(gamma: float) -> dict:
        run = train(SEARCH, search_seed, gamma, control=grpo[search_seed].scores if grpo else None)
        study.sweep.append(run)
        verdict = run.collapse
        margin = ", ".join(f"{k} {v:.2f}" for k, v in verdict["margin"].items())
        log(
            f"search gamma={gamma:g} seed={search_seed}: collapsed={verdict['collapsed']} ({verdict['mode']}); "
            f"peak over firing level: {margin}"
        )
        return run.collapse

    if params.study_collapse_gamma is None:
        _, study.collapse_gamma, study.collapse_found = search_collapse_gamma(
            search_run, list(params.study_collapse_gammas), healthy=params.perception_loss_weight,
            steps=params.study_search_steps,
        )  # fmt: skip
    else:  # an earlier search's (a published page's): no search run here
        study.collapse_gamma, study.collapse_found = params.study_collapse_gamma, True
        log(f"collapse gamma {study.collapse_gamma:g}: given (study_collapse_gamma), not searched here")
    _record_collapse_gamma(study)
    arms = [(PAPO_G, params.perception_loss_weight, {})] if params.study_recipe_arm else []
    arms += [(fraction_arm(f), float(f"{f * study.collapse_gamma:.4g}"), {}) for f in params.study_gamma_fractions]
    study.controls = match_controls(params, train, search_seed, strongest=arms[-1], log=log)
    arms += [(m.arm, 0.0, {CONTROL_PARAMS[m.arm]: m.value}) for m in study.controls]
    recipe = params.perception_loss_weight if params.study_recipe_arm else None
    arms += entropy_arms(params.study_entropy_weights, params.study_entropy_fractions, study.collapse_gamma, recipe)
    arms[1:1] = _vppo_arm(params)
    for seed in seeds:
        if seed not in grpo:
            grpo[seed] = train(GRPO, seed, 0.0)
        study.runs.append(grpo[seed])
        for arm, gamma, overrides in arms:
            run = train(arm, seed, gamma, control=grpo[seed].scores, overrides=overrides)
            study.runs.append(run)
            score = run.scores["avg_at_k/original/all"]
            log(f"{arm} gamma={gamma:g} {overrides or ''} seed={seed}: avg_at_k {score:.3f}")
    study.runs.extend(_as_arm(run, PAPO_G_COLLAPSE) for run in study.sweep if run.gamma == study.collapse_gamma)
    return study


def _vppo_arm(params: WorkbookParams) -> list[tuple[str, float, dict]]:
    """The VPPO arm (gamma 0) where ``study_vppo`` asks for it: everything else as GRPO's, paired over the seeds."""
    return [(VPPO, 0.0, {})] if params.study_vppo else []


def _start_scores(params: WorkbookParams, data) -> dict[str, float]:
    """The warm-start policy's held-out scores before any RL step, scored like every trained run."""
    model, processor = load_policy(params)
    return evaluate_policy(
        model, processor, data, samples=params.study_eval_samples, mask_ratio=params.mask_ratio, seed=params.seed,
        max_new_tokens=params.max_completion_length,
    )  # fmt: skip


def _record_collapse_gamma(study: Study) -> None:
    """The chosen collapse gamma logged on the study's run, and its sweep or search runs named the collapse arm."""
    mlflow.log_metrics(
        {"study/collapse_gamma": study.collapse_gamma, "study/collapse_found": float(study.collapse_found)}
    )
    name_sweep_runs(study)


def _as_arm(run: StudyRun, arm: str) -> StudyRun:
    """A sweep or search run counted as an arm's, not trained twice."""
    return StudyRun(arm, run.seed, run.gamma, run.run_id, run.step_logs, run.scores, run.collapse, run.seconds)
