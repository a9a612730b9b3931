"""VPPOTrainer: its maths against a plain loop of the official actor, its loss against an independent reference on a
fixed batch, the reduction to GRPO at k = 100% and band [1, 1], its metrics, and its configuration's errors."""

import math

import pytest
import torch
from peft import get_peft_model
from trl import GRPOTrainer

from papo_nb.papo.rollout_branch import MASKED_LOGPS_KEY
from papo_nb.testbed.models import load_vlm
from papo_nb.vppo import VPPOConfig, VPPOTrainer, shaping
from papo_nb.vppo.vppo_trainer import DEPENDENCY_KEY, SCORE_RANGE_KEY
from papo_nb.vppo.vppo_trainer import REVIEW_COLUMNS as VPPO_COLUMNS
from papo_nb.workbook.config.params import ParamsError, validate_params
from papo_nb.workbook.rollouts import rollout_batch
from papo_nb.workbook.training.builder import build_trainer, lora_config, papo_config

# The official VPPO values, and the reduction: every token kept, the band [1, 1], no entropy penalty.
OFFICIAL = dict(vppo_token_fraction=0.4, vppo_advantage_scale_min=0.9, original_entropy_weight=0.06, loss_type="dapo")
REDUCED = dict(vppo_token_fraction=1.0, vppo_advantage_scale_min=1.0, original_entropy_weight=0.0)
UNIT = dict(learning_rate=1e-3, beta=0.0, per_device_train_batch_size=8, max_steps=4, require_gpu_contract_probe=False)


def vppo_params(**fields):
    return validate_params({"method": "vppo", "perception_loss_weight": 0.0, "mask_ratio": 0.5, **UNIT, **fields})


def make_trainer(policy, dataset, output_dir, trainer_cls=None, **fields):
    model, processor = policy
    params = vppo_params(**fields)
    args = papo_config(params, output_dir, processor, save_strategy="no")
    trainer = build_trainer(params, args, model, processor, dataset, trainer_cls=trainer_cls)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.fixture(scope="module")
def policy(tiny_vlm_path):
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    return get_peft_model(model, lora_config(vppo_params())), processor


@pytest.fixture(scope="module")
def batch(policy, shapes_dataset, tmp_path_factory):
    trainer = make_trainer(policy, shapes_dataset, tmp_path_factory.mktemp("vppo_batch"), **OFFICIAL)
    return rollout_batch(trainer, shapes_dataset, n_prompts=2, seed=0)


def trainable_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])


# ---- the maths, against a plain loop written from the official actor (dp_actor.py L403-L426, L482-L523) ----
def official_loop(masked, old, mask, fraction, scale_min):
    """Per row: kept token positions and the advantage scale, one row at a time in Python floats."""
    deps, kept = [], []
    for m_row, o_row, v_row in zip(masked.tolist(), old.tolist(), mask.tolist(), strict=True):
        row = []
        for m, o, v in zip(m_row, o_row, v_row, strict=True):
            d = min(max(m - o, -20.0), 20.0)
            row.append(min(max(math.exp(d) - d - 1.0, 0.0), 10.0) if v else 0.0)
        deps.append(row)
        valid = [t for t, v in enumerate(v_row) if v]
        k = math.ceil(len(valid) * fraction)
        kept.append(set(sorted(valid, key=lambda t: (-row[t], t))[:k]))
    counts = [sum(v_row) for v_row in mask.tolist()]
    scores = [sum(r) / max(c, 1) for r, c in zip(deps, counts, strict=True)]
    valid_scores = [s for s, c in zip(scores, counts, strict=True) if c]
    low, high = min(valid_scores), max(valid_scores)
    norm = [min(max((s - low) / (high - low), 0.0), 1.0) for s, c in zip(scores, counts, strict=True) if c]
    upper = scale_min + (1 - scale_min) / (sum(norm) / len(norm) + 1e-8)
    norm_iter = iter(norm)
    scale = [scale_min + next(norm_iter) * (upper - scale_min) if c else 1.0 for c in counts]
    return kept, scale


@pytest.mark.parametrize("fraction,scale_min", [(0.4, 0.9), (0.2, 0.8), (1.0, 1.0), (0.05, 0.0)])
def test_kept_tokens_and_advantage_scale_match_the_official_loop(fraction, scale_min):
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 11, generator=generator) * 3
    masked = old + torch.randn(6, 11, generator=generator)
    lengths = torch.tensor([11, 7, 1, 0, 4, 9])
    mask = (torch.arange(11) < lengths[:, None]).float()
    masked[1, 2] = masked[1, 3] = old[1, 2] = old[1, 3] = -1.0  # a tie: the earlier token ranks first
    dependency = shaping.token_dependency(masked, old, mask)
    kept = shaping.kept_tokens(dependency, mask, fraction)
    scores = shaping.sensitivity_scores(dependency, mask)
    scale = shaping.advantage_scale(scores, shaping.score_range(scores, mask), mask.any(dim=1), scale_min).scale
    want_kept, want_scale = official_loop(masked, old, mask, fraction, scale_min)
    assert [set(row.nonzero().flatten().tolist()) for row in kept] == want_kept
    assert torch.allclose(scale, torch.tensor(want_scale), rtol=1e-5, atol=1e-6)
    assert abs(scale[mask.any(dim=1)].mean().item() - 1.0) < 1e-5  # the band's dynamic top centres it on 1
    filtered = (mask > 0) & ~kept
    shaped = shaping.shaped_advantages(torch.linspace(-1, 1, 6), scale, filtered)
    assert torch.all(shaped[filtered] == 0) and shaped.shape == mask.shape


def test_a_flat_or_single_row_range_leaves_every_scale_at_1():
    mask = torch.ones(3, 4)
    flat = torch.full((3,), 0.25)
    scale = shaping.advantage_scale(flat, shaping.score_range(flat, mask), mask.any(1), 0.9)
    assert torch.equal(scale.scale, torch.ones(3)) and torch.isnan(scale.upper)
    one_row = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert torch.isnan(shaping.score_range(torch.tensor([0.3, 0.0]), one_row)).all()


# ---- the trainer on the tiny VLM ----
def reference_loss(model, trainer, batch, fraction, scale_min, entropy_weight):
    """VPPO's loss on ``batch`` rebuilt from the official formulas with its own forward (the parent's log-prob
    method), the stored masked branch and the rollout-time log-probs: dapo's token mean over the batch."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    vlm = {
        k: batch[k]
        for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
        if batch.get(k) is not None
    }
    logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, model, input_ids, attention, batch["completion_ids"].size(1), **vlm
    )
    mask = batch["completion_mask"].float()
    old = logps.detach()  # on-policy: the rollout-time policy is the current one
    kept, scale = official_loop(batch[MASKED_LOGPS_KEY], old, mask, fraction, scale_min)
    ratio = torch.exp(logps - old)
    clipped = ratio.clamp(1 - trainer.args.epsilon, 1 + trainer.args.epsilon_high)
    total = logps.new_zeros(())
    for i, advantage in enumerate(batch["advantages"].tolist()):
        a = advantage * scale[i]
        for t in kept[i]:
            total = total - torch.min(ratio[i, t] * a, clipped[i, t] * a)
    total = total + entropy_weight * (-logps * mask).sum()
    return total / batch["num_items_in_batch"].float()  # dapo, one process, one step per generation


@pytest.mark.model
def test_loss_matches_an_independent_reference_on_a_fixed_batch(policy, shapes_dataset, batch, tmp_path):
    trainer = make_trainer(policy, shapes_dataset, tmp_path, **OFFICIAL)
    assert trainer.args.loss_type == "dapo" and trainer.args.epsilon_high == 0.28
    loss = trainer._compute_loss(policy[0], batch)
    want = reference_loss(policy[0], trainer, batch, 0.4, 0.9, 0.06)
    assert torch.allclose(loss, want, rtol=1e-5, atol=1e-7), (loss.item(), want.item())
    grad, want_grad = trainable_grads(policy[0], loss), trainable_grads(policy[0], want)
    assert want_grad.norm() > 0
    assert (grad - want_grad).norm() <= 1e-4 * want_grad.norm(), ((grad - want_grad).norm(), want_grad.norm())
    metrics = trainer._metrics["train"]
    mask = batch["completion_mask"].float()
    assert 0.4 <= metrics["vppo/kept_token_share"][-1] <= 0.4 + len(mask) / mask.sum().item()
    assert metrics["vppo/dependency_kept"][-1] > metrics["vppo/token_dependency"][-1] > 0
    assert metrics["vppo/advantage_scale"][-1] == pytest.approx(1.0, abs=1e-5)
    assert metrics["vppo/advantage_scale_max"][-1] > 1.0
    assert batch[SCORE_RANGE_KEY][0, 1] > batch[SCORE_RANGE_KEY][0, 0] >= 0
    assert torch.all(batch[DEPENDENCY_KEY][mask == 0] == 0)


@pytest.mark.model
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_full_fraction_and_unit_band_is_grpo_bit_for_bit(policy, shapes_dataset, batch, tmp_path, loss_type):
    """The gamma-zero probe's idea for VPPO: with nothing filtered and nothing scaled the loss is the parent's bit for
    bit and its gradient to roundoff; its liveness half: the official values move the gradient past the probe's
    tolerance, max(5e-2 |g|, 1e-6)."""
    reduced = make_trainer(policy, shapes_dataset, tmp_path / "vppo", loss_type=loss_type, **REDUCED)
    plain = make_trainer(policy, shapes_dataset, tmp_path / "grpo", GRPOTrainer, loss_type=loss_type, **REDUCED)
    assert isinstance(reduced, VPPOTrainer) and type(plain) is GRPOTrainer
    reduced_loss, plain_loss = reduced._compute_loss(policy[0], batch), plain._compute_loss(policy[0], batch)
    assert torch.equal(reduced_loss, plain_loss), (reduced_loss.item(), plain_loss.item())
    plain_grad = trainable_grads(policy[0], plain_loss)
    assert plain_grad.norm() > 0
    assert (trainable_grads(policy[0], reduced_loss) - plain_grad).norm() <= 1e-6 * plain_grad.norm()
    assert reduced._metrics["train"]["vppo/kept_token_share"][-1] == 1.0
    live = make_trainer(policy, shapes_dataset, tmp_path / "live", **{**OFFICIAL, "loss_type": loss_type})
    live_grad = trainable_grads(policy[0], live._compute_loss(policy[0], batch))
    assert (live_grad - plain_grad).norm() > max(5e-2 * plain_grad.norm(), 1e-6)


@pytest.mark.model
def test_a_batch_from_another_trainer_is_refused_by_name(policy, shapes_dataset, batch, tmp_path):
    trainer = make_trainer(policy, shapes_dataset, tmp_path, **OFFICIAL)
    foreign = {k: v for k, v in batch.items() if k != DEPENDENCY_KEY}
    with pytest.raises(RuntimeError, match=DEPENDENCY_KEY):
        trainer._compute_loss(policy[0], foreign)


@pytest.mark.model
def test_the_completions_table_shows_each_completions_dependency_and_kept_share_and_scale(
    policy, shapes_dataset, tmp_path
):
    """Issue 46: a VPPO run's completions table carries, per row, what VPPO did to that completion: its mean token
    dependency, the share of its tokens that kept their gradient (ceil(0.4 n) of n) and its advantage scale, the
    same numbers the loss used (found by the row's position in the generation batch, through TRL's logs)."""
    from papo_nb.workbook.training import completions

    trainer = make_trainer(policy, shapes_dataset, tmp_path, **OFFICIAL)
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=2, seed=0)
    trainer._compute_loss(policy[0], batch)
    table = completions.completions_table(trainer, step=1)
    assert set(VPPO_COLUMNS) <= set(table.columns) and len(table) == len(batch["prompt_ids"])
    mask = batch["completion_mask"].float()
    scores = shaping.sensitivity_scores(batch[DEPENDENCY_KEY], mask)
    scale = shaping.advantage_scale(scores, batch[SCORE_RANGE_KEY][0], mask.any(dim=1), 0.9).scale
    for _, row in table.iterrows():
        i, n = int(row["row"]), int(mask[int(row["row"])].sum())
        assert row["vppo_token_dependency"] == pytest.approx(scores[i].item(), rel=1e-5)
        assert row["vppo_kept_token_share"] == pytest.approx(math.ceil(0.4 * n) / n)
        assert row["vppo_advantage_scale"] == pytest.approx(scale[i].item(), rel=1e-5)
    assert table["vppo_advantage_scale"].mean() == pytest.approx(1.0, abs=1e-5)  # the band centres it on 1


# ---- configuration ----
def test_config_defaults_are_the_official_vppo_run(tmp_path):
    args = VPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert (args.vppo_token_fraction, args.vppo_advantage_scale_min) == (0.4, 0.9)
    assert (args.mask_ratio, args.mask_sharing) == (0.5, "completion")
    assert (args.original_entropy_weight, args.entropy_estimator) == (0.06, "sampled")
    assert (args.beta, args.epsilon, args.epsilon_high, args.loss_type) == (0.0, 0.2, 0.28, "dapo")
    assert args.perception_loss_weight == 0.0 and args.masked_branch == "rollout" and args.measure_perception_kl


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("vppo_token_fraction", 0.0, "a number in (0, 1]"),
        ("vppo_advantage_scale_min", 1.5, "a number in [0, 1]"),
        ("perception_loss_weight", 0.02, "allowed: 0.0"),
        ("masked_branch", "update", "allowed: 'rollout'"),
    ],
)
def test_config_and_params_reject_bad_fields_by_name(tmp_path, field, value, allowed):
    with pytest.raises(ValueError, match=rf"VPPOConfig\.{field}={value!r} is invalid") as error:
        VPPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **{field: value})
    assert allowed in str(error.value)
    with pytest.raises(ParamsError, match=field) as error:
        vppo_params(**{field: value})
    assert allowed.removeprefix("allowed: ") in str(error.value)


# ---- papo-nb train ----
VPPO_SMOKE = [
    "method=vppo",
    "perception_loss_weight=0",
    "mask_ratio=0.5",
    "original_entropy_weight=0.06",
    "loss_type=dapo",
    "max_steps=2",
    "save_steps=2",
    "require_gpu_contract_probe=false",
]


@pytest.mark.slow
def test_papo_nb_train_with_vppo_logs_its_dependency_metrics_to_mlflow(tmp_path, monkeypatch):
    """``papo-nb train --params params/smoke.yaml -p method=vppo ...`` on the smoke testbed: every VPPO metric lands
    in MLflow at every step, with the token fraction's kept share and a live dependency."""
    from pathlib import Path

    from mlflow import MlflowClient

    from papo_nb.cli import main
    from papo_nb.infra.tracking import EXPERIMENT_NAME

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    smoke = Path(__file__).resolve().parents[1] / "params" / "smoke.yaml"
    overrides = [a for o in VPPO_SMOKE for a in ("-p", o)]
    assert main(["train", "--params", str(smoke), *overrides, "--output-dir", str(tmp_path / "run")]) == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id])
    history = {
        name: [m.value for m in client.get_metric_history(run.info.run_id, f"vppo/{name}")]
        for name in ("token_dependency", "kept_token_share", "advantage_scale", "advantage_scale_max")
    }
    print(f"\npapo-nb train, VPPO on the smoke testbed: {history}")
    assert all(len(values) == 2 for values in history.values()), history
    assert all(0.4 <= share <= 0.5 for share in history["kept_token_share"])  # ceil(0.4 n) of n = 8 or 10 tokens
    assert max(history["token_dependency"]) > 0
    assert all(scale == pytest.approx(1.0, abs=1e-5) for scale in history["advantage_scale"])
    assert run.data.params["vppo_token_fraction"] == "0.4" and run.data.params["vppo_advantage_scale_min"] == "0.9"


# ---- the official run as a params file ----
def test_the_vppo_7b_recipe_file_matches_its_preset_and_the_official_batches():
    from pathlib import Path

    from papo_nb.testbed.models import build_tiny_processor
    from papo_nb.vppo.recipes import VPPO_7B
    from papo_nb.workbook.config import batch_layout as pf
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.recipe.presets import config_fields, recipe_deviations

    params = load_params(Path(__file__).resolve().parents[1] / "params" / "recipes" / "vppo_7b.yaml")
    assert params.recipe == "vppo_7b" and params.method == "vppo"
    assert recipe_deviations(params) == {}  # every exposed preset field is in the file, unchanged
    assert params.dataset == "chamber111/VPPO_ViRL39K_train" and params.format_prompt == "math_perception"
    layout = pf.batch_layout(params)
    assert (layout["prompts_per_generation"], layout["prompts_per_optimizer_step"]) == (384, 128)
    assert layout["optimizer_steps_per_generation"] == 3 and params.num_generations == 8 and params.num_processes == 8
    assert pf.check_batches(params, layout) == [] and pf.batch_deviations(params, layout) == []
    hidden = config_fields(params)
    assert hidden["epsilon_high"] == 0.28 and params.reward_weights == [1.0, 0.0] and hidden["delta"] == 3.0
    args = papo_config(params.model_copy(update={"device": "cpu"}), "unused", build_tiny_processor("qwen2_vl"))
    assert isinstance(args, VPPOConfig) and args.reward_weights == [1.0, 0.0]
    assert {k: getattr(args, k) for k in VPPO_7B} == VPPO_7B


def test_the_preflight_passes_vppo_7b_on_eight_80gb_gpus():
    from pathlib import Path

    import datasets

    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.recipe import check

    recipe = Path(__file__).resolve().parents[1] / "params" / "recipes" / "vppo_7b.yaml"
    params = load_params(recipe)
    result = check.preflight(params, 79.6 * 1024**3, read_data=False)
    assert result.fits and result.problems == [] and result.deviations == []
    rows = datasets.Dataset.from_dict({"problem": ["<image>x"] * 38_870, "answer": ["1"] * 38_870,
                                       "images": [[]] * 38_870})  # fmt: skip
    assert check.data_problems(params, rows) == []
    assert check.run_length(params, rows)["epochs_at_max_steps"] == 2.0  # 606 steps: 2 epochs at 3 steps per round
    assert any("parameter 'num_processes' = 8" in p for p in check.gpu_problems(params, here=1))


# ---- the study arm ----
@pytest.mark.model
def test_the_study_trains_a_vppo_arm_paired_with_grpo(mlflow_store, tmp_path):
    """``study_vppo`` adds the VPPO arm to either design; one arm run on the tiny model trains VPPOTrainer (its step
    logs carry the kept share), is named and coloured as its arm in MLflow, and is scored like every arm."""
    import mlflow
    from mlflow import MlflowClient

    from papo_nb.workbook.study import arms
    from papo_nb.workbook.study.collapse import CollapseRule

    fields = dict(max_steps=1, n_train_prompts=8, n_eval_prompts=4, study_eval_samples=1, study_vppo=True)
    params = vppo_params(method="papo_g", perception_loss_weight=0.02, **fields)
    assert arms._vppo_arm(params) == [(arms.VPPO, 0.0, {})] and arms._vppo_arm(vppo_params(method="papo_g")) == []
    with mlflow.start_run():
        run = arms.run_one(params, arms.VPPO, 0, 0.0, arms.eval_dataset(params), tmp_path, CollapseRule())
    assert run.arm == "vppo" and run.gamma == 0.0
    assert run.step_logs and all(0 < row["vppo/kept_token_share"] <= 1 for row in run.step_logs)
    assert "greedy/original/all" in run.scores
    logged = MlflowClient().get_run(run.run_id).data
    assert logged.params["arm"] == "vppo" and logged.tags["mlflow.runColor"] == arms.ARM_COLOURS["vppo"]
