"""The recipes a params file can name (``recipe: papo_g_3b``): the adapter's PAPO-G presets plus the GRPO baselines.

``papo_nb.papo.recipes`` is the single source of the PAPO-G values. A named recipe supplies, to the PAPOGConfig the
builder makes, every preset field the workbook's params do not expose (clip ranges, weight decay, warmup, top_p,
gradient clipping); the fields the params do expose come from the params file, and ``recipe_deviations`` lists where a
file differs from its recipe (a test keeps the shipped files at zero deviations).

Official sources, MikeWangWZHL/PAPO at fb63bf4: ``sh3g``/``sh7g`` = ``examples/papo_grpo/qwen2_5_vl_{3b,7b}_grpo.sh``,
``cfg`` = ``examples/configs/config_grpo.yaml``, ``actor`` = ``verl/workers/actor/config.py``.
"""

from __future__ import annotations

from typing import Any

from papo_nb.papo.recipes import RECIPES, recipe
from papo_nb.vppo.recipes import VPPO_RECIPES

# GRPO baselines: the PAPO-G preset of the same size with the perception and double-entropy terms off (sh3g:21 uses
# cfg, which has no perception term). sh7g:21 loads config_grpo_papo.yaml without turning its perception term
# (use_kl_prcp true, coef 0.01) off, so the 7B baseline script as published is not plain GRPO; grpo_7b here is.
GRPO_OFF = {"perception_loss_weight": 0.0, "original_entropy_weight": 0.0, "masked_entropy_weight": 0.0}
BASELINES = {"grpo_3b": "papo_g_3b", "grpo_7b": "papo_g_7b"}
# An optimiser setting of the official actor the PAPO-G presets do not carry (not a PAPO value): the dual clip
# C = 3 (actor:91 clip_ratio_dual, applied for negative advantages, core_algos.py compute_policy_loss), which TRL's
# `delta` reproduces (it caps the ratio at 3; with advantage > 0 the 1 + epsilon_high clip binds first anyway).
ACTOR_EXTRAS = {"delta": 3.0}
RECIPE_NAMES = ("", *RECIPES, *BASELINES, *VPPO_RECIPES)


def recipe_fields(name: str) -> dict[str, Any]:
    """PAPOGConfig fields of a named recipe (the preset, the baseline switch, the actor extras)."""
    if name in BASELINES:
        return {**recipe(BASELINES[name]), **GRPO_OFF, **ACTOR_EXTRAS}
    if name in VPPO_RECIPES:  # huaixuheqing/VPPO-RL runs on the same EasyR1 actor: the same dual clip
        return {**VPPO_RECIPES[name], **ACTOR_EXTRAS}
    if name not in RECIPES:
        raise ValueError(
            f"parameter 'recipe' = {name!r}: unknown; allowed: {', '.join(repr(n) for n in RECIPE_NAMES)}"
        )
    return {**recipe(name), **ACTOR_EXTRAS}


def recipe_deviations(params) -> dict[str, tuple[Any, Any]]:
    """{field: (params value, recipe value)} for every exposed field where the params differ from their recipe."""
    if not params.recipe:
        return {}
    exposed = type(params).model_fields
    return {
        k: (getattr(params, k), v)
        for k, v in recipe_fields(params.recipe).items()
        if k in exposed and getattr(params, k) != v
    }


def config_fields(params) -> dict[str, Any]:
    """The recipe's fields the params do not expose; {} without a recipe."""
    if not params.recipe:
        return {}
    exposed = type(params).model_fields
    return {k: v for k, v in recipe_fields(params.recipe).items() if k not in exposed}
