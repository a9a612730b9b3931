"""Notebook 01's verdict: pinned source, live contract, drift, and the probe, summarised in one line."""

from __future__ import annotations

from papo_nb.contract import DriftRow, SourceVerification
from papo_nb.probe import ProbeEvidence


def contract_verdict(source: SourceVerification, live_violations: list[str], drift: list[DriftRow],
                     probe: ProbeEvidence) -> dict:
    """PASS needs the pinned SHA to match, the live contract to hold and the probe to pass.

    Drift in *other* releases is reported, not failed on: it tells you which upgrades would break the adapter.
    """
    checks = {
        "upstream_sha_verified": source.match,
        "live_contract_holds": not live_violations,
        "probe_passed": probe.passed,
    }
    passed = all(checks.values())
    drifted = [r.trl_version for r in drift if r.status == "drift"]
    unavailable = [r.trl_version for r in drift if r.status == "unavailable"]
    line = (f"{'PASS' if passed else 'FAIL'}: upstream SHA {'verified' if source.match else 'NOT verified'}, "
            f"live TRL contract {'holds' if not live_violations else 'BROKEN'}, gamma-zero probe {probe.status}"
            f"; releases drifted: {', '.join(drifted) or 'none'}; not fetched: {', '.join(unavailable) or 'none'}")
    return {"passed": passed, **checks, "drifted_releases": drifted, "unavailable_releases": unavailable, "verdict": line}
