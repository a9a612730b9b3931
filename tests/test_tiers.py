"""The tiers are markers on the tests; conftest's safety net stops a collection where a test that takes the tiny model
(or the smoke workbook) carries no tier marker, so it cannot slip into the fast tier."""

from types import SimpleNamespace

import pytest
from conftest import unmarked_heavy_tests


def fake_item(nodeid: str, fixtures: list[str], markers: list[str]):
    return SimpleNamespace(
        nodeid=nodeid,
        fixturenames=fixtures,
        get_closest_marker=lambda name: SimpleNamespace(name=name) if name in markers else None,
    )


def test_an_unmarked_model_test_is_named_with_the_marker_it_needs():
    items = [
        fake_item("t.py::marked", ["tiny_vlm_path", "tmp_path"], ["model"]),
        fake_item("t.py::unmarked", ["policy", "tiny_vlm_path"], []),
        fake_item("t.py::slow_model", ["tiny_vlm_path"], ["slow"]),
        fake_item("t.py::workbook", ["smoke_workbook"], ["parametrize"]),
        fake_item("t.py::pure", ["tmp_path"], []),
    ]
    assert unmarked_heavy_tests(items) == [
        "t.py::unmarked: uses tiny_vlm_path, add @pytest.mark.model",
        "t.py::workbook: uses smoke_workbook, add @pytest.mark.notebook",
    ]


@pytest.mark.parametrize("marker", ["model", "slow", "notebook", "browser"])
def test_the_tier_markers_are_registered(request, marker):
    registered = [line.split(":")[0] for line in request.config.getini("markers")]
    assert marker in registered
