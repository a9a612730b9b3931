"""The method study's tables for notebook 04, from a finished ``Study``: the sweep, collapse per run, each arm's
headline accuracy beside chance, and the chance level the claims are read against."""

from __future__ import annotations

from statistics import mean

from papo_nb.testbed.perception import CHANCE_VISION, testbed_name
from papo_nb.testbed.shapes import COLOURS, MAX_SHAPES
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.study.arms import Study, eval_dataset, held_out_splits
from papo_nb.workbook.study.stats import at_chance

HEADLINE = "avg_at_k/original/vision"  # the number each arm is read by: avg@k on vision-dependent held-out items
# the synthetic shapes task: a guess among 4 colours, 1-4 shapes, or left/right, one kind in three each
SHAPES_CHANCE = (1 / len(COLOURS) + 1 / MAX_SHAPES + 1 / 2) / 3


def study_chance(params: WorkbookParams) -> tuple[float, int]:
    """(a guesser's accuracy on the vision-dependent held-out items, how many there are). A dataset whose chance is
    not known here gets 0: only a policy that answers nothing right counts as at chance on it."""
    vision_items = len(held_out_splits(eval_dataset(params)).get("vision", []))
    if testbed_name(params.dataset) is not None:
        chance = CHANCE_VISION
    else:
        chance = SHAPES_CHANCE if params.dataset == "synthetic" else 0.0
    return chance, vision_items


def headline_rows(study: Study, chance: float, vision_items: int) -> list[dict]:
    """Per arm: its mean ``HEADLINE`` accuracy over seeds, chance, and whether it beats chance (``at_chance``)."""
    rows = []
    for arm, by_seed in study.scores().items():
        values = [scores[HEADLINE] for scores in by_seed.values() if HEADLINE in scores]
        rows.append({
            "arm": arm,
            "seeds": len(values),
            "avg_at_k vision-dependent": mean(values) if values else float("nan"),
            "chance": chance,
            "above chance": not at_chance(values, chance, vision_items),
        })  # fmt: skip
    return rows


def sweep_rows(study: Study) -> list[dict]:
    """One row per sweep run: its gamma, whether and when the detector fired, with which symptoms."""
    return [
        {
            "gamma": r.gamma,
            "seed": r.seed,
            "collapsed": r.collapse["collapsed"],
            "step": r.collapse["step"],
            "mode": r.collapse["mode"],
            "symptoms": ", ".join(r.collapse["symptoms"]),
            # a search run's verdict weighs no held-out evidence: its detected_by is None, the step logs' alone
            "detected_by": ", ".join(
                r.collapse.get("detected_by") or (["step logs"] if r.collapse["collapsed"] else [])
            ),
            # how near each hacking symptom came to firing (collapse.collapse_margin; 1.0 fires); a page's runs
            # recorded before the margin existed show none
            **({"margin": _margin(r.collapse["margin"])} if "margin" in r.collapse else {}),
            "avg_at_k (all)": r.scores["avg_at_k/original/all"],
            "run_id": r.run_id,
        }
        for r in study.sweep
    ]


def _margin(margin: dict[str, float]) -> str:
    return ", ".join(f"{symptom.removesuffix('_rise')} {value:.2f}" for symptom, value in margin.items())


def collapse_rows(study: Study) -> list[dict]:
    """One row per arm run: the collapse verdict and its wall time."""
    return [
        {
            "arm": r.arm,
            "seed": r.seed,
            "gamma": r.gamma,
            "collapsed": r.collapse["collapsed"],
            "step": r.collapse["step"],
            "mode": r.collapse["mode"],
            "seconds": round(r.seconds),
        }
        for r in study.runs
    ]
