"""Read a matplotlib Figure back as a reviewer sees it: every named line with finite data (positive on a log axis),
every point and bar where the axes can draw it, the texts that count what is off-axis, the legend's place."""

from __future__ import annotations

import numpy as np
from matplotlib.collections import PathCollection
from matplotlib.patches import Rectangle


def named(artists) -> list:
    return [a for a in artists if not str(a.get_label()).startswith("_")]


def _data_coordinates(artist, ax) -> tuple[bool, bool]:
    """Whether the artist's x and y are data coordinates (an ``axhline``'s x is the axes' fraction)."""
    return artist.get_transform().contains_branch_seperately(ax.transData)


def _drawable(values: np.ndarray, scale: str) -> bool:
    return bool(np.isfinite(values).all() and (scale not in ("log",) or (values > 0).all()))


def assert_lines_finite(fig) -> None:
    """Each named line has data, all of it finite, and positive where its axis is logarithmic."""
    for ax in fig.axes:
        for line in named(ax.lines):
            x, y = (np.asarray(v, dtype=float) for v in line.get_data())
            where = f"{ax.get_title()!r}: line {line.get_label()!r}"
            assert x.size and y.size, f"{where} has no data"
            x_data, y_data = _data_coordinates(line, ax)
            assert np.isfinite(x).all() and np.isfinite(y).all(), f"{where} has non-finite data"
            assert not x_data or _drawable(x, ax.get_xscale()), f"{where}: x cannot sit on a {ax.get_xscale()} axis"
            assert not y_data or _drawable(y, ax.get_yscale()), f"{where}: y cannot sit on a {ax.get_yscale()} axis"


def scatter_offsets(ax) -> np.ndarray:
    """Every scatter point of the axes, (n, 2)."""
    parts = [c.get_offsets() for c in ax.collections if isinstance(c, PathCollection)]
    return np.concatenate(parts) if parts else np.empty((0, 2))


def assert_points_drawn(ax) -> None:
    """Every scatter point finite, and positive on a log axis: nothing silently dropped by the axes."""
    offsets = scatter_offsets(ax)
    assert _drawable(offsets[:, 0], ax.get_xscale()), f"{ax.get_title()!r}: x of a point cannot be drawn"
    assert _drawable(offsets[:, 1], ax.get_yscale()), f"{ax.get_title()!r}: y of a point cannot be drawn"


def bars(ax) -> list[Rectangle]:
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def assert_bars_drawn(ax) -> None:
    """Every bar's height finite and, on a log axis, positive; a height of exactly 0 is an empty histogram bin (a
    figure that must show a zero value draws it on a labelled floor, which its own test checks)."""
    heights = np.array([b.get_height() for b in bars(ax) if b.get_height() != 0], dtype=float)
    assert _drawable(heights, ax.get_yscale()), f"{ax.get_title()!r}: a bar's height cannot be drawn"


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def assert_no_empty_panel(fig) -> None:
    """Every axes draws something (a data line, points or bars) or says in a text why it does not."""
    for ax in fig.axes:
        drawn = any(_data_coordinates(line, ax) == (True, True) for line in ax.lines)
        drawn = drawn or len(scatter_offsets(ax)) > 0 or bars(ax) or ax.collections
        assert drawn or ax.texts, f"{ax.get_title()!r}: an empty panel"


def assert_readable(fig) -> None:
    assert_lines_finite(fig)
    assert_no_empty_panel(fig)
    for ax in fig.axes:
        assert_points_drawn(ax) if len(scatter_offsets(ax)) else None
        assert_bars_drawn(ax) if bars(ax) else None
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    shown = {t.get_text() for legend in legends for t in legend.get_texts()}
    for ax in fig.axes:  # a legend shared by panels that draw the same series may stand on one of them
        labelled = {a.get_label() for a in named([*ax.lines, *ax.collections, *ax.containers])}
        assert labelled <= shown, f"{ax.get_title()!r}: named series missing from every legend: {labelled - shown}"


def legend_covers_a_bar(fig) -> list[str]:
    """The bars (of non-zero height) each axes' legend overlaps, once drawn."""
    fig.draw_without_rendering()
    covered = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent()
        for bar in bars(ax):
            if bar.get_height() > 0 and box.overlaps(bar.get_window_extent()):
                covered.append(f"{ax.get_title()}: bar at x={bar.get_x():.2f}")
    return covered
