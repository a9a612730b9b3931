"""The pooled pages' statistics: GRPO's drift, and PAPO-G against GRPO, against each matched control and against
the KL-matched placebo, on each independently built warm start and pooled over them.

Each warm start is one build of the testbed (its build seed, its weights' SHA-256, its card); each run is one (arm,
seed) of the same params and held-out set, paired by seed within its warm start. Pooled: every (warm start, seed)
pair, which treats seeds of one policy as independent of another's; and between warm starts, one mean difference per
warm start (a t-test over so few policies has little power, so the count of warm starts whose mean difference is
positive stands beside it). The pages themselves (Markdown, writing, rerendering) are built in ``docs/measurements/``
(``warm_starts_page.py`` and the pages that reuse it); here: collecting the runs, the paired statistics, the pooled
verdicts the study summary states, and notebook 04's note on one warm start (``one_warm_start_note``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import mean

import yaml
from scipy import stats as scipy_stats

from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.study.collapse import SYMPTOMS
from papo_nb.workbook.study.drift import CONSISTENT, EQUIVALENCE_MARGIN, PRIMARY
from papo_nb.workbook.study.errors import DECOY, PRIOR
from papo_nb.workbook.study.power import effect_verdict, gain_detected
from papo_nb.workbook.study.search import ENTROPY_TAG
from papo_nb.workbook.study.stats import equivalence_test, mean_ci, paired_tests_with_power

METRICS = (PRIMARY, "avg_at_k/gap/vision", CONSISTENT, PRIOR, DECOY)
GRPO, PAPO_G = "grpo", "papo_g_half"
# (treatment, control): PAPO-G against GRPO and every control; the last, where only the mask's place differs
CONTRASTS = (
    (PAPO_G, GRPO),
    (PAPO_G, "grpo_beta"),
    (PAPO_G, "grpo_lr"),
    (PAPO_G, "placebo_kl_matched"),
    ("mean_fill_papo_g_kl_matched", "placebo_kl_matched"),
)
ARMS = tuple(dict.fromkeys(arm for pair in CONTRASTS for arm in pair))
RUNS_FILE, PAGE_FILE = "runs.json", "results.md"
SEARCH_LOG_KEYS = ("step", *(metric for metric, _ in SYMPTOMS.values()))  # what the collapse detector reads


def collect(outs: list[Path], controls_page: Path | None = None, arms: tuple[str, ...] | None = ARMS) -> dict:
    """The page's data: the params file its runs share, and one entry per warm start (its build seed, weights' hash,
    SFT steps, start scores and runs: ``arms`` only, every arm where None, with ``METRICS`` and the collapse
    verdict; where the record holds them, its collapse search's calls), from each ``OUT/results.json``, after the
    controls page's own runs where ``controls_page`` is given (its build 0)."""
    records = [json.loads((out / "results.json").read_text()) for out in outs]
    if controls_page is not None:
        seed_0 = {
            "params": json.loads((controls_page / "rebuild.json").read_text())["params"],
            "card": json.loads((controls_page / "testbed_card.json").read_text()),
            "start_scores": json.loads((controls_page / "start_scores.json").read_text()),
            "runs": json.loads((controls_page / "runs.json").read_text()),
        }
        records.insert(0, seed_0)
    params = {record["params"] for record in records}
    if len(params) != 1:
        raise ValueError(
            f"the warm starts' runs used different params files {sorted(params)}; a page pairs one design"
        )
    return {"params": params.pop(), "warm_starts": [_warm_start(record, arms) for record in records]}


def _warm_start(record: dict, arms: tuple[str, ...] | None) -> dict:
    card = record["card"]
    runs = [
        {"arm": r["arm"], "seed": r["seed"], "gamma": r["gamma"], "collapsed": bool(r["collapse"]["collapsed"]),
         "scores": {m: r["scores"][m] for m in METRICS if m in r["scores"]}}
        for r in record["runs"] if arms is None or r["arm"] in arms
    ]  # fmt: skip
    build = {"build": card["seed"], "weights_sha256": card["weights_sha256"], "sft_steps": card["sft_steps"],
             "start_scores": {m: record["start_scores"][m] for m in METRICS if m in record["start_scores"]},
             "runs": runs}  # fmt: skip
    if "search" in record:  # the calls in the order made, each with the step logs the detector read
        build["collapse_gamma"], build["collapse_found"] = record["collapse_gamma"], record["collapse_found"]
        build["search"] = [
            {"gamma": r["gamma"], "seed": r["seed"], "collapsed": bool(r["collapse"]["collapsed"]),
             "mode": r["collapse"]["mode"], "margin": r["collapse"]["margin"],
             "step_logs": [{k: v for k, v in row.items() if k in SEARCH_LOG_KEYS} for row in r["step_logs"]]}
            for r in record["search"]
        ]  # fmt: skip
    return build


def arm_runs(data: dict, arm: str) -> list[dict]:
    """Every run of ``arm`` on the page, warm start by warm start."""
    return [r for build in data["warm_starts"] for r in build["runs"] if r["arm"] == arm]


def paired(build: dict, treatment: str, control: str, metric: str) -> tuple[list[float], list[float]]:
    """(treatment, control) scores over the seeds both arms finished on one warm start (NaN scores left out)."""
    by_arm = {
        arm: {r["seed"]: r["scores"].get(metric, math.nan) for r in build["runs"] if r["arm"] == arm}
        for arm in (treatment, control)
    }
    seeds = [s for s in sorted(set(by_arm[treatment]) & set(by_arm[control])) if
             math.isfinite(by_arm[treatment][s]) and math.isfinite(by_arm[control][s])]  # fmt: skip
    return [by_arm[treatment][s] for s in seeds], [by_arm[control][s] for s in seeds]


def contrast_rows(data: dict, treatment: str, control: str, metric: str = PRIMARY) -> list[dict]:
    """One row per warm start and one pooled: ``treatment`` - ``control`` on ``metric``, paired by seed."""
    rows, ours, theirs, means = [], [], [], []
    for build in data["warm_starts"]:
        a, b = paired(build, treatment, control, metric)
        collapsed = sum(r["collapsed"] for r in build["runs"] if r["arm"] == treatment)
        rows.append({"label": f"warm start {build['build']}", "collapsed": collapsed, **_contrast(a, b)})
        ours, theirs = ours + a, theirs + b
        if a:
            means.append(mean(x - y for x, y in zip(a, b)))
    pooled = {"label": "pooled", "collapsed": sum(r["collapsed"] for r in rows), **_contrast(ours, theirs)}
    pooled["equivalence_p"] = equivalence_test(ours, theirs, EQUIVALENCE_MARGIN)["p_value"]
    pooled["between_p"] = float(scipy_stats.ttest_1samp(means, 0.0).pvalue) if len(set(means)) > 1 else math.nan
    pooled["positive_warm_starts"] = f"{sum(m > 0 for m in means)} of {len(means)}"
    return rows + [pooled]


def _contrast(treatment: list[float], control: list[float]) -> dict:
    if not treatment:
        return {"pairs": 0, "diff": math.nan, "diff_ci95": math.nan, "p_value": math.nan, "sign_p": math.nan,
                "wilcoxon_p": math.nan, "mde": math.nan}  # fmt: skip
    return paired_tests_with_power(treatment, control)


def drift_rows(data: dict, metric: str = PRIMARY, arm: str = GRPO) -> list[dict]:
    """``arm``'s end minus its warm start's score before RL, per warm start and pooled, with a one-sample t-test."""
    rows, pooled = [], []
    for build in data["warm_starts"]:
        ends = [r["scores"][metric] for r in build["runs"] if r["arm"] == arm and metric in r["scores"]]
        drifts = [end - build["start_scores"][metric] for end in ends]
        rows.append(_drift(f"warm start {build['build']}", build["start_scores"][metric], drifts))
        pooled += drifts
    return rows + [_drift("pooled", math.nan, pooled)]


def _drift(label: str, start: float, drifts: list[float]) -> dict:
    centre, half = mean_ci(drifts)
    p_value = float(scipy_stats.ttest_1samp(drifts, 0.0).pvalue) if len(set(drifts)) > 1 else math.nan
    return {"label": label, "start": start, "end": start + centre, "drift": centre, "drift_ci95": half,
            "p_value": p_value, "seeds": len(drifts)}  # fmt: skip


def effect(row: dict) -> str:
    return effect_verdict(row["diff"], row["p_value"], row["mde"])


def two_sentence_verdict(data: dict) -> str:
    """Two sentences from the pooled numbers: GRPO's drift and PAPO-G against it; then whether the gain is
    perception-specific, which needs PAPO-G to beat every control (a positive difference the paired test detects)
    and its mask to beat the placebo's at the same fill (``CONTRASTS``' last, where only the mask's place differs)."""
    *per_warm_start, drift = drift_rows(data)
    pooled = {pair: contrast_rows(data, *pair)[-1] for pair in CONTRASTS}
    against_grpo = pooled[CONTRASTS[0]]
    runs = len(arm_runs(data, PAPO_G))
    negative = f"negative on {sum(r['drift'] < 0 for r in per_warm_start)} of {len(per_warm_start)}"
    first = (
        f"GRPO's drift on {PRIMARY}, pooled over {drift['seeds']} runs on {len(per_warm_start)} warm starts, is "
        f"{drift['drift']:+.3f} +/- {drift['drift_ci95']:.3f} (p = {drift['p_value']:.2g}; {negative}); "
        f"PAPO-G ({PAPO_G}) against GRPO: {effect(against_grpo)}, {against_grpo['collapsed']} of {runs} PAPO-G runs "
        "collapsed."
    )
    beats = {pair: gain_detected(r) for pair, r in pooled.items()}
    place = pooled[CONTRASTS[-1]]
    specific = all(beats.values())
    controls = "; ".join(
        f"against {control} {effect(r)}"
        for (treatment, control), r in pooled.items() if treatment == PAPO_G and control != GRPO
    )  # fmt: skip
    second = (
        f"Perception-specific: {'shown' if specific else 'not shown'} ({controls}; its mask against the placebo's at "
        f"the same fill {effect(place)}, TOST +-{EQUIVALENCE_MARGIN} "
        f"p = {place['equivalence_p']:.2g})."
    )
    return f"{first} {second}"


def pooled_pages(root: Path) -> list[tuple[Path, dict]]:
    """(folder, data) of every page under ``root`` that ``write_page`` wrote (its ``runs.json`` lists warm starts)."""
    pages = []
    for runs in sorted(Path(root).glob(f"*/{RUNS_FILE}")):
        data = json.loads(runs.read_text())
        if isinstance(data, dict) and "warm_starts" in data:
            pages.append((runs.parent, data))
    return pages


def finetuning_of(data: dict, root: Path) -> str:
    """The finetuning of a pooled page's params file (``data["params"]``, relative to the project: the nearest folder
    above ``root``, the pages' folder, that holds it), with the workbook's default where the file leaves it out."""
    projects = [folder for folder in Path(root).resolve().parents if (folder / data["params"]).is_file()]
    if not projects:
        raise FileNotFoundError(f"pooled page params {data['params']!r}: no such file in any folder above {root}")
    text = (projects[0] / data["params"]).read_text()
    return yaml.safe_load(text).get("finetuning", WorkbookParams.model_fields["finetuning"].default)


def _against_grpo(data: dict, arm: str) -> str:
    pooled = contrast_rows(data, arm, GRPO)[-1]
    return f"{effect(pooled)}, {pooled['collapsed']} of {len(arm_runs(data, arm))} runs collapsed"


def pooled_line(data: dict) -> dict:
    """The pooled verdicts a summary row states: GRPO's drift and PAPO-G against GRPO, over every warm start."""
    drift = drift_rows(data)[-1]
    against = contrast_rows(data, PAPO_G, GRPO)[-1]
    placebo = contrast_rows(data, PAPO_G, "placebo_kl_matched")[-1]
    runs = len(arm_runs(data, PAPO_G))
    negative = sum(r["drift"] < 0 for r in drift_rows(data)[:-1])
    remedies = sorted({r["arm"] for b in data["warm_starts"] for r in b["runs"]
                       if r["arm"].startswith(PAPO_G + ENTROPY_TAG)})  # fmt: skip
    remedy = "".join(f"; with the double entropy loss {arm.split(ENTROPY_TAG)[1]}: {_against_grpo(data, arm)}"
                     for arm in remedies)  # fmt: skip
    return {
        "warm_starts": len(data["warm_starts"]),
        "pairs": against["pairs"],
        "drift": f"{drift['drift']:+.3f} +/- {drift['drift_ci95']:.3f} (p = {drift['p_value']:.2g}; negative on "
        f"{negative} of {len(data['warm_starts'])} warm starts)",
        "papo_g": f"{effect(against)}; {against['collapsed']} of {runs} runs collapsed{remedy}",
        "papo_g_holds": gain_detected(against),
        "placebo": f"against the KL-matched placebo: {effect(placebo)}",
        "placebo_holds": gain_detected(placebo),
        "specific": "shown" if "Perception-specific: shown" in two_sentence_verdict(data) else "not shown",
    }


def one_warm_start_note(weights_sha256: str, finetuning: str, root: Path) -> str:
    """What a study on one warm start can say, beside what each pooled page under ``root`` (the project's
    ``docs/study``) that lists its weights (same finetuning) found over all its warm starts: a reader must not take
    one policy's result for the testbed's."""
    said = f"**One warm start.** This study trained one policy (weights `{weights_sha256[:12]}`)"
    pages = []
    for folder, data in pooled_pages(root):
        builds = [b for b in data["warm_starts"] if b["weights_sha256"] == weights_sha256]
        if builds and finetuning_of(data, root) == finetuning:
            line = pooled_line(data)
            pages.append(
                f"warm start {builds[0]['build']} of the {line['warm_starts']} that `docs/study/{folder.name}` pools "
                f"(`{data['params']}`; over all of them GRPO's drift is {line['drift']}, and PAPO-G minus GRPO: "
                f"{line['papo_g']})"
            )
    if not pages:
        return f"{said}; no pooled page under `docs/study` lists it, so nothing here speaks for other warm starts."
    return f"{said}: {'; and '.join(pages)}. What this run shows holds for this warm start, not for the testbed."
