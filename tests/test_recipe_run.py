"""The recipe path end to end on the CPU: local official-schema data (saved to disk and to parquet) through the real
loader, the real PAPOGTrainer with full fine-tuning and the official reward, then the evaluation notebook through
papermill on the trained checkpoint, read back from MLflow."""

from pathlib import Path

import datasets
import pytest
import torch
from mlflow import MlflowClient

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.official_schema import make_official_schema_dataset
from papo_nb.train.runner import run_training
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.evaluation import benchmarks as benchmark_eval
from papo_nb.workbook.evaluation.heldout import evaluate_image_reliance
from papo_nb.workbook.training.checkpoints import checkpoint_folders

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "params" / "recipes" / "tiny_cpu.yaml"
# Every test here trains the tiny model for real steps (the module fixture) or uses what it trained.
pytestmark = [pytest.mark.slow, pytest.mark.model]


def full_checkpoint(result):
    return checkpoint_folders(result.output_dir)[0]


@pytest.fixture(scope="module")
def local_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("official_data")
    make_official_schema_dataset(8, seed=5).save_to_disk(str(folder / "train"))
    make_official_schema_dataset(4, seed=6).to_parquet(str(folder / "validation.parquet"))
    suite = benchmark_eval.synthetic_suite(3, seed=7)
    suite.save_to_disk(str(folder / "suite"))
    return folder


@pytest.fixture(scope="module")
def trained(local_data, tmp_path_factory):
    overrides = [f"dataset={local_data / 'train'}", f"validation_dataset={local_data / 'validation.parquet'}"]
    params = load_params(TINY_RECIPE, overrides)
    result = run_training(params, tmp_path_factory.mktemp("recipe_run"), report_to="none")
    return params, result


def test_recipe_trains_every_weight_with_the_official_reward(trained):
    params, result = trained
    trainer = result.trainer
    assert type(trainer.model).__name__ == "Qwen2VLForConditionalGeneration"  # full fine-tuning: no PeftModel
    visual = trainer.model.model.visual
    assert all(p.requires_grad for p in visual.parameters())  # the vision tower trains too
    assert trainer.args.reward_weights == [0.9, 0.1]
    assert (trainer.args.epsilon_high, trainer.args.delta, trainer.args.top_p) == (0.3, 3.0, 0.99)
    assert trainer.args.generation_batch_size == 20 and trainer.args.gradient_accumulation_steps == 2
    assert len([h for h in result.log_history if "loss" in h and "train_loss" not in h]) == params.max_steps
    steps = result.step_logs  # TRL logs rewards at the step that generated: 1 rollout round = 2 optimizer steps here
    assert len(steps) == 1
    for log in steps:  # the components are logged on their own, and the reward is their weighted sum
        acc, fmt = log["rewards/math_accuracy_reward/mean"], log["rewards/math_format_reward/mean"]
        assert 0.0 <= acc <= 1.0 and 0.0 <= fmt <= 1.0
        assert log["reward"] == pytest.approx(0.9 * acc + 0.1 * fmt)
        assert log["perception_kl"] > 0  # the masked branch ran on the multi-image prompts
    assert len(result.eval_dataset) == 4 and "images" in result.eval_dataset.column_names
    # a full-model checkpoint, which latest_checkpoint finds (notebook 03's "last checkpoint")
    assert (full_checkpoint(result) / "config.json").exists() and (
        full_checkpoint(result) / "model.safetensors"
    ).exists()
    assert result.last_checkpoint == full_checkpoint(result)


def test_sampled_generation_returns_k_completions_per_prompt(trained):
    _, result = trained
    rows = result.eval_dataset.select(range(2))
    model, processor = result.trainer.model, result.trainer.processing_class
    torch.manual_seed(0)
    out = generate_answers(
        model, processor, list(rows["prompt"]), [list(x) for x in rows["images"]], max_new_tokens=3, samples=3,
        temperature=1.0,
    )  # fmt: skip
    assert len(out) == 6 and all(isinstance(text, str) for text in out)
    reliance = evaluate_image_reliance(model, processor, rows, max_new_tokens=3)  # notebook 03's check, official rows
    assert reliance["items"] == 2 and reliance["image_reliance_gap"] == pytest.approx(
        reliance["accuracy_original"] - reliance["accuracy_masked"]
    )
    with pytest.raises(ValueError, match="needs a sampling temperature"):
        generate_answers(model, processor, [], [], samples=2)


@pytest.mark.notebook
def test_evaluation_notebook_scores_the_trained_checkpoint(trained, local_data, tmp_path):
    from papo_nb.infra.notebooks import run_workbook

    _, result = trained
    overrides = [
        f"eval_checkpoint={full_checkpoint(result)}",
        f"eval_dataset={local_data / 'suite'}",
        "n_eval_prompts=3",
    ]
    run = run_workbook(
        [ROOT / "notebooks" / "05_evaluation.ipynb"],
        TINY_RECIPE,
        overrides,
        run_root=tmp_path / "runs",
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
    )
    assert run.ok, run.failure_message
    client = MlflowClient(run.tracking_uri)
    child = client.get_run(run.notebooks[0].run_id)
    assert child.data.tags["papo_nb.eval_policy"] == f"full checkpoint {full_checkpoint(result)}"
    assert child.data.tags["mlflow.parentRunId"] == run.parent_run_id
    metrics = child.data.metrics
    for name in ("shapes_one_figure", "shapes_two_figures", "general", "vision_dependent", "overall"):
        for key in benchmark_eval.SCORE_KEYS:
            value = metrics[f"eval/{name}/{key}"]
            assert -1.0 <= value <= 1.0
        assert metrics[f"eval/{name}/gap_avg_at_k"] == pytest.approx(
            metrics[f"eval/{name}/avg_at_k"] - metrics[f"eval/{name}/avg_at_k_masked"]
        )
    assert metrics["data/shapes_one_figure/kept"] == 3 and metrics["data/shapes_two_figures/kept"] == 3
    artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"evaluation", "figures", "notebook"} <= artifacts
    saved = datasets.load_from_disk(str(local_data / "suite"))
    assert sorted(saved) == ["shapes_one_figure", "shapes_two_figures"]
