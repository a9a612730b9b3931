"""The MLflow pages a reviewer opens first, in Debian's chromium (headless, driven by Playwright), as screenshots.

    python -m papo_nb.infra.review_screens --tracking-uri sqlite:////abs/mlflow.db [--out docs/mlflow_review]

It serves the store with ``papo-nb ui``'s server (``servers.serve_mlflow_ui``), opens the newest workbook run and
saves, at 1400x900: the workbook run's results page, the runs list with the ``headline/*`` columns added (as a user
adds them: MLflow keeps a column choice in the browser), notebook 03's charts and its completions table (the masks
with their legends), the study arms in the compare view, and the models list with its metric and dataset columns.
Each PNG is reduced to 256 colours (a few tens of KB). ``tests/test_browser.py`` drives the same pages with the same
helpers (``browser_context``, ``add_runs_columns``) and checks what they show.

Needs the ``test`` extra (playwright) and chromium (``apt-get install -y chromium``; ``PAPO_NB_CHROMIUM`` overrides
the binary). docs/mlflow_review.md shows the committed shots.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow import MlflowClient

from papo_nb.infra.servers import serve_mlflow_ui, server_base
from papo_nb.infra.tracking import EXPERIMENT_NAME

CHROMIUM = os.environ.get("PAPO_NB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 900}
ML_VIEW = "?workflowType=machine_learning"
# The workbook run's headline columns, added to the runs list so that a reviewer sees them without scrolling.
HEADLINE_COLUMNS = (
    "headline/contract_passed",
    "headline/probe_passed",
    "headline/heldout_original",
    "headline/heldout_masked",
)
# MLflow's default run columns, wide and empty on a workbook run: unticked before the headline columns are added.
DEFAULT_RUN_COLUMNS = ("Dataset", "Source", "Models")


def hide_mlflow_assistant(context) -> None:
    """MLflow 3.17 opens its "MLflow Assistant" side panel on first load; it only narrows the pages. If these
    localStorage keys change in another MLflow version the panel shows, and the pages still work."""
    context.add_init_script(
        "try { localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
        " localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false'); } catch (e) {}"
    )


def browser_context(playwright, profile: Path, chromium: str = CHROMIUM):
    """A fresh headless chromium profile at ``VIEWPORT``, the assistant panel closed; 60 s page timeout."""
    context = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=chromium, args=CHROMIUM_ARGS, headless=True, viewport=VIEWPORT
    )
    context.set_default_timeout(60_000)
    hide_mlflow_assistant(context)
    return context


def add_runs_columns(page, names, drop=DEFAULT_RUN_COLUMNS) -> None:
    """On a runs list: untick the ``drop`` columns, then add each of ``names`` through Columns and its search."""
    page.get_by_role("button", name="Columns", exact=True).click()
    for attribute in drop:
        page.get_by_text(attribute, exact=True).last.click()
    page.keyboard.press("Escape")
    for name in names:
        page.get_by_role("button", name="Columns", exact=True).click()
        page.get_by_placeholder("Search columns").fill(name)
        # The search highlights the typed text inside every match (<strong>name</strong>_vision): take the entry
        # whose whole label is the name, not a longer one that contains it.
        page.locator(f"xpath=//*[normalize-space(.)='{name}' and normalize-space(..)='{name}']").last.click()
        page.keyboard.press("Escape")


# The models list's columns for a reviewer: where each model comes from, its dataset and a few scores (the list
# otherwise opens on every metric of every dataset and every param, far wider than the window).
MODEL_COLUMNS = (
    "eval/accuracy_original",
    "eval/accuracy_masked",
    "eval/overall/avg_at_k",
    "eval/vision_dependent/avg_at_k",
)
MODEL_COLUMNS_DROPPED = ("Metrics", "Parameters", "Status", "Registered models")
MODELS_VIEWPORT = {"width": 2000, "height": 500}  # the models list's columns are wide: one wider, shorter shot
_TREE_NODE = ".du-bois-light-tree-treenode"  # MLflow 3.17's column chooser is an antd tree


def choose_model_columns(page, metrics=MODEL_COLUMNS) -> None:
    """On the models list: untick ``MODEL_COLUMNS_DROPPED`` (all metrics among them), then tick ``metrics`` in every
    dataset group the chooser shows them in (it may not draw every group's: the held-out group's come first)."""
    page.get_by_role("button", name="Columns", exact=True).click()

    def node(title: str):
        return page.locator(_TREE_NODE).filter(has=page.locator(f"[title='{title}']"))

    for title in MODEL_COLUMNS_DROPPED:
        node(title).first.locator(".du-bois-light-tree-checkbox").click()
    groups = page.locator(_TREE_NODE).filter(has=page.locator("[title^='Dataset: '], [title='No dataset']"))
    for index in range(groups.count()):
        groups.nth(index).locator(".du-bois-light-tree-switcher").click()
    for title in metrics:
        found = node(title)
        for index in range(found.count()):
            found.nth(index).locator(".du-bois-light-tree-checkbox").click()
    page.keyboard.press("Escape")


def _save(page, out: Path, name: str) -> Path:
    from PIL import Image

    path = out / f"{name}.png"
    page.screenshot(path=str(path))
    Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
    return path


def _latest_workbook(client: MlflowClient, experiment_id: str):
    (parent,) = client.search_runs(
        [experiment_id], "tags.`papo_nb.kind` = 'workbook'", order_by=["attributes.start_time DESC"], max_results=1
    )
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {run.data.tags.get("papo_nb.notebook"): run for run in children}


@contextmanager
def review_browser(profile: Path) -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = browser_context(playwright, profile)
        try:
            yield context
        finally:
            context.close()


# Every thumbnail in the viewport decoded (a screenshot taken earlier shows a loading spinner in a row), and more
# than three of them: the table has rendered its image columns.
ALL_VISIBLE_IMAGES_DECODED = """() => {
    const shown = Array.from(document.images).filter(i => {
        const box = i.getBoundingClientRect();
        return box.bottom > 0 && box.top < window.innerHeight && box.right > 0 && box.left < window.innerWidth;
    });
    return shown.length > 3 && shown.every(i => i.complete && i.naturalWidth > 0);
}"""


def take_screens(tracking_uri: str, out: Path, profile: Path) -> list[Path]:
    """The screenshots of the module docstring, of the newest workbook run in ``tracking_uri``, into ``out``."""
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id
    parent, notebooks = _latest_workbook(client, experiment_id)
    training, study = notebooks["03_training_run"], notebooks["04_method_study"]
    arms = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{study.info.run_id}'")
    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with serve_mlflow_ui(tracking_uri=tracking_uri) as landing, review_browser(profile) as browser:
        url, page = server_base(landing), browser.new_page()
        experiment = f"{url}/#/experiments/{experiment_id}"
        page.goto(f"{experiment}/runs/{parent.info.run_id}")
        expect(page.locator("p").filter(has_text="notebooks finished").first).to_be_visible()
        shots.append(_save(page, out, "workbook_run"))
        page.goto(f"{experiment}/runs{ML_VIEW}")
        expect(page.locator(f"[role=row][row-id='{parent.info.run_id}']").first).to_be_visible()
        add_runs_columns(page, HEADLINE_COLUMNS)
        expect(page.locator("[role=columnheader]").filter(has_text=HEADLINE_COLUMNS[-1]).first).to_be_visible()
        shots.append(_save(page, out, "runs_list_headlines"))
        page.goto(f"{experiment}/runs/{training.info.run_id}/model-metrics{ML_VIEW}")
        expect(page.locator("svg.main-svg").first).to_be_visible()
        shots.append(_save(page, out, "training_run_charts"))
        page.goto(f"{experiment}/runs/{training.info.run_id}/artifacts/completions.json{ML_VIEW}")
        page.wait_for_function(ALL_VISIBLE_IMAGES_DECODED)
        page.get_by_text("mask_missed_content", exact=True).first.scroll_into_view_if_needed()  # the masks' columns
        page.wait_for_function(ALL_VISIBLE_IMAGES_DECODED)
        shots.append(_save(page, out, "completions_masks"))
        ids = ",".join(f'"{run.info.run_id}"' for run in arms)
        page.goto(f'{url}/#/compare-runs?runs=[{ids}]&experiments=["{experiment_id}"]')
        expect(page.get_by_text(arms[0].info.run_name, exact=True).first).to_be_visible()
        shots.append(_save(page, out, "study_arms_compare"))
        page.goto(f"{experiment}/models{ML_VIEW}")
        expect(page.get_by_text("checkpoint-", exact=False).first).to_be_visible()
        choose_model_columns(page)
        page.set_viewport_size(MODELS_VIEWPORT)
        expect(page.locator("[role=columnheader]").filter(has_text=MODEL_COLUMNS[0]).first).to_be_visible()
        shots.append(_save(page, out, "models_list"))
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tracking-uri", required=True, help="the store of a smoke workbook run (sqlite:////abs/...)")
    parser.add_argument("--out", type=Path, default=Path("docs/mlflow_review"), help="where the PNGs go")
    parser.add_argument("--profile", type=Path, default=Path("runs/review_screens_profile"), help="chromium profile")
    args = parser.parse_args(argv)
    if not os.access(CHROMIUM, os.X_OK):
        parser.error(f"no chromium at {CHROMIUM} (apt-get install -y chromium, or set PAPO_NB_CHROMIUM)")
    for path in take_screens(args.tracking_uri, args.out, args.profile):
        print(f"{path}: {path.stat().st_size:,} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
