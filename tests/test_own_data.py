"""A researcher's own rows (docs/data.md, recipe.own_data) and the ``reward`` parameter (training.rewards): rows
checked with the row, the column and what is expected; pixel bounds and the prompt-length filter on own rows;
shipped and own rewards, refused before work; docs/data.md's examples run; and ``papo-nb train`` trains on a reward
module of the test's own, whose values are the logged rewards."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from PIL import Image

from papo_nb.testbed.models import build_tiny_processor
from papo_nb.testbed.rewards import accuracy_reward, format_reward
from papo_nb.testbed.shapes import make_shapes_dataset
from papo_nb.workbook.config.params import ParamsError, load_params
from papo_nb.workbook.config.reward_names import SHIPPED_REWARD_FUNCTIONS
from papo_nb.workbook.recipe import reward as math_reward
from papo_nb.workbook.recipe.data import RecipeDataError, load_rows
from papo_nb.workbook.recipe.own_data import own_rows
from papo_nb.workbook.training import rewards
from papo_nb.workbook.training.builder import load_datasets, load_tokenizer, papo_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "data.md"
SCRIPT = Path(sys.executable).parent / "papo-nb"
WHERE = "parameter 'dataset' = 'mine' (train_split 'train')"


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.DOTALL)


def rows(**columns) -> datasets.Dataset:
    base = {"prompt": ["<image>What colour?"], "images": [[Image.new("RGB", (60, 60), "red")]], "answer": ["red"]}
    return datasets.Dataset.from_dict({**base, **columns})


def refused(dataset, match: str) -> None:
    with pytest.raises(RecipeDataError, match=match):
        own_rows(dataset, WHERE, 3136, 12544)


def test_a_row_that_does_not_fit_is_named_with_its_column_and_what_is_expected():
    refused(rows().remove_columns("answer"), r"parameter 'dataset' = 'mine' .*missing column\(s\) \['answer'\]")
    refused(rows().remove_columns("images"), r"needs exactly one image column, 'image' .* or 'images'")
    two = [[Image.new("RGB", (60, 60))], [Image.new("RGB", (60, 60))] * 2]
    mismatch = datasets.Dataset.from_dict({"prompt": ["<image>a", "<image>b"], "images": two, "answer": ["1", "2"]})
    refused(mismatch, r"row 1, column 'prompt': the text has 1 '<image>' placeholders but 2 images")
    broken = {"bytes": b"not an image", "path": None}
    refused(rows(images=[[broken]]), r"row 0, column 'images': unreadable image \(UnidentifiedImageError")
    refused(rows(answer=[None]), r"row 0, column 'answer': empty")
    structured = [{"role": "user", "content": [{"type": "text", "text": "What colour?"}]}]
    refused(rows(prompt=[structured]), r"row 0, column 'prompt': 0 image part\(s\) but 1 image\(s\); expected")
    refused(rows(prompt=[7]), r"row 0, column 'prompt': got int '7'; expected plain text")


def test_own_rows_are_made_conversational_and_bounded_and_keep_their_columns(tmp_path):
    Image.new("RGB", (300, 200), "blue").save(tmp_path / "big.png")
    paths = datasets.Dataset.from_dict(
        {"prompt": ["Which colour?"], "image": [str(tmp_path / "big.png")], "answer": [3], "source": ["x"]}
    )
    row = own_rows(paths, WHERE, 3136, 12544)[0]
    assert row["prompt"] == [
        {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Which colour?"}]}
    ]
    assert row["image"].width * row["image"].height <= 12544 and row["answer"] == "3" and row["source"] == "x"
    strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which colour?"}]
    small = own_rows(rows(prompt=[strings], images=[[Image.new("RGB", (20, 20))]]), WHERE, 3136, 12544)[0]
    assert [part["type"] for part in small["prompt"][1]["content"]] == ["image", "text"]
    assert small["images"][0].width * small["images"][0].height >= 3136  # scaled up to min_pixels


def save_rows(folder: Path, n: int, *, long_every: int = 0) -> Path:
    """Shapes rows rewritten in the own schema (plain-text prompts, an ``images`` list), train and test splits; every
    ``long_every``-th prompt padded far past any prompt-length limit."""
    shapes = make_shapes_dataset(n, seed=1)
    texts = [p[0]["content"][1]["text"] for p in shapes["prompt"]]
    if long_every:
        texts = [t + " word" * 400 if i % long_every == 0 else t for i, t in enumerate(texts)]
    split = datasets.Dataset.from_dict(
        {
            "prompt": [f"<image>{t}" for t in texts],
            "images": [[im] for im in shapes["image"]],
            "answer": shapes["answer"],
        }
    )
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(folder)
    return folder


@pytest.mark.model  # builds (or reuses) the tiny model's folder for its processor and tokenizer
def test_splits_are_chosen_by_name_and_a_missing_one_names_its_parameter(tmp_path):
    folder = save_rows(tmp_path / "rows", 3)
    assert len(load_rows(str(folder), "test")) == 3 and len(load_rows(f"{folder}@train")) == 3
    params = load_params(None, [f"dataset={folder}", "eval_split=validation"])
    with pytest.raises(
        RecipeDataError, match=r"has splits \['test', 'train'\], not 'validation' \(parameter 'eval_split'\)"
    ):
        load_datasets(params)
    with pytest.raises(RecipeDataError, match=r"parameter 'dataset' = '.*does_not_exist': no such file or folder"):
        load_datasets(load_params(None, [f"dataset={tmp_path / 'does_not_exist'}"]))
    one_image = {"prompt": ["What colour?"], "image": [Image.new("RGB", (60, 60))], "answer": ["blue"]}
    datasets.Dataset.from_dict(one_image).to_parquet(tmp_path / "rows.parquet")
    parquet = own_rows(load_rows(str(tmp_path / "rows.parquet")), WHERE, 3136, 12544)[0]  # one data file
    assert parquet["answer"] == "blue" and parquet["image"].size == (60, 60)


@pytest.mark.model  # builds (or reuses) the tiny model's folder for its processor and tokenizer
def test_over_long_own_prompts_are_dropped_not_truncated(tmp_path):
    folder = save_rows(tmp_path / "rows", 6, long_every=3)
    params = load_params(None, [f"dataset={folder}", "max_prompt_length=300", "n_eval_prompts=2"])
    train, held_out = load_datasets(params)
    assert len(train) == 4 and len(held_out) == 1  # rows 0 and 3 dropped; of the first 2 test rows, row 0
    assert all(" word" * 400 not in r["prompt"][0]["content"][-1]["text"] for r in train)


@pytest.mark.model  # builds (or reuses) the tiny model's folder for its processor and tokenizer
def test_the_documented_example_rows_load_and_the_example_reward_runs_on_them(tmp_path, monkeypatch):
    (data_block,) = doc_blocks("python")[:1]
    monkeypatch.chdir(tmp_path)
    exec(compile(data_block, "docs/data.md", "exec"), {})
    (tmp_path / "my_rewards.py").write_text(doc_blocks("python")[1])
    monkeypatch.syspath_prepend(str(tmp_path))
    params = load_params(None, [f"dataset={tmp_path / 'my_rows'}", "reward=[my_rewards:brevity]"])
    train, held_out = load_datasets(params)
    assert len(train) == len(held_out) == 2 and [len(r["images"]) for r in train] == [1, 2]
    rewards.check_rewards_on_groups(params, train, load_tokenizer(params))
    (function,) = rewards.reward_functions(params)
    completion = [[{"role": "assistant", "content": "<answer>red</answer>"}]]
    assert function([train[0]["prompt"]], completion, completion_ids=[[1, 2]], answer=["red"]) == [0.98]


def test_the_documented_params_lines_validate():
    (block,) = doc_blocks("yaml")
    values = load_params(None, [line.split("#")[0].strip().replace(": ", "=", 1) for line in block.splitlines()])
    assert values.reward == ["my_rewards:brevity"] and values.max_prompt_length == 4096


def test_each_schema_keeps_its_reward_and_names_expand_with_their_weights():
    shapes = load_params(None)
    assert rewards.reward_functions(shapes) == [accuracy_reward, format_reward]
    assert rewards.reward_weights(shapes) is None  # TRL's 1 each, as before the parameter existed
    official = load_params(ROOT / "params" / "recipes" / "papo_g_3b.yaml")
    assert rewards.reward_functions(official) == list(math_reward.REWARD_FUNCS)
    mixed = load_params(None, ["reward=[math, shapes_accuracy]"])
    assert rewards.reward_functions(mixed) == [*math_reward.REWARD_FUNCS, accuracy_reward]
    assert rewards.reward_weights(mixed) == pytest.approx([0.9, 0.1, 1.0])  # each name's own weights
    weighed = mixed.model_copy(update={"reward_weights": [1.8, 0.2, 0.5]})
    assert papo_config(weighed, "unused", build_tiny_processor()).reward_weights == pytest.approx([1.8, 0.2, 0.5])
    vppo = load_params(ROOT / "params" / "recipes" / "vppo_7b.yaml", ["device=cpu"])
    assert papo_config(vppo, "unused", build_tiny_processor()).reward_weights == [1.0, 0.0]  # math, format at 0
    boxed = load_params(ROOT / "params" / "recipes" / "vppo_7b.yaml", ["reward=boxed_accuracy", "reward_weights=[]"])
    assert papo_config(
        boxed.model_copy(update={"device": "cpu"}), "unused", build_tiny_processor()
    ).reward_weights == [1.0]
    names = {name: tuple(f.__name__ for f, _ in parts) for name, parts in rewards.SHIPPED_REWARDS.items()}
    assert names == SHIPPED_REWARD_FUNCTIONS  # what params validation counts reward_weights against


@pytest.mark.model  # builds (or reuses) the tiny model's folder for its processor and tokenizer
def test_a_bad_reward_is_refused_naming_the_parameter_the_value_and_the_error(tmp_path, monkeypatch):
    with pytest.raises(ParamsError, match=r"'reward' = 'my rewards' is invalid: .*'my rewards': not a shipped"):
        load_params(None, ["reward=my rewards"])
    with pytest.raises(ParamsError, match=r"'reward_weights' = \[1.0\]: one weight per reward function, 2 for reward"):
        load_params(None, ["reward=math", "reward_weights=[1.0]"])
    with pytest.raises(ParamsError, match=r"'reward_weights' = \[1.0\]: .* 2 for reward \['shapes'\]"):
        load_params(None, ["reward_weights=[1.0]"])  # the schema's default reward: shapes, two functions
    (tmp_path / "bad_rewards.py").write_text(
        "def crashes(prompts, completions, **kwargs):\n    return [kwargs['no_such_column'][0]]\n"
        "def too_many(prompts, completions, **kwargs):\n    return [1.0, 2.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_rewards", raising=False)  # this test's module, not one cached earlier
    from papo_nb.workbook.config.machine_checks import preflight_problems

    for spec, problem in (
        ("no_such_module:f", "cannot import module 'no_such_module': ModuleNotFoundError"),
        ("bad_rewards:missing", "module 'bad_rewards' has no function 'missing'"),
    ):
        assert f"parameter 'reward' = {spec!r}: {problem}" in "\n".join(
            preflight_problems(load_params(None, [f"reward={spec}"]))
        )
    dataset = own_rows(rows(), WHERE, 3136, 12544)
    tokenizer = load_tokenizer(load_params(None))
    for spec, problem in (
        ("bad_rewards:crashes", r"crashes failed on training row 0 \(4 completions .*KeyError: 'no_such_column'"),
        ("bad_rewards:too_many", r"too_many returned 2 values \(\[1.0, 2.0\]\) for 4 completions; expected 4"),
    ):
        with pytest.raises(rewards.RewardError, match=rf"parameter 'reward' = '{spec}': {problem}"):
            rewards.check_rewards_on_groups(load_params(None, [f"reward={spec}"]), dataset, tokenizer)


REWARD_MODULE = '''
def length_reward(prompts, completions, completion_ids, answer, **kwargs):
    """A tenth of each completion's token count: the logged mean is TRL's mean completion length / 10."""
    assert len(answer) == len(completions) == len(completion_ids)
    return [len(ids) / 10 for ids in completion_ids]
'''


def papo_nb_train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "rewards_here").mkdir(exist_ok=True)
    (tmp_path / "rewards_here" / "my_length_reward.py").write_text(REWARD_MODULE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "rewards_here"), os.environ.get("PYTHONPATH", "")]),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "OMP_NUM_THREADS": "1",
    }
    arguments = [arg for override in overrides for arg in ("-p", override)]
    command = [str(SCRIPT), "train", "--params", str(ROOT / "params" / "smoke_fast.yaml"), *arguments]
    return subprocess.run(
        [*command, "--output-dir", str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_papo_nb_train_trains_on_a_reward_module_of_its_own_and_logs_its_values(tmp_path):
    folder = save_rows(tmp_path / "rows", 8)
    result = papo_nb_train(
        tmp_path, f"dataset={folder}", "reward=[my_length_reward:length_reward]", "reward_weights=[2.0]",
        "max_steps=2", "save_steps=2", "require_gpu_contract_probe=false", "max_completion_length=8",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = [
        e for e in json.loads((tmp_path / "run" / "train_summary.json").read_text())["log_history"] if "reward" in e
    ]
    assert len(steps) == 2
    for entry in steps:
        length = entry["completions/mean_length"]
        assert entry["rewards/length_reward/mean"] == pytest.approx(length / 10)
        assert entry["reward"] == pytest.approx(2 * length / 10)  # reward_weights reached TRL


@pytest.mark.slow
def test_papo_nb_train_refuses_a_bad_reward_and_a_missing_column_before_work(tmp_path):
    folder = save_rows(tmp_path / "rows", 4)
    bad = papo_nb_train(tmp_path, f"dataset={folder}", "reward=my_length_reward:no_such_function")
    assert bad.returncode == 2
    assert "parameter 'reward' = 'my_length_reward:no_such_function': module 'my_length_reward' has no function" in (
        bad.stderr
    )
    datasets.load_from_disk(str(folder))["train"].remove_columns("answer").save_to_disk(tmp_path / "no_answer")
    missing = papo_nb_train(tmp_path, f"dataset={tmp_path / 'no_answer'}", "reward=my_length_reward:length_reward")
    assert missing.returncode == 2, missing.stdout[-3000:] + missing.stderr[-3000:]
    assert "missing column(s) ['answer']" in missing.stderr and str(tmp_path / "no_answer") in missing.stderr
    assert not (tmp_path / "run").exists()  # refused before the run folder, the model or MLflow


def test_the_gpu_params_file_names_its_reward_bounds_its_rows_and_is_run_with_papo_nb_train():
    text = (ROOT / "params" / "gpu.yaml").read_text()
    assert "papo-nb train --params params/gpu.yaml" in text.split("\n\n")[0]
    gpu = load_params(ROOT / "params" / "gpu.yaml")
    assert gpu.dataset_schema == "shapes" and gpu.reward == ["math"]  # own rows, graded by the official reward
    assert rewards.reward_functions(gpu) == list(math_reward.REWARD_FUNCS)
    assert rewards.reward_weights(gpu) == pytest.approx(list(math_reward.REWARD_WEIGHTS))
    assert (gpu.min_pixels, gpu.max_pixels, gpu.max_prompt_length) == (200704, 1003520, 4096)
