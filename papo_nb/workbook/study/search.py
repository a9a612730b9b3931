"""Gamma where PAPO works, found as the paper found it: search one seed for the gamma that collapses, then run the
PAPO-G arms at fractions of it.

The paper's recipe sits at half the gamma that collapsed its 3B run (0.02 against 0.04, PAPO_FACTS.md). A tiny
policy collapses at another gamma, so the recipe's 0.02 says nothing about the working dose here: the study climbs a
ladder of gammas on one seed until the collapse detector fires (step logs or held-out accuracy far below GRPO's,
``collapse.heldout_verdict``), bisects geometrically between the last healthy gamma and the first collapsed one, and
runs the arms at ``study_gamma_fractions`` of the smallest collapsed gamma found.
"""

from __future__ import annotations

import math
from collections.abc import Callable

FRACTION_NAMES = {0.125: "eighth", 0.25: "quarter", 0.5: "half", 1.0: "x1"}
ENTROPY_TAG = "_entropy"  # PAPO-G with the double entropy loss: the arm's name ends in _entropy<weight>


def fraction_arm(fraction: float) -> str:
    """The arm name of PAPO-G at ``fraction`` of the collapse gamma: ``papo_g_half``, or ``papo_g_x0.3``."""
    return f"papo_g_{FRACTION_NAMES.get(fraction, f'x{fraction:g}')}"


def entropy_arm(arm: str, weight: float) -> str:
    """``arm`` with the double entropy loss at ``weight`` on both terms: ``papo_g_half_entropy0.05``."""
    return f"{arm}{ENTROPY_TAG}{weight:g}"


def is_entropy_arm(arm: str) -> bool:
    """An arm with the double entropy loss: off the dose-response, whose points are PAPO-G without it."""
    return ENTROPY_TAG in arm


def geometric_midpoint(low: float, high: float) -> float:
    """sqrt(low * high) to three significant digits (a readable gamma), or high / 2 from a low of 0."""
    middle = math.sqrt(low * high) if low > 0 else high / 2
    return float(f"{middle:.3g}")


def search_collapse_gamma(
    train: Callable[[float], dict], ladder: list[float], *, healthy: float, steps: int
) -> tuple[list[float], float, bool]:
    """Climb ``ladder`` with ``train(gamma) -> collapse verdict`` until a gamma collapses, then bisect ``steps``
    times between it and the last healthy gamma (``healthy`` below the ladder's first). Returns (gammas tried in
    order, the smallest collapsed gamma, whether any collapsed); with none collapsed, the ladder's largest."""
    tried: list[float] = []
    low, high = healthy, None
    for gamma in sorted(ladder):
        tried.append(gamma)
        if train(gamma)["collapsed"]:
            high = gamma
            break
        low = gamma
    if high is None:
        return tried, max(ladder), False
    for _ in range(steps):
        middle = geometric_midpoint(low, high)
        if middle in (low, high):  # the gammas are as close as three digits tell apart
            break
        tried.append(middle)
        if train(middle)["collapsed"]:
            high = middle
        else:
            low = middle
    return tried, high, True


def entropy_arms(
    weights: list[float], fractions: list[float], collapse_gamma: float, recipe_gamma: float | None
) -> list[tuple[str, float, dict]]:
    """The paper's remedy for collapse as arms (name, gamma, overrides): PAPO-G with the double entropy loss at each
    of ``weights`` on both terms, at ``recipe_gamma`` (None: not there) and at each of ``fractions`` of the collapse
    gamma, beside the plain arms at the same gammas."""
    arms = []
    for weight in weights:
        both = {"original_entropy_weight": weight, "masked_entropy_weight": weight}
        if recipe_gamma is not None:
            arms.append((entropy_arm("papo_g", weight), recipe_gamma, both))
        for fraction in fractions:
            arms.append((entropy_arm(fraction_arm(fraction), weight), float(f"{fraction * collapse_gamma:.4g}"), both))
    return arms
