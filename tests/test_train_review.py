"""``papo-nb train`` runs are reviewable like notebook runs (train.final_review, train.records, training.model_card):
the run opens on a results page with its held-out accuracy and training curves, names the model, the data and the
reward among its params, and its model card names the base model; ``--skip-eval`` leaves the evaluation out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient
from training_child import SCRIPT, SMOKE, child_env

from papo_nb.workbook.results.page import NOTE_TAG

SHORT = ["max_steps=2", "save_steps=2", "require_gpu_contract_probe=false", "n_eval_prompts=4"]


def papo_nb_train(tmp_path: Path, *extra: str) -> tuple[Path, str]:
    out, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    command = [str(SCRIPT), "train", "--params", str(SMOKE), "--output-dir", str(out), *extra]
    command += [arg for override in SHORT for arg in ("-p", override)]
    done = subprocess.run(command, env=child_env(uri), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, uri


@pytest.mark.slow
def test_a_papo_nb_train_run_has_its_results_page_heldout_accuracy_params_and_a_card_naming_the_base(tmp_path):
    out, uri = papo_nb_train(tmp_path)
    run = MlflowClient(uri).get_run(json.loads((out / "run_info.json").read_text())["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    params, metrics, page = run.data.params, run.data.metrics, run.data.tags.get(NOTE_TAG, "")
    assert params["model_name_or_path"] == "tiny:qwen2_vl" and params["dataset"] == "synthetic"
    assert params["reward"] == "shapes" and params["reward_functions"] == "accuracy_reward, format_reward"
    assert 0.0 <= metrics["eval/accuracy_original"] <= 1.0 and metrics["eval/items"] == 4
    assert "| split | original | masked | gap | items |" in page, page
    assert f"| {metrics['eval/accuracy_original']:.3f} |" in page.replace("| all items ", "| ")
    assert "figures/training_curves.png" in page
    card = (out / "README.md").read_text()
    assert "[None]" not in card and 'model="None"' not in card
    assert "fine-tuned version of `tiny:qwen2_vl` (the local folder `" in card, card[:800]
    assert "trained on `synthetic`, split `train` with the reward accuracy_reward, format_reward" in card


@pytest.mark.slow
def test_skip_eval_leaves_the_evaluation_out_and_still_writes_the_page(tmp_path):
    out, uri = papo_nb_train(tmp_path, "--skip-eval")
    run = MlflowClient(uri).get_run(json.loads((out / "run_info.json").read_text())["mlflow_run_id"])
    assert not [key for key in run.data.metrics if key.startswith("eval/")]
    assert "figures/training_curves.png" in run.data.tags[NOTE_TAG]
