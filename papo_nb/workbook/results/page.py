"""The results page of a run: a Markdown description (MLflow's ``mlflow.note.content``, the run page's Description)
written from what the run itself logged, so a reviewer reads the verdict, the probe with its power, held-out accuracy
with and without the image, the learning-signal health and links to the tables and figures without opening a chart.

``publish_notebook_page(client, run_id)`` writes a notebook run's page and returns its headline numbers;
``publish_workbook_page(client, parent_id, children)`` writes the workbook (parent) run's page and logs those
headlines there as ``headline/*`` metrics (and the verdict and probe status as tags), so the runs list has a column
for each. The runner calls both when a notebook ends, failed or not; nothing here reruns or recomputes a result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from mlflow import MlflowClient
from mlflow.entities import Metric

from papo_nb.workbook.config.evidence_names import STUDY_TABLE_MD
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY
from papo_nb.workbook.results.signal import SIGNAL_TAG, ZERO_STD_FLAG, signal_health

NOTE_TAG = "mlflow.note.content"  # what MLflow's UI shows as the run's Description
VERDICT_TAG, PROBE_STATUS_TAG, PROBE_WARNING_TAG = "papo_nb.verdict", "papo_nb.probe_status", "papo_nb.probe_warning"
CALIBRATION_TAG = "papo_nb.calibration_verdict"
STUDY_VERDICT_TAG = "papo_nb.study_verdict"  # 04's calibrated design: GRPO's drift and PAPO-G against it
BASE_BESIDE_TAG = "papo_nb.base_beside"  # 05: the checkpoint against the base model, in one sentence
SKIPPED_ARTIFACT_FOLDERS = ("table_images",)  # thousands of thumbnails: the tables that hold them are listed instead

# Child metric -> the workbook run's headline metric. The first notebook that logged the child metric supplies it.
HEADLINES = {
    "verdict/passed": "headline/contract_passed",
    "calibration/separated": "headline/calibration_separated",
    "probe_final/passed": "headline/probe_passed",
    "probe/passed": "headline/probe_passed",
    "probe_final/leak_detection_power": "headline/probe_power",
    "probe/leak_detection_power": "headline/probe_power",
    HELDOUT_ACCURACY: "headline/heldout_original",
    "eval/accuracy_masked": "headline/heldout_masked",
    "eval/accuracy_original/vision": "headline/heldout_original_vision",
    "eval/accuracy_masked/vision": "headline/heldout_masked_vision",
    "eval/overall/greedy_masked": "headline/heldout_masked",
}
SPLITS = {"": "all items", "/vision": "vision-dependent", "/text": "text-answerable"}


@dataclass
class RunRecord:
    """What one run logged, read back from the store: tags, last metric values, artifact paths."""

    run_id: str
    name: str
    experiment_id: str
    status: str
    tags: dict[str, str]
    metrics: dict[str, float]
    artifacts: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, client: MlflowClient, run_id: str) -> RunRecord:
        run = client.get_run(run_id)
        return cls(
            run_id,
            run.info.run_name,
            run.info.experiment_id,
            run.info.status,
            dict(run.data.tags),
            dict(run.data.metrics),
            artifact_paths(client, run_id),
        )

    def link(self, artifact: str | None = None) -> str:
        """The UI's address of this run (or of one of its artifacts), relative to the server's root."""
        base = f"#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return base if artifact is None else f"{base}/artifacts/{quote(artifact)}"

    def image(self, artifact: str) -> str:
        """Where the server serves an artifact's bytes (MLflow's ``get-artifact`` endpoint), for an inline image."""
        return f"get-artifact?path={quote(artifact, safe='')}&run_uuid={self.run_id}"


def artifact_paths(client: MlflowClient, run_id: str, folder: str | None = None) -> list[str]:
    """Every artifact file of the run, folders walked, ``SKIPPED_ARTIFACT_FOLDERS`` left out."""
    paths = []
    for entry in client.list_artifacts(run_id, folder):
        if entry.is_dir:
            if Path(entry.path).name not in SKIPPED_ARTIFACT_FOLDERS:
                paths += artifact_paths(client, run_id, entry.path)
        else:
            paths.append(entry.path)
    return paths


def _number(value: float | None, digits: int = 3) -> str:
    return "not measured" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


# --------------------------------------------------------------------------------------------
# the sections
# --------------------------------------------------------------------------------------------


def verdict_lines(record: RunRecord) -> list[str]:
    """The contract verdict, the calibration verdict, the probe's status with its power and the method study's verdict
    (04's calibrated design), as the run tagged them."""
    lines = []
    if VERDICT_TAG in record.tags:
        lines.append(f"- **Contract verdict**: {record.tags[VERDICT_TAG]}")
    if CALIBRATION_TAG in record.tags:
        lines.append(f"- **Probe calibration**: {record.tags[CALIBRATION_TAG]}")
    status = record.tags.get(PROBE_STATUS_TAG)
    prefix = "probe_final" if "probe_final/passed" in record.metrics else "probe"
    if status is None and f"{prefix}/passed" in record.metrics:
        status = "passed" if record.metrics[f"{prefix}/passed"] == 1.0 else "not passed"
    if status is not None:
        power = record.metrics.get(f"{prefix}/leak_detection_power")
        lines.append(
            f"- **Gamma-zero probe**: {status}; its power (perception gradient over the tolerance, a batch below 1 "
            f"is deferred) {_number(power, 1)}"
        )
    if PROBE_WARNING_TAG in record.tags:
        lines.append(f"- **Probe warning**: {record.tags[PROBE_WARNING_TAG]}")
    if STUDY_VERDICT_TAG in record.tags:
        lines.append(f"- **Method study**: {record.tags[STUDY_VERDICT_TAG]}")
    if BASE_BESIDE_TAG in record.tags:
        lines.append(f"- **Against the base model**: {record.tags[BASE_BESIDE_TAG]}")
    return lines


def heldout_rows(metrics: dict[str, float]) -> list[dict]:
    """Held-out greedy accuracy, original and masked, as the summary line and the table both show it, each row
    saying which mean it is: notebook 05's overall score (``eval/overall/*``), the mean over its benchmarks as the
    paper averages them; notebook 03's per split, means over items, with the score before training beside them
    (``eval_before/*``) where the run measured it."""
    if "eval/overall/greedy" in metrics:
        count = metrics.get("eval/overall/benchmarks")
        mean = f"mean over {int(count)} benchmarks" if count else "mean over benchmarks"
        original, masked = metrics["eval/overall/greedy"], metrics.get("eval/overall/greedy_masked")
        return [dict(label=f"overall ({mean})", mean=mean, original=original, masked=masked, items=None)]
    rows = []
    for suffix, label in SPLITS.items():
        original = metrics.get(f"eval/accuracy_original{suffix}")
        if original is None:
            continue
        items = metrics.get(f"eval/items{suffix}")
        rows.append(dict(
            label=label, mean=f"mean over {int(items)} items" if items else "mean over items", original=original,
            masked=metrics.get(f"eval/accuracy_masked{suffix}"), items=items,
            before=metrics.get(f"eval_before/accuracy_original{suffix}"),
            before_masked=metrics.get(f"eval_before/accuracy_masked{suffix}"),
        ))  # fmt: skip
    return rows


def heldout_table(metrics: dict[str, float]) -> list[str]:
    """``heldout_rows`` as a table: original, masked, gap and items, and the scores before training where measured."""
    rows = heldout_rows(metrics)
    if not rows:
        return []
    before = any(row.get("before") is not None for row in rows)
    header = "| split | original | masked | gap | items |" + (
        " before training: original | masked |" if before else ""
    )
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for row in rows:
        original, masked, items = row["original"], row["masked"], row["items"]
        line = (
            f"| {row['label']} | {_number(original)} | {_number(masked)} | "
            f"{_number(None if masked is None else original - masked)} | {'' if items is None else int(items)} |"
        )
        if before:
            line += f" {_number(row.get('before'))} | {_number(row.get('before_masked'))} |"
        lines.append(line)
    return lines


def heldout_phrase(row: dict) -> str:
    """The summary line's held-out part, from the same row as the table: the numbers, which mean, the baseline."""
    baseline = ""
    if row.get("before") is not None:
        baseline = f"; before training {_number(row['before'])} / {_number(row.get('before_masked'))}"
    return (
        f"held-out **{_number(row['original'])}** original / **{_number(row['masked'])}** masked "
        f"(greedy, {row['mean']}{baseline})"
    )


def benchmark_table(metrics: dict[str, float]) -> list[str]:
    """Notebook 05's scores per benchmark, group and overall: avg@k and greedy, each beside its masked score."""
    names = sorted({key.split("/")[1] for key in metrics if key.startswith("eval/") and key.endswith("/greedy")})
    if not names:
        return []
    lines = ["| benchmark | avg@k | masked | greedy | masked |", "| --- | --- | --- | --- | --- |"]
    for name in sorted(names, key=lambda n: n == "overall"):
        scores = [
            metrics.get(f"eval/{name}/{key}") for key in ("avg_at_k", "avg_at_k_masked", "greedy", "greedy_masked")
        ]
        lines.append(f"| {name} | " + " | ".join(_number(s) for s in scores) + " |")
    return lines


def arms_table(metrics: dict[str, float]) -> list[str]:
    """Notebook 04's headline per arm: avg@k on vision-dependent items, mean over seeds (``study/headline/<arm>``)."""
    arms = {
        key.removeprefix("study/headline/"): value
        for key, value in metrics.items()
        if key.startswith("study/headline/")
    }
    if not arms:
        return []
    lines = ["| arm | avg@k, vision-dependent items |", "| --- | --- |"]
    return lines + [f"| {arm} | {_number(value)} |" for arm, value in sorted(arms.items())]


def artifact_links(record: RunRecord) -> list[str]:
    """Links to the run's tables, figures, Markdown evidence and executed notebook (HTML first)."""
    wanted = [
        path
        for path in record.artifacts
        if path.endswith((".png", ".md", ".html")) or "completions" in path or path.endswith("_table.json")
    ]
    wanted.sort(key=lambda p: (not p.endswith(".html"), not p.startswith("figures/"), p))
    return [f"- [{path}]({record.link(path)})" for path in wanted]


def summary_line(status: str, rolled: dict[str, float], tags: dict[str, str], heldout: dict | None = None) -> str:
    """The page's first line, what the Description shows before "Show more": the status, then the contract, the
    probe with its power, the calibration, held-out accuracy original / masked (``heldout``: the held-out table's
    first row, so the line and the table are one set of numbers) and the learning signal, each only where the run
    measured it."""
    parts = [f"**{status}**"]
    if "headline/contract_passed" in rolled:
        parts.append(f"contract **{'PASS' if rolled['headline/contract_passed'] == 1.0 else 'FAIL'}**")
    status_word = tags.get(PROBE_STATUS_TAG)
    if status_word is None and "headline/probe_passed" in rolled:
        status_word = "passed" if rolled["headline/probe_passed"] == 1.0 else "not passed"
    if status_word is not None:
        parts.append(f"probe **{status_word}** (power {_number(rolled.get('headline/probe_power'), 1)})")
    if "headline/calibration_separated" in rolled:
        parts.append(f"calibration **{'separated' if rolled['headline/calibration_separated'] else 'NOT separated'}**")
    if heldout is not None:
        parts.append(heldout_phrase(heldout))
    if "headline/zero_std_share" in rolled:
        share = rolled["headline/zero_std_share"]
        word = "WEAK" if share > ZERO_STD_FLAG else "ok"
        parts.append(f"learning signal **{word}** ({share:.0%} of groups without reward spread)")
    return " · ".join(parts)


def notebook_page(record: RunRecord, signal: dict | None, arms_comparison: str = "") -> str:
    """The Markdown results page of one notebook run; ``arms_comparison``: 04's GRPO against PAPO-G table (Markdown),
    placed after its arms' headline."""
    lines = findings_lines(record, signal, arms_comparison, f"{record.name} {record.status.lower()}")
    figures = [path for path in record.artifacts if path.startswith("figures/") and path.endswith(".png")]
    curves = next((p for p in figures if "curves" in p), figures[0] if figures else None)
    if curves is not None:
        lines += ["", f"### {Path(curves).stem.replace('_', ' ')}", "", f"![{curves}]({record.image(curves)})"]
    links = artifact_links(record)
    if links:
        lines += ["", "### Tables, figures and the executed notebook", "", *links]
    return "\n".join(lines) + "\n"


def findings_lines(record: RunRecord, signal: dict | None, arms_comparison: str, status: str) -> list[str]:
    """What the run showed, as it logged it: the summary line, the verdicts, the learning signal and the tables of
    held-out accuracy, benchmarks and study arms (and 04's GRPO against PAPO-G table)."""
    heldout = next(iter(heldout_rows(record.metrics)), None)
    lines = [summary_line(status, headlines(record, signal), record.tags, heldout), ""]
    if record.tags.get("papo_nb.failed_cell"):
        lines += [f"**Failed at** {record.tags['papo_nb.failed_cell']}", ""]
    lines += verdict_lines(record)
    if signal is not None:
        lines.append(f"- **Learning signal**: {signal['message']}")
    for title, table in (
        ("Held-out accuracy, greedy, original against masked images", heldout_table(record.metrics)),
        ("Benchmarks (05)", benchmark_table(record.metrics)),
        ("Study arms (04)", arms_table(record.metrics)),
    ):
        if table:
            lines += ["", f"### {title}", "", *table]
    if arms_comparison:
        lines += ["", f"### GRPO against PAPO-G ({STUDY_TABLE_MD})", "", arms_comparison.strip()]
    return lines


def run_report(run_id: str, client: MlflowClient | None = None) -> str:
    """Every notebook's closing cell: what the run showed, read back from what it has logged (``findings_lines``),
    so the executed notebook ends on its verdicts and numbers rather than on a bare table."""
    client = client or MlflowClient()
    record = RunRecord.read(client, run_id)
    comparison = ""
    if STUDY_TABLE_MD in record.artifacts:
        comparison = Path(client.download_artifacts(run_id, STUDY_TABLE_MD)).read_text()
    lines = findings_lines(record, signal_health(client, run_id), comparison, f"What {record.name} showed")
    return "\n".join(lines) + "\n"


def headlines(record: RunRecord, signal: dict | None) -> dict[str, float]:
    """The run's numbers that roll up to the workbook run, as ``headline/*`` metrics."""
    rolled: dict[str, float] = {}
    for source, target in HEADLINES.items():
        if source in record.metrics and target not in rolled:
            rolled[target] = record.metrics[source]
    for key, value in record.metrics.items():
        if key.startswith("study/headline/"):
            rolled[f"headline/study_{key.removeprefix('study/headline/')}"] = value
    if signal is not None:
        rolled["headline/zero_std_share"] = signal["share"]
    return rolled


# --------------------------------------------------------------------------------------------
# publishing
# --------------------------------------------------------------------------------------------


def publish_notebook_page(client: MlflowClient, run_id: str) -> tuple[RunRecord, dict[str, float]]:
    """Write the run's results page (its Description) and return the run as read and its headline numbers."""
    record = RunRecord.read(client, run_id)
    signal = signal_health(client, run_id)
    if signal is not None:
        client.log_metric(run_id, "signal/zero_std_share", signal["share"])
        client.set_tag(run_id, SIGNAL_TAG, signal["message"])
        record.tags[SIGNAL_TAG] = signal["message"]
    comparison = ""
    if STUDY_TABLE_MD in record.artifacts:
        comparison = Path(client.download_artifacts(run_id, STUDY_TABLE_MD)).read_text()
    client.set_tag(run_id, NOTE_TAG, notebook_page(record, signal, comparison))
    return record, headlines(record, signal)


def workbook_page(parent: RunRecord, children: list[tuple[RunRecord, dict[str, float]]]) -> str:
    """The workbook run's page: the headlines, then one line per notebook run with its link and status."""
    merged = merge_headlines(children)
    unfinished = [f"{child.name} {child.status}" for child, _ in children if child.status != "FINISHED"]
    status = ", ".join(unfinished) if unfinished else f"{len(children)} notebooks finished"
    tags = {key: value for child, _ in reversed(children) for key, value in child.tags.items()}
    heldout = next((rows[0] for child, _ in children if (rows := heldout_rows(child.metrics))), None)
    lines = [summary_line(status, merged, tags, heldout), "", "### Details", ""]
    for child, _ in children:
        lines += [line.replace("- **", f"- {child.name}, **", 1) for line in verdict_lines(child)]
    signals = [child.tags.get(SIGNAL_TAG) for child, _ in children]
    lines += [f"- **Learning signal**: {text}" for text in signals if text]
    if heldout is not None:
        lines += [
            "",
            "### Held-out accuracy, greedy, original against masked images",
            "",
            *heldout_table(next(c.metrics for c, _ in children if heldout_rows(c.metrics))),
        ]
    arms = next((arms_table(c.metrics) for c, _ in children if arms_table(c.metrics)), [])
    if arms:
        lines += ["", "### Study arms (04)", "", *arms]
    lines += ["", "### Notebook runs", "", "| notebook | status | results page |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {c.status.lower()} | [{c.name}]({c.link()}) |" for c, _ in children]
    lines += ["", "### Headline metrics (columns of the runs list)", ""]
    lines += [f"- `{key}`: {_number(value)}" for key, value in merged.items()]
    return "\n".join(lines) + "\n"


def merge_headlines(children: list[tuple[RunRecord, dict[str, float]]]) -> dict[str, float]:
    """Every child's headlines, the first notebook's value kept where two report the same headline."""
    merged: dict[str, float] = {}
    for _, rolled in children:
        for key, value in rolled.items():
            merged.setdefault(key, value)
    return merged


def publish_workbook_page(
    client: MlflowClient, parent_id: str, children: list[tuple[RunRecord, dict[str, float]]]
) -> dict[str, float]:
    """Write the workbook run's page, log the children's headlines on it as metrics and copy the verdict and the probe
    status up as tags; returns the metrics logged."""
    parent = RunRecord.read(client, parent_id)
    merged = merge_headlines(children)
    finite = {key: value for key, value in merged.items() if math.isfinite(value)}
    client.log_batch(
        parent_id, metrics=[Metric(key, value, int(time.time() * 1000), 0) for key, value in finite.items()]
    )
    for child, _ in children:
        for tag in (VERDICT_TAG, PROBE_STATUS_TAG, PROBE_WARNING_TAG):
            if tag in child.tags:
                client.set_tag(parent_id, tag, child.tags[tag])
    client.set_tag(parent_id, NOTE_TAG, workbook_page(parent, children))
    return finite
