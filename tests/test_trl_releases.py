"""The drift table's release list (derived from the package index, a recorded list without it) and its rows, on the
real wheels of the releases where something changed (fetched with pip download, cached)."""

import shutil
from pathlib import Path

import pytest

from papo_nb.papo import contract
from papo_nb.workbook.verification import provenance
from papo_nb.workbook.verification import trl_releases as releases


def test_the_list_runs_from_the_first_supported_release_to_the_newest_on_the_index():
    listed = releases.drift_releases(["1.7.1", "1.8.0", "1.10.0", "1.9.1", "1.17.0"])
    assert listed.versions == ["0.29.1", "1.9.1", "1.10.0", "1.17.0"]
    assert listed.source == "package index (pip index versions trl): newest 1.17.0"


def test_the_index_serves_the_recorded_releases_and_the_list_says_where_it_came_from():
    """The real index (PyPI, as pip is configured): the recorded list is its releases 1.9.1..1.16.0 as they were; a
    newer release on the index joins the derived list, never the recorded one."""
    served = releases.index_releases()
    first, newest = (contract.release_key(v) for v in contract.SUPPORTED_TRL)
    assert tuple(v for v in served if first <= contract.release_key(v) <= newest) == releases.RECORDED_RELEASES
    derived = releases.drift_releases()
    assert derived.versions[:12] == ["0.29.1", *releases.RECORDED_RELEASES]
    assert derived.source.startswith("package index") and derived.versions[-1] in derived.source


def test_an_unreadable_index_falls_back_to_the_recorded_list_and_says_so():
    listed = releases.drift_releases(timeout_s=0.001)  # pip cannot even start in a millisecond
    assert listed.versions == ["0.29.1", *releases.RECORDED_RELEASES]
    assert listed.source.startswith("recorded list of 2026-12-03 (the package index was not read: pip index versions")


def test_each_row_names_its_form_what_changed_and_what_to_do():
    rows = releases.contract_drift_table(["0.29.1", "1.9.1", "1.9.2", "1.10.0", "1.14.2", "1.15.0", "1.16.0"])
    table = {r.trl_version: (r.status, r.form, r.changed) for r in rows}
    assert table == {
        "0.29.1": ("drift", "logits", "the upstream source"),
        "1.9.1": ("ok", "logits", "first release checked"),
        "1.9.2": ("ok", "logits", "no pinned fact changed"),
        "1.10.0": ("ok", "logits", "temperature now `logits = logits / self.temperature` (same numbers)"),
        "1.14.2": ("ok", "variadic", f"log-prob method: {releases.trl_seams.VARIADIC.summary}"),
        "1.15.0": ("ok", "fused", f"log-prob method: {releases.trl_seams.FUSED.summary}"),
        "1.16.0": ("ok", "fused", "no pinned fact changed"),
    }
    actions = {r.trl_version: r.action for r in rows}
    assert actions["0.29.1"].startswith("the upstream PAPO source")
    assert actions["1.9.1"] == "supported"
    assert actions["1.9.2"] == "supported (the adapter tier runs on 1.9.1 and 1.16.0)"
    assert actions["1.16.0"].startswith("supported; the shared prefix and prefix sharing fall back")
    markdown = releases.drift_markdown(rows)
    assert markdown.count("\n") == len(rows) + 1 and "| 1.14.2 | ok | variadic |" in markdown


def test_a_drifted_release_names_its_broken_fact_and_the_release_to_install(tmp_path):
    rows = releases.contract_drift_table(["1.7.1"])
    assert rows[0].status == "drift"
    assert rows[0].violations == [
        "GRPOTrainer._get_per_token_logps_and_entropies no longer reads self._entropy_bonus_enabled"
    ]
    assert rows[0].action == "the adapter refuses this release at construction: install trl==1.16.0"


@pytest.mark.parametrize("version", ["0.0.0.dev999"])
def test_an_unfetchable_release_is_listed_not_fatal(version, tmp_path):
    shutil.copy(provenance.fetch_trl_wheel("0.29.1"), tmp_path)
    rows = releases.contract_drift_table(["0.29.1", version], cache_dir=tmp_path)
    assert [r.status for r in rows] == ["drift", "unavailable"]
    assert any("compute_aux_loss" in v for v in rows[0].violations)
    assert version in rows[1].violations[0] and rows[1].action == "not fetched: no wheel to read"


def test_the_published_support_table_is_the_one_the_command_writes():
    """docs/trl_releases.md's table is ``python -m papo_nb.workbook.verification.trl_releases --page`` on the
    recorded releases."""
    page = (Path(__file__).resolve().parents[1] / releases.SUPPORT_PAGE).read_text()
    assert releases.TABLE_START in page and releases.TABLE_END in page
    assert releases.with_support_table(page, releases.support_table()) == page


def test_a_page_without_the_table_markers_is_refused_by_name():
    with pytest.raises(ValueError, match="the page has no '<!-- TRL support table"):
        releases.with_support_table("# a page\n", "| table |")
