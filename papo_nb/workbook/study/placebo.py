"""The placebo control on a calibrated study page: is PAPO-G's gain on the shortcut testbed perception, or
any regulariser of its form?

The placebo is PAPO-G at the strongest PAPO-G arm's gamma with a mask that removes no task information: it covers only
background patches, never a patch that shows the square (the testbed's ``square_units`` column, named by
``PAPOGConfig.mask_excluded_column``), filled with the processor's mean colour (``mask_fill="mean"``), since the
testbed's background is black and a black fill over it changes no pixel (its term would be exactly 0). Its perception
KL is real (the masked image differs), its loss is PAPO-G's, only the information the mask removes differs.
``mean_fill_papo_g`` is PAPO-G at the same gamma with the same fill over its usual patches (square included): against
it, the placebo differs only in *where* the mask goes (the masks are drawn from the same generator either way).

A grey patch on a black image is a larger change than a black patch on a black-and-colour one, so at the same gamma
the placebo's term starts several times larger than PAPO-G's. ``placebo_kl_matched`` is the same placebo at the gamma
that makes its term start as large as PAPO-G's (``kl_matched_gamma``: gamma scaled by the ratio of the two arms' mean
perception KL over their first logged steps), so that the term's strength, not only its form, is matched;
``mean_fill_papo_g_kl_matched`` is PAPO-G with the mean fill at that gamma, against which it differs only in where the
mask goes.

On a background that is not black (``testbed:shapes_shortcut_grey``) no fill needs changing:
``placebo_black`` is PAPO-G with its own black fill over background patches only, so it differs from PAPO-G only in
where the mask goes, and ``placebo_black_kl_matched`` is the same at the gamma that matches its starting perception KL
to PAPO-G's (docs/measurements/placebo_background.py).
"""

from __future__ import annotations

from papo_nb.testbed.perception import SQUARE_UNITS
from papo_nb.workbook.config.params import WorkbookParams

PLACEBO, PLACEBO_KL_MATCHED, MEAN_FILL_PAPO_G = "placebo", "placebo_kl_matched", "mean_fill_papo_g"
MEAN_FILL_KL_MATCHED = "mean_fill_papo_g_kl_matched"
PLACEBO_BLACK, PLACEBO_BLACK_KL_MATCHED = "placebo_black", "placebo_black_kl_matched"
# each arm's mask options (its gamma is the strongest PAPO-G arm's, or kl_matched_gamma's); the rest is the page's
ARM_MASKS = {
    PLACEBO: {"mask_fill": "mean", "mask_excluded_column": SQUARE_UNITS},
    PLACEBO_KL_MATCHED: {"mask_fill": "mean", "mask_excluded_column": SQUARE_UNITS},
    MEAN_FILL_PAPO_G: {"mask_fill": "mean"},
    MEAN_FILL_KL_MATCHED: {"mask_fill": "mean"},
    PLACEBO_BLACK: {"mask_fill": "black", "mask_excluded_column": SQUARE_UNITS},
    PLACEBO_BLACK_KL_MATCHED: {"mask_fill": "black", "mask_excluded_column": SQUARE_UNITS},
}
PLACEBO_ARMS = tuple(ARM_MASKS)
# the controls among them (the mean-fill arms are PAPO-G arms)
PLACEBO_CONTROLS = (PLACEBO, PLACEBO_KL_MATCHED, PLACEBO_BLACK, PLACEBO_BLACK_KL_MATCHED)
KL_MATCH_STEPS = 3  # logged steps at the start of training whose perception KL sets the matched gamma


def arm_params(params: WorkbookParams, arm: str) -> WorkbookParams:
    """The page's params with ``arm``'s mask options; refuses an arm that is not a placebo arm."""
    if arm not in ARM_MASKS:
        raise ValueError(f"placebo arm={arm!r} is unknown; allowed: {list(ARM_MASKS)}")
    return params.model_copy(update=ARM_MASKS[arm])


def kl_matched_gamma(gamma: float, papo_logs: list[list[dict]], placebo_logs: list[list[dict]]) -> float:
    """``gamma`` times PAPO-G's mean perception KL over its first ``KL_MATCH_STEPS`` logged steps (every run of
    ``papo_logs``) divided by the placebo's (``placebo_logs``, trained at ``gamma``): the gamma at which the
    placebo's term starts as large as PAPO-G's. Refuses runs that logged no perception KL."""
    means = []
    for name, runs in (("PAPO-G", papo_logs), ("placebo", placebo_logs)):
        values = [row["perception_kl"] for steps in runs for row in steps[:KL_MATCH_STEPS] if "perception_kl" in row]
        if not values or sum(values) <= 0:
            raise ValueError(f"kl_matched_gamma: the {name} runs logged no positive perception_kl ({values})")
        means.append(sum(values) / len(values))
    return gamma * means[0] / means[1]


def check_pairing(ours: dict[int, dict], page: dict[int, dict], seeds: list[int]) -> None:
    """Refuse (ValueError naming the seed and the metrics) unless this run's GRPO (``ours``: seed -> held-out
    scores) scored exactly the page's GRPO (``page``) on every seed of ``seeds``: then the new arms share the page's
    data, masks, warm start and float path, and pair with its runs seed by seed."""
    for seed in seeds:
        if seed not in ours or seed not in page:
            raise ValueError(f"seed {seed}: GRPO ran here: {seed in ours}, on the page: {seed in page}; not paired")
        differ = sorted(k for k in set(page[seed]) | set(ours[seed]) if ours[seed].get(k) != page[seed].get(k))
        if differ:
            raise ValueError(f"seed {seed}: this run's GRPO is not the page's (differs on {differ}); not paired")
