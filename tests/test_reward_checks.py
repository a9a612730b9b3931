"""A reward is checked on a real group before the model loads and on every call in training (training.rewards): a
wrong length (TRL would spread one value over the batch), a non-number or NaN is refused naming the function, the
length and the expected one; through ``papo-nb train``, before any optimizer step."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from papo_nb.train.run_folder import PROGRESS_PREFIX
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.training import rewards
from papo_nb.workbook.training.builder import load_datasets, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "papo-nb"

BAD_REWARDS = '''
import math


def one_value(prompts, completions, **kwargs):
    """[1.0] for any batch: TRL broadcasts it over every completion."""
    return [1.0]


def all_nan(prompts, completions, **kwargs):
    return [math.nan] * len(completions)


def words(prompts, completions, **kwargs):
    return ["good"] * len(completions)


def per_prompt(prompts, completions, **kwargs):
    """One value per distinct prompt: right for a batch of one completion, wrong for a group."""
    return [1.0] * len({str(p) for p in prompts})


def nan_in_training(prompts, completions, trainer_state, **kwargs):
    """Fine when called outside training (max_steps 0), NaN for every completion once the trainer calls it."""
    return [math.nan if trainer_state.max_steps else 1.0 for _ in completions]


CALLS = []


def honest(prompts, completions, answer, **kwargs):
    """Right, with None (no reward) for every other completion; records what each call saw."""
    CALLS.append((len({str(p) for p in prompts}), len(completions), len(answer)))
    return [float(a in str(c)) if i % 2 else None for i, (c, a) in enumerate(zip(completions, answer))]
'''


@pytest.fixture
def group_rewards(tmp_path, monkeypatch):
    (tmp_path / "group_rewards.py").write_text(BAD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "group_rewards", raising=False)  # this test's module, not one cached earlier
    return tmp_path


@pytest.mark.model  # the tiny model's tokenizer
@pytest.mark.parametrize(
    "function, problem",
    [
        ("one_value", r"one_value returned 1 values \(\[1.0\]\) for 4 completions; expected 4 on training row 0"),
        ("per_prompt", r"per_prompt returned 1 values .* for 4 completions; expected 4"),
        ("all_nan", r"all_nan returned a value that is not finite \(\[nan, nan, nan, nan\]; None means no reward"),
        ("words", r"words returned 'good', which is not a number"),
    ],
)
def test_the_pre_check_calls_each_reward_on_a_group_and_refuses_what_trl_would_take_silently(
    group_rewards, function, problem
):
    params = load_params(None, [f"reward=[shapes_accuracy, group_rewards:{function}]", "n_train_prompts=4"])
    train, _ = load_datasets(params)
    with pytest.raises(rewards.RewardError, match=rf"parameter 'reward' = 'group_rewards:{function}': {problem}"):
        rewards.check_rewards_on_groups(params, train, load_tokenizer(params))


@pytest.mark.model
def test_an_honest_reward_with_none_passes_and_sees_groups_of_num_generations(group_rewards):
    params = load_params(None, ["reward=[group_rewards:honest]", "num_generations=6", "n_train_prompts=5"])
    train, _ = load_datasets(params)
    rewards.check_rewards_on_groups(params, train, load_tokenizer(params))  # None is "no reward", not an error
    import group_rewards as module

    assert module.CALLS == [(1, 6, 6)] * rewards.PRECHECK_ROWS  # one prompt, num_generations completions, 3 rows


def test_the_run_time_guard_refuses_a_wrong_length_and_nan_and_keeps_the_name():
    import math

    guarded = rewards.guarded("mine:f", lambda prompts, completions, **kw: [1.0])
    assert guarded.__name__ == "<lambda>"  # TRL logs rewards/<__name__>/mean: the wrapper keeps the name
    with pytest.raises(rewards.RewardError, match=r"'mine:f': <lambda> returned 1 values \(\[1.0\]\) for 3 comp"):
        guarded(prompts=["p"] * 3, completions=["a", "b", "c"])

    def nan_reward(prompts, completions, **kwargs):
        return [math.nan] * len(completions)

    from transformers import TrainerState

    with pytest.raises(
        rewards.RewardError, match=r"nan_reward returned a value that is not finite .* optimizer step 4"
    ):
        rewards.guarded("mine:nan", nan_reward)(
            prompts=["p"], completions=["a"], trainer_state=TrainerState(global_step=3)
        )
    assert rewards.guarded("x", nan_reward).__name__ == "nan_reward"
    ok = rewards.guarded("x", lambda prompts, completions, **kw: [0.5, None])
    assert ok(prompts=["p", "p"], completions=["a", "b"]) == [0.5, None]
    with pytest.raises(rewards.RewardError, match=r"for 2 completions; expected 2"):  # completions given positionally
        guarded(["p", "p"], ["a", "b"])

    async def async_nan(prompts, completions, **kwargs):  # TRL runs coroutine rewards on its event loop
        return [math.nan] * len(completions)

    checked = rewards.guarded("mine:async", async_nan)
    assert inspect.iscoroutinefunction(checked)  # so TRL still awaits it
    with pytest.raises(rewards.RewardError, match=r"async_nan returned a value that is not finite"):
        asyncio.run(checked(prompts=["p"], completions=["a"]))


def papo_nb_train(tmp_path: Path, reward: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "OMP_NUM_THREADS": "1",
    }
    settings = [f"reward=[shapes_accuracy, group_rewards:{reward}]", "require_gpu_contract_probe=false", *overrides]
    command = [str(SCRIPT), "train", "--params", str(ROOT / "params" / "smoke_fast.yaml")]
    command += [arg for setting in settings for arg in ("-p", setting)]
    return subprocess.run(
        [*command, "--output-dir", str(tmp_path / "run")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "reward, problem",
    [
        ("one_value", "one_value returned 1 values ([1.0]) for 4 completions; expected 4 on training row 0"),
        ("all_nan", "all_nan returned a value that is not finite ([nan, nan, nan, nan]; None means no reward)"),
        ("nan_in_training", "nan_in_training returned a value that is not finite ([nan, nan, nan, nan]; None means "
         "no reward), while scoring the completions for optimizer step 1"),
    ],
)  # fmt: skip
def test_papo_nb_train_refuses_a_bad_reward_before_any_optimizer_step(group_rewards, reward, problem):
    done = papo_nb_train(group_rewards, reward, "max_steps=2", "save_steps=2")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-4000:]
    where = f"-p reward=[shapes_accuracy, group_rewards:{reward}]"  # where the value was set, as validation says it
    assert f"papo-nb train: error: {where}: parameter 'reward' = 'group_rewards:{reward}': {problem}" in done.stderr
    assert f"{PROGRESS_PREFIX} step " not in output  # no optimizer step ran
    assert not list((group_rewards / "run").glob("checkpoint-*"))
