"""Which TRL releases the drift table checks, and what each row tells a user.

The list is derived, not typed: ``pip index versions trl`` (the package index pip is configured with) gives every
final release; the table checks 0.29.1 (the upstream PAPO source) and every release from the first supported one
(``contract.SUPPORTED_TRL``) to the newest the index serves. Without the index, the recorded list below stands in,
and the table says so. Each row names its log-prob form (``trl_seams.py``), what changed against the release before
it, whether the contract holds, and what a user should do about it.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from papo_nb.papo.contract import (
    PAPO_UPSTREAM_TRL_VERSION,
    PARENT_GRPO_FILE,
    SUPPORTED_TRL,
    release_key,
    source_methods,
    static_contract_violations,
    supported_release,
)
from papo_nb.prefix_sharing import trl_seams

from .provenance import WheelUnavailable, fetch_trl_wheel, read_wheel_member

# `pip index versions trl` on 2026-12-03: the final releases from 1.9.1 on, for when the index cannot be reached.
RECORDED_ON = "2026-12-03"
RECORDED_RELEASES = (
    "1.9.1", "1.9.2", "1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.0", "1.14.1", "1.14.2", "1.15.0", "1.16.0",
)  # fmt: skip


@dataclass
class ReleaseList:
    """The releases to check, oldest first (the upstream one first of all), and where the list came from."""

    versions: list[str]
    source: str


def index_releases(timeout_s: float = 60.0) -> list[str]:
    """Every final TRL release the package index serves, oldest first (``pip index versions trl``); raises
    ``WheelUnavailable`` with pip's reason where the index cannot be read."""
    command = [sys.executable, "-m", "pip", "index", "versions", "trl", "--disable-pip-version-check"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise WheelUnavailable(f"pip index versions trl timed out after {timeout_s:.0f}s") from exc
    found = re.search(r"^Available versions: (.+)$", result.stdout, re.MULTILINE)
    if result.returncode != 0 or found is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WheelUnavailable(f"pip index versions trl failed: {tail[0]}")
    finals = [v.strip() for v in found.group(1).split(",") if re.fullmatch(r"\d+(\.\d+)*", v.strip())]
    return sorted(finals, key=release_key)


def drift_releases(index: list[str] | None = None, timeout_s: float = 60.0) -> ReleaseList:
    """0.29.1 and every release from the first supported one to the newest: from ``index`` (or the package index),
    else from ``RECORDED_RELEASES``, with the source in words."""
    if index is None:
        try:
            index = index_releases(timeout_s)
        except WheelUnavailable as exc:
            recorded = [PAPO_UPSTREAM_TRL_VERSION, *RECORDED_RELEASES]
            return ReleaseList(recorded, f"recorded list of {RECORDED_ON} (the package index was not read: {exc})")
    first = release_key(SUPPORTED_TRL[0])
    versions = [v for v in sorted(index, key=release_key) if release_key(v) >= first]
    newest = versions[-1] if versions else "none"
    source = f"package index (pip index versions trl): newest {newest}"
    return ReleaseList([PAPO_UPSTREAM_TRL_VERSION, *versions], source)


@dataclass
class DriftRow:
    """One release: ``status`` "ok", "drift" or "unavailable"; ``violations`` the broken facts (or why the wheel
    could not be read); ``form`` its log-prob form; ``changed`` what moved against the release before it; ``action``
    what a user does about it."""

    trl_version: str
    status: str
    violations: list[str] = field(default_factory=list)
    form: str = ""
    changed: str = ""
    action: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def release_facts(source: str) -> dict[str, str]:
    """The facts a row compares with the release before it: the log-prob form and its temperature statement."""
    methods = source_methods(source) or {}
    form = trl_seams.seam_of(methods)
    logp = methods.get(trl_seams.LOGP_METHOD)
    written = {ast.unparse(n) for n in ast.walk(logp) if isinstance(n, ast.stmt)} if logp is not None else set()
    temperature = next((s for s in trl_seams.LOGITS_TEMPERATURE if s in written), "")
    return {"form": form.name, "summary": form.summary, "temperature": temperature}


def what_changed(facts: dict[str, str], before: dict[str, str] | None) -> str:
    if before is None:
        return "first release checked"
    if facts["form"] != before["form"]:
        return f"log-prob method: {facts['summary']}"
    if facts["temperature"] != before["temperature"] and facts["temperature"]:
        return f"temperature now `{facts['temperature']}` (same numbers)"
    return "no pinned fact changed"


def action_for(version: str, problems: list[str], form: str) -> str:
    newest = SUPPORTED_TRL[1]
    if version == PAPO_UPSTREAM_TRL_VERSION and problems:
        return "the upstream PAPO source (its file's SHA-256 is pinned), not a parent the adapter runs on"
    if problems:
        return f"the adapter refuses this release at construction: install trl=={newest}"
    if not supported_release(version):
        return f"contract holds but the adapter tier never ran on it: run the probe, or install trl=={newest}"
    proven = "" if version in SUPPORTED_TRL else f" (the adapter tier runs on {' and '.join(SUPPORTED_TRL)})"
    if form != trl_seams.LOGITS.name:
        return f"supported{proven}; the shared prefix and prefix sharing fall back to TRL's own forward (logged once)"
    return f"supported{proven}"


def contract_drift_table(versions, cache_dir: str | Path | None = None) -> list[DriftRow]:
    """The static contract check for each TRL release, with its form, what changed and what to do; an unreachable
    release is listed, not fatal."""
    rows, before = [], None
    for version in versions:
        try:
            source = read_wheel_member(fetch_trl_wheel(version, cache_dir), PARENT_GRPO_FILE).decode()
        except (WheelUnavailable, FileNotFoundError, zipfile.BadZipFile) as exc:
            rows.append(DriftRow(version, "unavailable", [str(exc)], action="not fetched: no wheel to read"))
            continue
        problems, facts = static_contract_violations(source), release_facts(source)
        upstream = version == PAPO_UPSTREAM_TRL_VERSION
        changed = "the upstream source" if upstream else what_changed(facts, before)
        action = action_for(version, problems, facts["form"])
        rows.append(DriftRow(version, "drift" if problems else "ok", problems, facts["form"], changed, action))
        before = before if upstream else facts  # each release against the one before it, the upstream apart
    return rows


def drift_markdown(rows: list[DriftRow]) -> str:
    """The table as markdown: release, status, form, what changed, what to do (the broken facts in full for drift)."""
    lines = ["| TRL | status | log-prob form | what changed | what to do |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        detail = row.changed if row.status == "ok" else "; ".join(row.violations)
        lines.append(f"| {row.trl_version} | {row.status} | {row.form} | {detail} | {row.action} |")
    return "\n".join(lines)


# docs/trl_releases.md's support table sits between these lines; ``python -m papo_nb.workbook.verification.trl_releases
# --page`` rewrites it from the recorded releases' wheels (the recorded list: a release published later changes the
# drift table of notebook 01 and ``papo-nb env --drift``, never a committed file); tests/test_trl_releases.py pins it.
SUPPORT_PAGE = "docs/trl_releases.md"
TABLE_START = "<!-- TRL support table: python -m papo_nb.workbook.verification.trl_releases --page -->"
TABLE_END = "<!-- end of the TRL support table -->"


def support_table(cache_dir: str | Path | None = None) -> str:
    """The drift table of 0.29.1 and the recorded releases, as markdown."""
    return drift_markdown(contract_drift_table([PAPO_UPSTREAM_TRL_VERSION, *RECORDED_RELEASES], cache_dir))


def with_support_table(page: str, table: str) -> str:
    """``page`` with the text between ``TABLE_START`` and ``TABLE_END`` replaced by ``table``."""
    start, end = page.find(TABLE_START), page.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {TABLE_START!r} ... {TABLE_END!r} block to write the support table into")
    return page[: start + len(TABLE_START)] + "\n" + table + "\n" + page[end:]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m papo_nb.workbook.verification.trl_releases")
    parser.add_argument(
        "--page", nargs="?", const=SUPPORT_PAGE, required=True, help="the page whose support table is rewritten"
    )
    args = parser.parse_args(argv)
    page = Path(args.page)
    if not page.is_file():
        parser.error(f"--page {args.page!r}: no such file; allowed: the path of a page with the table markers")
    page.write_text(with_support_table(page.read_text(), support_table()))
    print(f"wrote the TRL support table into {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
