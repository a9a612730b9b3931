"""The figures the notebooks log carry what a reviewer needs: title, axis labels with units, legends,
and on the calibration plot the tolerance boundary and the floor where exact zeros are drawn."""

import io

import numpy as np
import pytest

from papo_nb.papo.probe.contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from papo_nb.workbook.training.figures import PANELS, plot_training_curves
from papo_nb.workbook.verification.calibration import CalibrationPoint, plot_calibration, zero_floor


def series_count(ax) -> int:
    return len(ax.lines) + len(ax.collections)


def assert_reviewable(ax, where: str) -> None:
    """Title and axis labels non-empty; a legend naming every labelled series when there are several."""
    assert ax.get_title().strip(), f"{where}: no title"
    assert ax.get_xlabel().strip(), f"{where}: no x label"
    assert ax.get_ylabel().strip(), f"{where}: no y label"
    if series_count(ax) > 1:
        legend = ax.get_legend()
        assert legend is not None, f"{where}: {series_count(ax)} series but no legend"
        shown = {t.get_text() for t in legend.get_texts()}
        labelled = {a.get_label() for a in [*ax.lines, *ax.collections] if not a.get_label().startswith("_")}
        assert labelled <= shown, f"{where}: series missing from the legend: {labelled - shown}"


def assert_renders(fig) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    assert buffer.tell() > 1000


def calibration_points() -> list[CalibrationPoint]:
    points = []
    for phase in ("phase1", "phase2"):
        for precision in ("fp32", "bf16"):
            for batch, parent in enumerate((0.1, 0.2)):
                roundoff = 0.0 if precision == "fp32" else 1e-4 * parent  # exact zeros in fp32, as on CPU
                points.append(
                    CalibrationPoint(
                        phase,
                        precision,
                        batch,
                        parent,
                        roundoff,
                        GAMMA_ZERO_GRADIENT_REL_TOL * parent,
                        0.5 * parent,
                        0.4 * parent,
                        1e-2,
                        True,
                    )
                )
    return points


def test_calibration_plot_has_labels_units_legend_boundary_and_zero_floor():
    points = calibration_points()
    fig = plot_calibration(points)
    (ax,) = fig.axes
    assert_reviewable(ax, "calibration")
    assert "L2" in ax.get_xlabel() and "L2" in ax.get_ylabel(), "axis labels must name the norm (the unit)"
    assert ax.get_xscale() == ax.get_yscale() == "log"

    boundary = [line for line in ax.lines if "tolerance" in line.get_label()]
    assert len(boundary) == 1, [line.get_label() for line in ax.lines]
    x, y = boundary[0].get_data()
    assert np.allclose(y, np.maximum(GAMMA_ZERO_GRADIENT_REL_TOL * np.asarray(x), GAMMA_ZERO_GRADIENT_ABS_FLOOR))
    assert min(x) < min(p.parent_grad_norm for p in points) and max(x) > max(p.parent_grad_norm for p in points)

    zero_lines = [line for line in ax.lines if "exact zero" in line.get_label()]
    assert len(zero_lines) == 1, "the floor where exact zeros are drawn must be marked and named"
    floor = zero_lines[0].get_ydata()[0]
    values = [v for p in points for v in (p.grad_diff_norm, p.perception_grad_norm, p.injected_leak_diff)]
    assert floor == pytest.approx(zero_floor(values + [GAMMA_ZERO_GRADIENT_ABS_FLOOR]))
    assert all(v > floor for v in values if v > 0), "the floor must lie under every non-zero value"
    zeros_drawn = [off for c in ax.collections for off in c.get_offsets() if np.isclose(off[1], floor)]
    assert len(zeros_drawn) == sum(p.grad_diff_norm == 0 for p in points), "exact zeros are drawn on the floor"
    assert_renders(fig)


def test_training_curves_have_labels_units_titles_and_legends():
    steps = [
        {
            "step": s,
            "reward": 0.1 * s,
            "perception_loss": -0.01 * s,
            "entropy": 5.873 + 1e-4 * s,
            "masked_entropy": 5.873 + 2e-4 * s,
            "clip_ratio/high_mean": 0.0,
        }
        for s in range(1, 7)
    ]
    fig = plot_training_curves(steps)
    assert fig.get_suptitle().strip()
    assert len(fig.axes) == len(PANELS)
    for ax, (series, unit, title) in zip(fig.axes, PANELS):
        assert_reviewable(ax, title)
        assert ax.get_ylabel() == unit and ax.get_xlabel() == "optimizer step"
        assert len(ax.lines) == len(series), title
        assert ax.get_legend() is not None, f"{title}: every series is named, even a single one"
        assert ax.yaxis.get_major_formatter().get_useOffset() is False, f"{title}: tick values must be plain"
    assert_renders(fig)


def test_training_curves_say_when_a_metric_was_not_logged():
    fig = plot_training_curves([{"step": s, "reward": 1.0} for s in (1, 2)])
    empty = [ax for ax in fig.axes if not ax.lines]
    assert len(empty) == len(PANELS) - 1
    for ax in empty:
        assert_reviewable(ax, ax.get_title())
        assert any("not logged" in t.get_text() for t in ax.texts), ax.get_title()
    assert_renders(fig)
