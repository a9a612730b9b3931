"""The ``reward`` parameter: shipped rewards by name or a researcher's own ``module:function``, with weights.

A reward function has TRL's signature, ``f(prompts, completions, **kwargs) -> list[float | None]``; the keyword
arguments carry every dataset column but ``prompt`` (``answer`` among them) as one list entry per completion, and
TRL's ``completion_ids``, ``trainer_state``, ``log_extra`` and ``log_metric``. A name may stand for several
functions (``math``: boxed accuracy and format, weighed 0.9 and 0.1); ``reward_weights`` is TRL's, one weight per
function (empty: each name's own weights, 1 for a function of one's own).

Refused before work: the spelling at params validation (``config.reward_names``), the import in the machine
checks before any run starts (``reward_import_problems``), one call on the first training row before the model
loads (``check_rewards_on_row``); each message names the parameter, the value and the error.
"""

from __future__ import annotations

import importlib

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
    """The reward functions to hand TRL, in order."""
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


def check_rewards_on_row(params, dataset, tokenizer) -> None:
    """Call every reward function once, as TRL calls it, on the first row of ``dataset`` with its ``answer`` as the
    completion; RewardError names the entry when one raises or does not return one float (or None) per completion."""
    from transformers import TrainerState

    row = dataset[0]
    text = str(row.get("answer", ""))
    conversational = isinstance(row["prompt"], list)
    completion = [{"role": "assistant", "content": text}] if conversational else text
    columns = {key: [value] for key, value in row.items() if key not in ("prompt", "completion", "completion_ids")}
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    for spec, function, _ in weighted_rewards(params):
        try:
            result = function(
                prompts=[row["prompt"]],
                completions=[completion],
                completion_ids=[tokenizer(text, add_special_tokens=False)["input_ids"]],
                trainer_state=TrainerState(),
                log_extra=lambda column, values: None,
                log_metric=lambda name, value: None,
                **columns,
            )
        except Exception as exc:
            raise RewardError(
                f"parameter 'reward' = {spec!r}: {function.__name__} failed on the first training row: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        result = list(result) if isinstance(result, (list, tuple)) else result
        if not isinstance(result, list) or len(result) != 1 or not all(_is_reward(v) for v in result):
            raise RewardError(
                f"parameter 'reward' = {spec!r}: {function.__name__} returned {result!r} for one completion; "
                "expected a list of one float (or None) per completion"
            )


def _is_reward(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
