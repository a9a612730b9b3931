"""The spelling of the ``reward`` parameter, checked at params validation without importing any reward: a shipped
reward's name (``papo_nb.workbook.training.rewards.SHIPPED_REWARDS`` maps each to its functions) or a researcher's
own ``module:function``."""

from __future__ import annotations

import re

SHIPPED_REWARD_NAMES = ("shapes", "shapes_accuracy", "math", "boxed_accuracy")
# Each schema's reward when ``reward`` is empty: what runs used before the parameter existed.
SCHEMA_DEFAULT_REWARD = {"shapes": "shapes", "official": "math"}
_OWN_REWARD = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def reward_spec_problem(spec: str) -> str | None:
    """Why ``spec`` is no shipped reward name nor ``module:function`` (None when it is one)."""
    if spec in SHIPPED_REWARD_NAMES or _OWN_REWARD.fullmatch(spec):
        return None
    names = ", ".join(repr(n) for n in SHIPPED_REWARD_NAMES)
    return f"not a shipped reward ({names}) nor 'module:function' (e.g. 'my_rewards:length_reward')"
