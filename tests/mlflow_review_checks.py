"""What ``tests/test_browser.py`` reads off MLflow's pages for a reviewer: the completions table's rows with the
colours in the pixels the browser decoded, and the runs-table column of the one held-out accuracy metric. Playwright
is imported where it is used: without it the browser tests skip instead of failing to import."""

from __future__ import annotations

import urllib.parse

import pytest

from papo_nb.infra.review_screens import HEADLINE_COLUMNS, add_runs_columns
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY

# Colours a completions thumbnail is read by: the shapes' fills (testbed.shapes.COLOURS), the mask's grey fill and
# magenta outline. MLflow stores table images as lossy WebP, so a pixel counts as a colour within COLOUR_TOLERANCE
# (sum of absolute channel differences), and a colour is present when it covers PRESENT_FRACTION of the pixels.
COLOUR_TOLERANCE = 60
PRESENT_FRACTION = 0.003
COUNT_COLOURS = r"""(img, [palette, tolerance]) => {
    const canvas = document.createElement('canvas');
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const context = canvas.getContext('2d');
    context.drawImage(img, 0, 0);
    const data = context.getImageData(0, 0, canvas.width, canvas.height).data;
    const counts = Object.fromEntries(Object.keys(palette).map(name => [name, 0]));
    for (let i = 0; i < data.length; i += 4) {
        for (const [name, [r, g, b]] of Object.entries(palette)) {
            if (Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b) < tolerance) {
                counts[name]++;
                break;
            }
        }
    }
    counts.total = data.length / 4;
    return counts;
}"""


def _palette() -> dict[str, tuple[int, int, int]]:
    from papo_nb.testbed.shapes import COLOURS
    from papo_nb.workbook.training.completions import MASK_GREY, MASK_OUTLINE

    return {**COLOURS, "mask_grey": MASK_GREY, "mask_outline": MASK_OUTLINE}


def _present(counts: dict[str, int]) -> set[str]:
    return {name for name, n in counts.items() if name != "total" and n >= PRESENT_FRACTION * counts["total"]}


def _colours_of(image) -> dict[str, int]:
    """COUNT_COLOURS of a PIL image, in Python: the same rule the page applies to what it shows."""
    import numpy as np

    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    counts, left = {}, np.ones(len(pixels), dtype=bool)
    for name, colour in _palette().items():
        close = left & (np.abs(pixels - np.array(colour)).sum(1) < COLOUR_TOLERANCE)
        counts[name], left = int(close.sum()), left & ~close
    return {**counts, "total": len(pixels)}


def completions_rows(page) -> list[dict]:
    """Every row of the completions table the page shows, through all its pages: each cell's text and, for the two
    image columns, the colours counted in the pixels the browser decoded."""
    from playwright.sync_api import expect

    headers = page.locator("[role=columnheader] .table-header-text").evaluate_all("els => els.map(e => e.title)")
    rows, palette = [], _palette()
    while True:
        body = page.locator("[role=row]").filter(has=page.locator("[role=cell]"))
        expect(body.first).to_be_visible()
        for row in body.all():
            cells = row.locator("[role=cell]").all()
            record = dict(zip(headers, (cell.inner_text().strip() for cell in cells), strict=True))
            for column in ("image", "masked_image"):
                image = cells[headers.index(column)].locator("img")
                page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
                record[column] = image.evaluate(COUNT_COLOURS, [palette, COLOUR_TOLERANCE])
            rows.append(record)
        following = page.locator("li[title='Next Page']")
        if following.get_attribute("aria-disabled") == "true":
            return rows
        first_item = body.first.inner_text()
        following.click()
        expect(body.first).not_to_have_text(first_item)


def check_completions_rows(rows: list[dict], train_dataset) -> None:
    """Each row's thumbnail shows its own item (the shape colours of the item its answer and prompt are), a colour
    question's answer is a colour in its pixels, and its masked thumbnail shows masked patches (grey, outlined)."""
    from papo_nb.workbook.training.completions import image_digest

    items = {image_digest(item["image"]): item for item in train_dataset}
    shape_colours = set(_palette()) - {"mask_grey", "mask_outline"}
    for row in rows:
        where = f"step {row['step']} row {row['row']}"
        item = items[row["item"]]
        assert row["answer"] == item["answer"] and item["prompt"][0]["content"][1]["text"] in row["prompt"], where
        shown = _present(row["image"]) & shape_colours
        assert shown == _present(_colours_of(item["image"])) & shape_colours, (where, shown)
        if item["kind"] == "colour":
            assert row["answer"] in shown, (where, row["answer"], shown)
        masked = row["masked_image"]
        assert masked["mask_grey"] >= 0.1 * masked["total"] and masked["mask_outline"] > 0, (where, masked)


def heldout_accuracy_column(page, url, client, experiment_id, runs, study_runs, shoot) -> None:
    """The runs holding ``HELDOUT_ACCURACY`` (filtered by it), its column added as a user adds one (Columns, search,
    tick): notebook 03's, 05's and every study arm's rows show their value in it."""
    from playwright.sync_api import expect

    expected = [client.get_run(runs["03_training_run"]), client.get_run(runs["05_evaluation"]), *study_runs]
    values = {run.info.run_id: run.data.metrics[HELDOUT_ACCURACY] for run in expected}
    search = urllib.parse.quote(f"metrics.`{HELDOUT_ACCURACY}` >= 0")
    order = urllib.parse.quote(f"metrics.`{HELDOUT_ACCURACY}`")  # sorted by a metric, the table lists runs flat
    page.goto(
        f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&searchFilter={search}"
        f"&orderByKey={order}&orderByAsc=false"
    )
    for run_id in values:  # every run listed before its columns are chosen (the selector lists their metrics)
        expect(page.locator(f"[role=row][row-id='{run_id}']").first).to_be_visible()
    page.get_by_role("button", name="Columns", exact=True).click()
    page.get_by_placeholder("Search columns").fill(HELDOUT_ACCURACY)
    page.get_by_text(HELDOUT_ACCURACY, exact=True).last.click()
    page.keyboard.press("Escape")
    header = page.locator("[role=columnheader]").filter(has_text=HELDOUT_ACCURACY).first
    expect(header).to_be_visible()
    column = header.get_attribute("col-id")
    shoot(page, "mlflow_11b_heldout_accuracy_column")
    for run_id, value in values.items():
        cell = page.locator(f"[role=row][row-id='{run_id}'] [col-id='{column}']").first
        expect(cell).to_be_visible()
        assert float(cell.inner_text()) == pytest.approx(value, abs=5e-3), (
            client.get_run(run_id).info.run_name,
            value,
        )
    shoot(page, "mlflow_11b_heldout_accuracy_column")


def results_page_and_headline_columns(page, url, client, experiment_id, parent_id, shoot) -> None:
    """The workbook run opens on its results page (the Description): verdict, probe status and held-out accuracy
    original and masked, in the first screen; then the runs list with a column for each headline, each cell the
    parent's value, every header within the window's width."""
    from playwright.sync_api import expect

    parent = client.get_run(parent_id)
    metrics = parent.data.metrics
    page.goto(f"{url}/#/experiments/{experiment_id}/runs/{parent_id}")
    summary = page.locator("p").filter(has_text="notebooks finished").first
    expect(summary).to_be_visible()
    text = summary.inner_text()
    original, masked = metrics["headline/heldout_original"], metrics["headline/heldout_masked"]
    heldout = f"held-out {original:.3f} original / {masked:.3f} masked"
    for wanted in ("contract PASS", "probe passed (power", heldout):
        assert wanted in text, (wanted, text)
    box = summary.bounding_box()
    assert box and box["y"] + box["height"] <= page.viewport_size["height"], f"summary below the first screen: {box}"
    shoot(page, "mlflow_20_workbook_results_page")

    page.goto(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
    expect(page.locator(f"[role=row][row-id='{parent_id}']").first).to_be_visible()
    add_runs_columns(page, HEADLINE_COLUMNS)
    width = page.viewport_size["width"]
    for name in HEADLINE_COLUMNS:
        header = page.locator("[role=columnheader]").filter(has_text=name).first
        expect(header).to_be_visible()
        box = header.bounding_box()
        assert box and box["x"] + box["width"] <= width, f"column {name} beyond the window: {box}"
        cell = page.locator(f"[role=row][row-id='{parent_id}'] [col-id='{header.get_attribute('col-id')}']").first
        assert float(cell.inner_text()) == pytest.approx(metrics[name], abs=5e-3), name
    shoot(page, "mlflow_21_runs_list_headline_columns")


def notebook_renders_as_html(page, url, experiment_id, run_id, name, shoot) -> None:
    """The executed notebook's HTML copy renders in the artifact view: its code and outputs are text on the page."""
    from playwright.sync_api import expect

    page.goto(f"{url}/#/experiments/{experiment_id}/runs/{run_id}/artifacts/notebook/{name}.html")
    expect(page.get_by_text(f"notebook/{name}.html", exact=True)).to_be_visible()
    frame = page.frame_locator("iframe").first
    expect(frame.get_by_text("papo_nb.infra.notebook_start import start").first).to_be_visible()
    expect(frame.locator(".jp-OutputArea-output").first).to_be_visible()
    shoot(page, f"mlflow_22_{name}_html")
