"""Provenance for notebook 01: the pinned upstream file hashed inside the real ``trl==0.29.1`` wheel, the wheels the
drift table reads (``trl_releases.py``), and the one-line verdict."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from papo_nb.papo.contract import (
    PAPO_UPSTREAM_SOURCE_PATH,
    PAPO_UPSTREAM_SOURCE_SHA256,
    PAPO_UPSTREAM_SOURCE_URL,
    PAPO_UPSTREAM_TRL_VERSION,
)
from papo_nb.papo.probe import ProbeEvidence


class WheelUnavailable(RuntimeError):
    """pip could not fetch a TRL wheel (usually: no network to the package index)."""


def default_wheel_cache() -> Path:
    return Path(os.environ.get("PAPO_NB_CACHE", Path.home() / ".cache" / "papo_nb")) / "wheels"


def fetch_trl_wheel(version: str, cache_dir: str | Path | None = None, timeout_s: float = 180.0) -> Path:
    """``pip download --no-deps trl==VERSION`` into ``cache_dir`` (reused when already there)."""
    cache = Path(cache_dir) if cache_dir else default_wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)
    existing = sorted(cache.glob(f"trl-{version}-*.whl"))
    if existing:
        return existing[0]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        f"trl=={version}",
        "-d",
        str(cache),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise WheelUnavailable(f"pip download trl=={version} timed out after {timeout_s:.0f}s") from exc
    found = sorted(cache.glob(f"trl-{version}-*.whl"))
    if result.returncode != 0 or not found:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WheelUnavailable(f"pip download trl=={version} failed: {tail[0]}")
    return found[0]


def read_wheel_member(wheel: str | Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(member)
        except KeyError as exc:
            raise FileNotFoundError(f"{member} is not inside {wheel}") from exc


@dataclass
class SourceVerification:
    """Outcome of hashing the pinned upstream file inside a TRL wheel."""

    wheel: str
    member: str
    expected_sha256: str
    actual_sha256: str | None
    match: bool
    url: str = PAPO_UPSTREAM_SOURCE_URL
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_upstream_source(wheel: str | Path | None = None, cache_dir: str | Path | None = None) -> SourceVerification:
    """Hash ``papo_trainer.py`` inside the given wheel, or inside ``trl==0.29.1`` fetched with pip.

    A wheel that cannot be fetched or read gives ``match=False`` with the reason in ``error``.
    """
    try:
        wheel_path = Path(wheel) if wheel else fetch_trl_wheel(PAPO_UPSTREAM_TRL_VERSION, cache_dir)
        actual = hashlib.sha256(read_wheel_member(wheel_path, PAPO_UPSTREAM_SOURCE_PATH)).hexdigest()
    except (WheelUnavailable, FileNotFoundError, zipfile.BadZipFile) as exc:
        return SourceVerification(
            str(wheel or ""), PAPO_UPSTREAM_SOURCE_PATH, PAPO_UPSTREAM_SOURCE_SHA256, None, False, error=str(exc)
        )
    return SourceVerification(
        str(wheel_path),
        PAPO_UPSTREAM_SOURCE_PATH,
        PAPO_UPSTREAM_SOURCE_SHA256,
        actual,
        actual == PAPO_UPSTREAM_SOURCE_SHA256,
    )


def contract_verdict(
    source: SourceVerification, live_violations: list[str], drift: list, probe: ProbeEvidence
) -> dict:
    """PASS needs the pinned SHA to match, the live contract to hold and the probe to pass (``drift``: the rows of
    ``trl_releases.contract_drift_table``).

    Drift in *other* releases is reported, not failed on: it tells you which upgrades would break the adapter.
    """
    checks = {
        "upstream_sha_verified": source.match,
        "live_contract_holds": not live_violations,
        "probe_passed": probe.passed,
    }
    # An underpowered probe (no batch where a leak the size of the perception gradient would show) is not a pass,
    # but not a failure either: the verdict passes with a warning, so the run goes on and the reader is told.
    warnings = [f"gamma-zero probe UNDERPOWERED: {probe.message}"] if probe.status == "underpowered" else []
    passed = checks["upstream_sha_verified"] and checks["live_contract_holds"] and (probe.passed or bool(warnings))
    drifted = [r.trl_version for r in drift if r.status == "drift"]
    unavailable = [r.trl_version for r in drift if r.status == "unavailable"]
    line = (
        f"{'PASS' if passed else 'FAIL'}: upstream SHA {'verified' if source.match else 'NOT verified'}, "
        f"live TRL contract {'holds' if not live_violations else 'BROKEN'}, gamma-zero probe {probe.status}"
    ) + "".join(f"; WARNING: {w}" for w in warnings)
    return {
        "passed": passed,
        **checks,
        "drifted_releases": drifted,
        "unavailable_releases": unavailable,
        "verdict": f"{line}. {releases_note(drift)}" if drift else line,
        "probe_status": probe.status,
        "warnings": warnings,
    }


def releases_note(drift: list) -> str:
    """The drift table in one sentence, worded as the information it is (other releases never fail the verdict):
    how many hold the contract, which the adapter would refuse, the upstream source release apart (it is the ported
    code's release, not a parent, so its differences are expected), and which could not be fetched."""
    holding = [r.trl_version for r in drift if r.status == "ok"]
    refused = [r.trl_version for r in drift if r.status == "drift" and r.trl_version != PAPO_UPSTREAM_TRL_VERSION]
    upstream = [r for r in drift if r.trl_version == PAPO_UPSTREAM_TRL_VERSION and r.status == "drift"]
    unavailable = [r.trl_version for r in drift if r.status == "unavailable"]
    parts = [
        f"Other TRL releases, read from their wheels (information, not part of the verdict): {len(holding)} of "
        f"{len(drift)} hold the contract",
        f"the adapter would refuse {', '.join(refused)}" if refused else "none the adapter would refuse",
    ]
    if upstream:
        upstream_note = "is the ported upstream source, not a parent: it differs, as expected"
        parts.append(f"{PAPO_UPSTREAM_TRL_VERSION} {upstream_note}")
    parts.append(f"not fetched: {', '.join(unavailable) or 'none'}")
    return "; ".join(parts) + "."
