"""The calibrated study's pooled page (``docs/study/shortcut_calibrated``): every warm start at its own collapse
gamma, the paper's remedy for collapse, and the recipe's gamma, against GRPO and every matched control.

``params/study_calibrated.yaml`` runs on each warm start: the collapse gamma searched on the search seed from step
logs alone (each call's verdict and how near each symptom came to firing), PAPO-G at 1/4 and 1/2 of it and at the
recipe's 0.02, the double entropy loss (both terms) at 1/2 and 1x and at 0.02, GRPO, GRPO held back by beta and by the
learning rate, and the KL-matched placebo. The page pools them as ``warm_starts`` pools the one-gamma design (seeds
paired within a warm start) and states that design's verdict beside this one's. ``render`` rewrites the page from its
``runs.json`` and the one-gamma page's.

    .venv/bin/python docs/measurements/warm_starts_shortcut.py calibrated-page CAL0 CAL1 ...   # writes the page
    .venv/bin/python docs/measurements/calibrated_page.py                                      # from its files
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import warm_starts_page

from papo_nb.workbook.study import warm_starts
from papo_nb.workbook.study.collapse import detect_collapse
from papo_nb.workbook.study.drift import PRIMARY
from papo_nb.workbook.study.power import gain_detected
from papo_nb.workbook.study.search import ENTROPY_TAG, search_collapse_gamma

PAGE = warm_starts_page.DOCS_STUDY / "shortcut_calibrated"
ONE_GAMMA_PAGE = warm_starts_page.DOCS_STUDY / "shortcut_warm_starts"
GRPO = warm_starts.GRPO
PLAIN = ("papo_g_quarter", "papo_g_half", "papo_g")  # PAPO-G at 1/4 and 1/2 of the collapse gamma, and at 0.02
CONTROLS = ("grpo_beta", "grpo_lr", "placebo_kl_matched")  # every control PAPO-G must beat besides GRPO
GAMMA_COLUMNS = ("papo_g_quarter", "papo_g_half", "placebo_kl_matched")  # each warm start's own gammas
HALF_AGAINST_CONTROLS = tuple(("papo_g_half", control) for control in CONTROLS)
LABELS = {"papo_g_quarter": "1/4", "papo_g_half": "1/2", "papo_g_x1": "1x", "papo_g": "0.02 (the recipe)"}


def remedy_arms(data: dict) -> list[str]:
    """The double-entropy arms that ran (``papo_g_half_entropy0.05``...), by weight, then 1/2, 1x, recipe."""
    names = {r["arm"] for b in data["warm_starts"] for r in b["runs"] if ENTROPY_TAG in r["arm"]}
    order = ["papo_g_half", "papo_g_x1", "papo_g"]
    return sorted(names, key=lambda a: (float(a.split(ENTROPY_TAG)[1]), order.index(a.split(ENTROPY_TAG)[0])))


def label(arm: str) -> str:
    """``1/2``, ``1x + entropy 0.05``: an arm's gamma as a fraction of its warm start's collapse gamma."""
    base, _, weight = arm.partition(ENTROPY_TAG)
    return LABELS[base] + (f" + entropy {weight}" if weight else "")


def arm_row(data: dict, arm: str) -> dict:
    """One arm pooled over every warm start: its runs and collapsed runs, its own end minus the warm start, and its
    pooled paired contrast against GRPO and each of ``CONTROLS`` (``warm_starts.contrast_rows``)."""
    runs = warm_starts.arm_runs(data, arm)
    against = {control: warm_starts.contrast_rows(data, arm, control)[-1] for control in (GRPO, *CONTROLS)}
    beats = [c for c, row in against.items() if c != GRPO and gain_detected(row)]
    return {"arm": arm, "runs": len(runs), "collapsed": sum(r["collapsed"] for r in runs),
            "own_drift": warm_starts.drift_rows(data, arm=arm)[-1], "against": against,
            "beats_every_control": len(beats) == len(CONTROLS)}  # fmt: skip


def undoes(row: dict) -> bool:
    """The arm recovers GRPO's drift: it beats GRPO (a positive difference the paired test detects) and its own end
    is not detectably below the warm start's score (the upper end of its 95% CI reaches 0)."""
    against, own = row["against"][GRPO], row["own_drift"]
    return gain_detected(against) and own["drift"] + own["drift_ci95"] >= 0


def verdict(data: dict) -> str:
    """Two sentences from the pooled numbers: GRPO's drift and whether PAPO-G, plain or with the double entropy loss,
    undoes it at each warm start's own gamma (with each arm's collapsed runs); then whether any arm beats every
    control, with the half-gamma arm's contrasts."""
    drift = warm_starts.drift_rows(data)[-1]
    rows = {arm: arm_row(data, arm) for arm in (*PLAIN, *remedy_arms(data))}
    said = "; ".join(
        f"{label(arm)} {warm_starts.effect(r['against'][GRPO])}, {r['collapsed']} of {r['runs']} collapsed"
        for arm, r in rows.items()
    )
    recovering = [label(arm) for arm, r in rows.items() if undoes(r)]
    first = (
        f"GRPO's drift on {PRIMARY}, pooled over {drift['seeds']} runs on {len(data['warm_starts'])} warm starts, is "
        f"{drift['drift']:+.3f} +/- {drift['drift_ci95']:.3f} (p = {drift['p_value']:.2g}); at each warm start's own "
        f"collapse gamma PAPO-G {'undoes it at ' + ', '.join(recovering) if recovering else 'does not undo it'} "
        f"(against GRPO: {said})."
    )
    winners = [label(arm) for arm, r in rows.items() if r["beats_every_control"]]
    half = rows["papo_g_half"]["against"]
    controls = "; ".join(f"- {c} {warm_starts.effect(half[c])}" for c in CONTROLS)
    second = (
        f"Beating every control (GRPO held back by beta and by the learning rate, the KL-matched placebo): "
        f"{'shown at ' + ', '.join(winners) if winners else 'shown by no PAPO-G arm'} (1/2: {controls})."
    )
    return f"{first} {second}"


def rebuilt_search(build: dict, ladder: list[float], healthy: float, steps: int) -> tuple[list[float], float, bool]:
    """The warm start's collapse search redone (``search.search_collapse_gamma`` with the params' ``ladder``,
    ``healthy`` gamma and bisection ``steps``), each call answered by the collapse detector on the step logs that
    call recorded, no held-out item: (gammas tried, collapse gamma, found). A call the records lack raises."""
    calls = {call["gamma"]: call["step_logs"] for call in build["search"]}
    return search_collapse_gamma(lambda gamma: detect_collapse(calls[gamma]), ladder, healthy=healthy, steps=steps)


def _search_cell(build: dict) -> str:
    def call(c: dict) -> str:
        peak = max(c["margin"].values()) if c["margin"] else math.nan
        return f"{c['gamma']:g} {c['mode'] or 'healthy'} ({peak:.2f})"

    return ", ".join(call(c) for c in build["search"])


def _arm_line(row: dict) -> str:
    own = row["own_drift"]
    cells = [f"{r['diff']:+.3f} +/- {r['diff_ci95']:.3f} (p {r['p_value']:.2g})" for r in row["against"].values()]
    return (
        f"| {label(row['arm'])} | `{row['arm']}` | {row['collapsed']} of {row['runs']} | "
        f"{own['drift']:+.3f} +/- {own['drift_ci95']:.3f} | {' | '.join(cells)} | "
        f"{row['against'][GRPO]['mde']:.3f} | {'yes' if row['beats_every_control'] else 'no'} |"
    )


def render(data: dict, one_gamma: dict) -> str:
    """The page's markdown, from its data and the one-gamma page's data alone."""
    builds, arms = data["warm_starts"], (*PLAIN, *remedy_arms(data))
    lines = [
        "# Each warm start at its own collapse gamma, the paper's remedy and the recipe's gamma (issue 56)",
        "",
        "Generated by `docs/measurements/warm_starts_shortcut.py calibrated-page` "
        f"(`docs/measurements/calibrated_page.py`) from `{warm_starts.RUNS_FILE}` beside it. "
        f"Design: `{data['params']}` "
        "(40 steps, LoRA, 5 seeds, one held-out set: 64 prior-breaking and 32 prior-consistent items, avg@4) on each "
        "warm start of `testbed:shapes_shortcut` (build 0: the shipped weights; others: fresh builds of their seed). "
        "Each warm start's collapse gamma is searched on seed 100 (no arm's) from step logs alone: the ladder 0.2, "
        "1, 5, 20 until a call collapses, then two geometric bisections. Where no call collapses the arms run at "
        "fractions of the ladder's top, a lower bound on that warm start's collapse gamma. Pooled rows pair seeds "
        "within a warm start.",
        "",
        "Each search call reads: gamma, verdict (its largest symptom over that symptom's firing level; a call "
        "collapses only when the KL blow-up or the reward drop fires with another symptom, so a value past 1 can "
        "stay healthy).",
        "",
        "| warm start | weights (SHA-256) | collapse gamma | search calls | 1/4 | 1/2 | KL-matched placebo |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {b['build']} | `{b['weights_sha256'][:12]}` | {b['collapse_gamma']:g}"
            f"{'' if b['collapse_found'] else ' (none collapsed: the top)'} | {_search_cell(b)} | "
            f"{' | '.join(warm_starts_page.arm_gammas(b, arm) for arm in GAMMA_COLUMNS)} |"
            for b in builds
        ),
        "",
        "## Verdict",
        "",
        verdict(data),
        "",
        f"The one-gamma design ([{ONE_GAMMA_PAGE.name}](../{ONE_GAMMA_PAGE.name}/{warm_starts.PAGE_FILE}): every "
        "warm start at 1.675, half the shipped build's collapse gamma) said: "
        + warm_starts.two_sentence_verdict(one_gamma),
        "",
        *warm_starts_page.drift_section(data),
        "",
        f"## Every PAPO-G arm, pooled ({PRIMARY})",
        "",
        "Differences are paired by (warm start, seed), mean +/- 95% CI (t-test p); own drift is the arm's end minus "
        "its warm start's score before RL; MDE at 80% power against GRPO.",
        "",
        "| gamma | arm | collapsed | own drift | - GRPO | - grpo_beta | - grpo_lr | - KL-matched placebo | MDE "
        "| beats every control |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_arm_line(arm_row(data, arm)) for arm in arms),
        "",
        f"## Per warm start ({PRIMARY})",
        "",
        warm_starts_page.contrast_table(data, PRIMARY, True, [*((arm, GRPO) for arm in arms), *HALF_AGAINST_CONTROLS]),
    ]
    for metric in warm_starts.METRICS[1:]:
        contrasts = [(arm, GRPO) for arm in arms]
        lines += ["", f"## {metric} (pooled)", "", warm_starts_page.contrast_table(data, metric, False, contrasts)]
    return "\n".join(lines) + "\n"


def write_page(outs: list[Path], page: Path = PAGE, one_gamma_page: Path = ONE_GAMMA_PAGE) -> Path:
    """Every arm's runs and each warm start's search from ``outs``, written with the page beside the one-gamma page's
    verdict (``warm_starts_page.write_page``); returns the page's path."""
    one_gamma = json.loads((one_gamma_page / warm_starts.RUNS_FILE).read_text())
    return warm_starts_page.write_page(page, outs, arms=None, render_page=lambda data: render(data, one_gamma))


def rerender(page: Path = PAGE, one_gamma_page: Path = ONE_GAMMA_PAGE) -> Path:
    """The page rewritten from its ``runs.json`` and the one-gamma page's."""
    data, one_gamma = (json.loads((p / warm_starts.RUNS_FILE).read_text()) for p in (page, one_gamma_page))
    (page / warm_starts.PAGE_FILE).write_text(render(data, one_gamma))
    return page / warm_starts.PAGE_FILE


if __name__ == "__main__":
    print(rerender(*(Path(p) for p in sys.argv[1:])))
