"""The spelling of the ``reward`` parameter, checked at params validation without importing any reward: a shipped
reward's name (``papo_nb.workbook.training.rewards.SHIPPED_REWARDS`` maps each to its functions) or a researcher's
own ``module:function``; and how many functions they stand for, which ``reward_weights`` (TRL's, one per function)
must match."""

from __future__ import annotations

import re

# name -> the reward functions it stands for, in order (training.rewards.SHIPPED_REWARDS holds the functions).
SHIPPED_REWARD_FUNCTIONS = {
    "shapes": ("accuracy_reward", "format_reward"),
    "shapes_accuracy": ("accuracy_reward",),
    "math": ("math_accuracy_reward", "math_format_reward"),
    "boxed_accuracy": ("math_accuracy_reward",),
}
SHIPPED_REWARD_NAMES = tuple(SHIPPED_REWARD_FUNCTIONS)
# Each schema's reward when ``reward`` is empty: what runs used before the parameter existed.
SCHEMA_DEFAULT_REWARD = {"shapes": "shapes", "official": "math"}
_OWN_REWARD = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def reward_specs(reward: list[str], dataset_schema: str) -> list[str]:
    """The ``reward`` entries a run uses: the given ones, or the schema's default."""
    return list(reward) or [SCHEMA_DEFAULT_REWARD[dataset_schema]]


def function_count(reward: list[str], dataset_schema: str) -> int:
    """How many reward functions the entries stand for (one ``reward_weights`` entry each)."""
    return sum(len(SHIPPED_REWARD_FUNCTIONS.get(spec, (spec,))) for spec in reward_specs(reward, dataset_schema))


def reward_spec_problem(spec: str) -> str | None:
    """Why ``spec`` is no shipped reward name nor ``module:function`` (None when it is one)."""
    if spec in SHIPPED_REWARD_NAMES or _OWN_REWARD.fullmatch(spec):
        return None
    names = ", ".join(repr(n) for n in SHIPPED_REWARD_NAMES)
    return f"not a shipped reward ({names}) nor 'module:function' (e.g. 'my_rewards:length_reward')"
