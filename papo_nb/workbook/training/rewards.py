"""The ``reward`` parameter: shipped rewards by name or a researcher's own ``module:function``, with weights.

A reward function has TRL's signature, ``f(prompts, completions, **kwargs) -> list[float | None]``; the keyword
arguments carry every dataset column but ``prompt`` (``answer`` among them) as one list entry per completion, and
TRL's ``completion_ids``, ``trainer_state``, ``log_extra`` and ``log_metric``. A name may stand for several
functions (``math``: boxed accuracy and format, weighed 0.9 and 0.1); ``reward_weights`` is TRL's, one weight per
function (empty: each name's own weights, 1 for a function of one's own).

Refused before work: the spelling at params validation (``config.reward_names``), the import in the machine
checks before any run starts (``reward_import_problems``), a call on a group of ``num_generations`` completions
for each of the first training rows before the model loads (``check_rewards_on_groups``), and every call in
training (``guarded``): a raise, a wrong length, a non-number or a non-finite value is refused; each message names
the parameter, the value, the function and what is wrong.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math

from papo_nb.testbed.rewards import accuracy_reward, format_reward
from papo_nb.workbook.config.params import ParamsError
from papo_nb.workbook.config.reward_names import reward_specs
from papo_nb.workbook.recipe import reward as math_reward

# name -> (function, weight) of each function it stands for (the names: config.reward_names.SHIPPED_REWARD_NAMES).
# ``shapes``: the synthetic task's exact <answer> match plus its shaped format credit (papo_nb.testbed.rewards);
# ``math``: the official PAPO reward, 0.9 boxed accuracy + 0.1 format (papo_nb.workbook.recipe.reward);
# ``boxed_accuracy``: its accuracy term alone.
SHIPPED_REWARDS = {
    "shapes": ((accuracy_reward, 1.0), (format_reward, 1.0)),
    "shapes_accuracy": ((accuracy_reward, 1.0),),
    "math": tuple(zip(math_reward.REWARD_FUNCS, math_reward.REWARD_WEIGHTS, strict=True)),
    "boxed_accuracy": ((math_reward.math_accuracy_reward, 1.0),),
}


class RewardError(ParamsError):
    """A reward that cannot be imported or fails on a row; the message names the parameter and the value."""


def _import(spec: str, parameter: str = "reward"):
    module_name, function_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of the user's module is theirs to see
        raise RewardError(
            f"parameter {parameter!r} = {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc} "
            "(is its folder on PYTHONPATH?)"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(
            f"parameter {parameter!r} = {spec!r}: module {module_name!r} has no function {function_name!r}"
        )
    return function


def weighted_rewards(params) -> list[tuple[str, object, float]]:
    """``(entry, function, weight)`` of every reward function the run trains on, shipped names expanded; the weights
    are ``reward_weights`` when set, else each name's own."""
    chosen = []
    for spec in reward_specs(params.reward, params.dataset_schema):
        parts = SHIPPED_REWARDS.get(spec) or ((_import(spec), 1.0),)
        chosen += [(spec, function, weight) for function, weight in parts]
    if params.reward_weights:
        chosen = [(spec, function, w) for (spec, function, _), w in zip(chosen, params.reward_weights, strict=True)]
    return chosen


def reward_functions(params) -> list:
    """The reward functions of the run, in order, as written (``guarded_reward_functions``: as TRL gets them)."""
    return [function for _, function, _ in weighted_rewards(params)]


def reward_weights(params) -> list[float] | None:
    """TRL's ``reward_weights`` when ``reward`` or ``reward_weights`` is set; None keeps the schema's default (and,
    on the official schema, a recipe's)."""
    if not (params.reward or params.reward_weights):
        return None
    return [weight for _, _, weight in weighted_rewards(params)]


def reward_import_problems(params) -> list[str]:
    """The machine check: every ``reward`` entry imports here (an empty list when all do)."""
    try:
        weighted_rewards(params)
    except RewardError as exc:
        return [str(exc)]
    return []


PRECHECK_ROWS = 3  # rows the pre-check draws a group for: enough to meet more than one answer, cheap for a judge
# The group's completions: the answer itself, nothing, and the two answer formats the shipped rewards grade.
PRECHECK_COMPLETIONS = ("{answer}", "", "<answer>{answer}</answer>", "\\boxed{{{answer}}}")


def check_rewards_on_groups(params, dataset, tokenizer) -> None:
    """Call every reward function as TRL calls it, before the model loads: once for each of the first rows of
    ``dataset``, on its prompt with ``num_generations`` completions (the answer, an empty text, the answer in the
    two formats). RewardError names the entry and the function when one raises, or does not return one finite number
    (or None) per completion."""
    from transformers import TrainerState

    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    group = params.num_generations
    for index in range(min(PRECHECK_ROWS, len(dataset))):
        row = dataset[index]
        answer = str(row.get("answer", ""))
        texts = [PRECHECK_COMPLETIONS[i % len(PRECHECK_COMPLETIONS)].format(answer=answer) for i in range(group)]
        conversational = isinstance(row["prompt"], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [v] * group for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        for spec, function, _ in weighted_rewards(params):
            where = f"on training row {index} ({group} completions of its prompt, num_generations)"
            try:
                result = function(
                    prompts=[row["prompt"]] * group,
                    completions=completions,
                    completion_ids=[tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
                    trainer_state=TrainerState(),
                    log_extra=lambda column, values: None,
                    log_metric=lambda name, value: None,
                    **columns,
                )
            except Exception as exc:
                raise RewardError(
                    f"parameter 'reward' = {spec!r}: {function.__name__} failed {where}: {type(exc).__name__}: {exc}"
                ) from None
            if (problem := reward_values_problem(result, group)) is not None:
                raise RewardError(f"parameter 'reward' = {spec!r}: {function.__name__} {problem} {where}")


def reward_values_problem(result, expected: int) -> str | None:
    """What is wrong with a reward function's return value for ``expected`` completions (None: nothing): TRL
    would spread a single value over the batch, and take NaN for "no reward" silently."""
    if not isinstance(result, (list, tuple)):
        return f"returned a {type(result).__name__} ({_short(result)}), not a list of one value per completion,"
    if len(result) != expected:
        return f"returned {len(result)} values ({_short(result)}) for {expected} completions; expected {expected}"
    bad = [value for value in result if not _is_reward(value)]
    if bad:
        return f"returned {_short(bad[0])}, which is not a number (a float, or None for no reward),"
    if any(value is not None and not math.isfinite(value) for value in result):
        return f"returned a value that is not finite ({_short(result)}; None means no reward),"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_reward(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def guarded(spec: str, function):
    """``function`` as TRL calls it during training, its every return value checked like the pre-check's: a wrong
    length, a non-number or a non-finite value raises RewardError (naming the entry, the function and the step)
    before the loss, hence any optimizer step, uses it."""

    def check(result, completions, trainer_state=None):
        problem = reward_values_problem(result, len(completions))
        if problem is not None:
            step = getattr(trainer_state, "global_step", None)
            at = f" while scoring the completions for optimizer step {step + 1}" if step is not None else ""
            raise RewardError(f"parameter 'reward' = {spec!r}: {function.__name__} {problem}{at}")
        return result

    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def checked_async(*args, **kwargs):
            return check(await function(*args, **kwargs), _completions(args, kwargs), kwargs.get("trainer_state"))

        return checked_async

    @functools.wraps(function)
    def checked(*args, **kwargs):
        return check(function(*args, **kwargs), _completions(args, kwargs), kwargs.get("trainer_state"))

    return checked


def _completions(args: tuple, kwargs: dict) -> list:
    """The completions of a reward call: TRL passes them by keyword; positionally they follow the prompts."""
    return kwargs["completions"] if "completions" in kwargs else args[1]


def guarded_reward_functions(params) -> list:
    """The reward functions to hand TRL, each checked on every call (``guarded``)."""
    return [guarded(spec, function) for spec, function, _ in weighted_rewards(params)]
