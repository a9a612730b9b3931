"""Review in a real browser: Debian's chromium, headless, driven by Playwright.

- the MLflow UI on the smoke workbook's store: the experiment, the workbook run with its nested notebook runs,
  the calibration plot rendered, the probe evidence JSON as text;
- what a reviewer of the training run finds there (``papo_nb.workbook.training.review``): ``papo-nb ui``'s landing page
  (the runs in the model-training view, the Dataset column filled), notebook 03's completions table with original
  and masked images, a checkpoint's logged model with its held-out metrics, a system-metrics chart;
- JupyterLab (``papo_nb.infra.servers.serve_jupyterlab``) on a copy of the notebooks: 01 opened and run with
  Run > Run All Cells until its verdict line shows.

Each step is screenshotted to ``<pytest tmp>/screenshots/`` and copied to ``test-artifacts/browser/`` (git-ignored);
the paths are printed. Without chromium (or playwright) the browser tests skip, except under CI (``CI`` set),
where they fail. ``PAPO_NB_CHROMIUM`` overrides the browser binary (default ``/usr/bin/chromium``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow_review_checks import (
    check_completions_rows,
    completions_rows,
    heldout_accuracy_column,
    notebook_renders_as_html,
    results_page_and_headline_columns,
)

from papo_nb.infra.review_screens import CHROMIUM, MODELS_VIEWPORT, browser_context, choose_model_columns
from papo_nb.infra.servers import serve_jupyterlab, serve_mlflow_ui, server_base
from papo_nb.infra.tracking import EXPERIMENT_NAME
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.study.arms import ARM_COLOURS
from papo_nb.workbook.training.builder import load_datasets

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "browser"
NOTEBOOK_RUN_TIMEOUT_S = 300  # Run All of 01 takes ~15-60 s on CPU; a kernel on a loaded machine may be slow to start


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; under CI the browser tests must run (.ci/run installs Debian's chromium)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium():
    """The browser binary; session-scoped so that, named first, it skips before the smoke workbook is run."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"no chromium at {CHROMIUM} (apt-get install -y chromium, or set PAPO_NB_CHROMIUM)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[test]')")
    return CHROMIUM


@pytest.fixture(scope="module")
def playwright(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture
def browser(chromium, playwright, tmp_path):
    """A fresh headless chromium profile; pages time out after 60 s unless told otherwise."""
    context = browser_context(playwright, tmp_path / "chromium-profile", chromium)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory):
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # only this run's screenshots in test-artifacts/browser/
    ARTIFACTS.mkdir(parents=True)
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def shoot(screenshot_dir, capsys):
    """shoot(page, name): full-window screenshot to the tmp folder and test-artifacts/browser/; prints both paths."""

    def take(page, name: str) -> Path:
        path = screenshot_dir / f"{name}.png"
        page.screenshot(path=str(path))
        shutil.copy2(path, ARTIFACTS / path.name)
        with capsys.disabled():
            print(f"\n  screenshot: {path}  (copy: {ARTIFACTS / path.name})", end="")
        return path

    return take


def _expect():
    from playwright.sync_api import expect

    expect.set_options(timeout=60_000)  # the servers run on a 2-core machine next to other tests
    return expect


# --------------------------------------------------------------------------------------------
# MLflow UI
# --------------------------------------------------------------------------------------------


def test_mlflow_ui_shows_the_workbook_its_notebook_runs_the_calibration_plot_and_evidence(
    chromium, smoke_workbook, browser, shoot
):
    expect = _expect()
    client = MlflowClient(smoke_workbook.tracking_uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id
    parent = client.get_run(smoke_workbook.parent_run_id)
    runs = {nb.name: nb.run_id for nb in smoke_workbook.notebooks}
    assert list(runs) == [
        "01_contract_verification",
        "02_probe_calibration",
        "03_training_run",
        "04_method_study",
        "05_evaluation",
    ]
    page = browser.new_page()

    with serve_mlflow_ui(tracking_uri=smoke_workbook.tracking_uri) as landing:
        url = server_base(landing)
        # 1. The experiments list names the workbook's experiment; following its link opens it.
        page.goto(f"{url}/#/experiments")
        experiment_link = page.get_by_role("link", name=EXPERIMENT_NAME, exact=True)
        expect(experiment_link).to_be_visible()
        shoot(page, "mlflow_1_experiments")
        experiment_link.click()
        page.wait_for_url(re.compile(rf"#/experiments/{experiment_id}\b"))

        # 2. Its runs table ("Model training" view) lists the workbook run; expanding it shows the notebook runs.
        page.goto(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
        parent_row = page.get_by_role("row").filter(has_text=parent.info.run_name)
        expect(parent_row).to_be_visible()
        parent_row.get_by_role("gridcell").filter(has=page.get_by_role("link", name=parent.info.run_name)).get_by_role(
            "button"
        ).first.click()  # the [+] before a parent run's name
        for name in runs:
            expect(page.get_by_role("link", name=name, exact=True)).to_be_visible()
        shoot(page, "mlflow_2_runs_nested")

        # 3. The workbook run's page lists its child runs by name.
        page.get_by_role("link", name=parent.info.run_name, exact=True).click()
        page.wait_for_url(re.compile(rf"/runs/{parent.info.run_id}"))
        expect(page.get_by_text("Child runs", exact=True)).to_be_visible()
        child_runs = page.get_by_test_id("key-value-Child runs")  # the results page above links them too
        for name in runs:
            expect(child_runs.get_by_role("link", name=name, exact=True)).to_be_visible()
        shoot(page, "mlflow_3_workbook_run")

        # 4. The study's comparison figure (04, on a page of its own) and the calibration plot (02) are shown as
        # images that really decoded.
        # (The UI keeps a run's artifact view when only the hash changes, so each run gets a fresh page.)
        study_page = browser.new_page()
        for shown_on, notebook, figure, shot in (
            (study_page, "04_method_study", "study_accuracy", "mlflow_4b_study_comparison"),
            (page, "02_probe_calibration", "calibration", "mlflow_4_calibration_plot"),
        ):
            shown_on.goto(f"{url}/#/experiments/{experiment_id}/runs/{runs[notebook]}/artifacts/figures/{figure}.png")
            expect(shown_on.get_by_text(f"figures/{figure}.png", exact=True)).to_be_visible()
            image = shown_on.locator(f"img[src^='blob:']:visible, img[src*='{figure}.png']:visible").first
            expect(image).to_be_visible()
            shown_on.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
            width, height = image.evaluate("img => [img.naturalWidth, img.naturalHeight]")
            # a real figure, not a broken-image icon: 04's accuracy figure is one panel since all its items are
            # vision items (450 px wide), the calibration plot two
            assert width >= 400 and height >= 300, f"{figure} decoded at {width}x{height}"
            box = image.bounding_box()
            assert box and box["width"] > 200 and box["height"] > 100, f"{figure} drawn at {box}"
            shoot(shown_on, shot)
        study_page.close()

        # 5. Evidence JSON as text: the calibration margins (02) and the probe evidence (01).
        margins = client.download_artifacts(runs["02_probe_calibration"], "evidence/calibration_margins.json")
        assert '"separated": true' in Path(margins).read_text()
        # The viewer highlights JSON token by token; its <pre> holds the text as a person reads it.
        # In the same run the page keeps its selection when only the hash changes: open the file from the tree.
        page.get_by_text("evidence", exact=True).click()
        page.get_by_text("calibration_margins.json", exact=True).click()
        expect(page.get_by_text("evidence/calibration_margins.json", exact=True)).to_be_visible()
        shown = page.locator("pre").filter(has_text='"separated"')
        expect(shown).to_be_visible()
        for text in ('"separated": true', '"all_losses_bit_equal": true', '"verdict": "SEPARATED: worst roundoff'):
            expect(shown).to_contain_text(text)
        shoot(page, "mlflow_5_calibration_margins")

        page.goto(
            f"{url}/#/experiments/{experiment_id}/runs/{runs['01_contract_verification']}/artifacts/evidence/probe.json"
        )
        expect(page.get_by_text("evidence/probe.json", exact=True)).to_be_visible()
        shown = page.locator("pre").filter(has_text='"loss_bit_equal"')
        expect(shown).to_be_visible()
        for text in ('"status": "passed"', '"loss_bit_equal": true', '"passed": true', '"perception_kl": '):
            expect(shown).to_contain_text(text)
        shoot(page, "mlflow_6_probe_evidence")


def test_the_workbook_run_opens_on_its_results_page_and_notebooks_render_as_html(
    chromium, smoke_workbook, browser, shoot
):
    """Issue 45: the workbook run's Description shows the verdict, the probe status and held-out accuracy original and
    masked in its first screen, the runs list gets a column for each within the window, and an executed notebook
    opens as HTML in the artifact view (its code and outputs rendered)."""
    _expect()
    client = MlflowClient(smoke_workbook.tracking_uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id
    runs = {nb.name: nb.run_id for nb in smoke_workbook.notebooks}
    page = browser.new_page()
    with serve_mlflow_ui(tracking_uri=smoke_workbook.tracking_uri) as landing:
        url = server_base(landing)
        results_page_and_headline_columns(page, url, client, experiment_id, smoke_workbook.parent_run_id, shoot)
        for name in ("03_training_run", "04_method_study"):
            notebook_renders_as_html(browser.new_page(), url, experiment_id, runs[name], name, shoot)


def _decoded_images(page, locator, at_least: int) -> list[tuple[int, int]]:
    """Wait until ``at_least`` of the images ``locator`` finds are decoded; their natural sizes."""
    page.wait_for_function(
        "([sel, n]) => Array.from(document.querySelectorAll(sel)).filter(i => i.complete && i.naturalWidth > 0)"
        ".length >= n",
        arg=[locator, at_least],
    )
    return page.eval_on_selector_all(locator, "imgs => imgs.map(i => [i.naturalWidth, i.naturalHeight])")


def test_mlflow_ui_shows_what_a_reviewer_of_the_training_run_needs(chromium, smoke_workbook, browser, shoot):
    import mlflow

    expect = _expect()
    client = MlflowClient(smoke_workbook.tracking_uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id
    runs = {nb.name: nb.run_id for nb in smoke_workbook.notebooks}
    training = client.get_run(runs["03_training_run"])
    # In the store: the study's and the sweep's runs carry gamma and seed as parameters, for MLflow's compare view.
    study_runs = client.search_runs([experiment_id], "tags.`papo_nb.kind` = 'study_run'")
    assert study_runs and all({"gamma", "seed"} <= set(r.data.params) for r in study_runs)
    # One name and one colour per arm: the sweep's run at the chosen gamma is the collapse arm's.
    assert {r.data.params["arm"] for r in study_runs} == {"grpo", "papo_g", "papo_g_collapse"}
    assert all(r.data.tags["mlflow.runColor"] == ARM_COLOURS[r.data.params["arm"]] for r in study_runs)
    ml_view = "?workflowType=machine_learning"
    page = browser.new_page()

    with serve_mlflow_ui(tracking_uri=smoke_workbook.tracking_uri) as landing:
        url = server_base(landing)
        # 1. papo-nb ui's page: the experiment's runs, model-training view; the training run's Dataset column.
        assert landing.startswith(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
        page.goto(landing)
        parent = client.get_run(smoke_workbook.parent_run_id).info.run_name
        parent_row = page.get_by_role("row").filter(has_text=parent)
        expect(parent_row).to_be_visible()
        parent_row.get_by_role("gridcell").filter(has=page.get_by_role("link", name=parent)).get_by_role(
            "button"
        ).first.click()  # the [+] before the workbook run's name
        # (the grid draws a row twice, pinned and scrolling parts, both with the run id)
        training_row = page.locator(f"[role=row][row-id='{training.info.run_id}']").filter(has_text="synthetic-train")
        expect(training_row.first).to_be_visible()
        expect(page.get_by_role("columnheader", name="Dataset").first).to_be_visible()
        shoot(page, "mlflow_7_landing_datasets")

        # 2. Notebook 03's completions table: one across steps, each row's image and its masked image drawn.
        table = "completions.json"
        page.goto(f"{url}/#/experiments/{experiment_id}/runs/{training.info.run_id}/artifacts/{table}{ml_view}")
        expect(page.get_by_text(table, exact=True).first).to_be_visible()  # the file list and the viewer both name it
        for column in ("step", "item", "answer", "prompt", "image", "masked_image", "completion", "advantage"):
            expect(page.get_by_text(column, exact=True).first).to_be_visible()
        sizes = _decoded_images(page, "img[src^='blob:'], img[src*='table_images']", at_least=2)
        assert len(sizes) >= 2 and all(w > 0 and h > 0 for w, h in sizes), sizes
        shoot(page, "mlflow_8_completions_table")
        # Every row, page by page: its thumbnail is its own item's, its mask is drawn visibly.
        rows = completions_rows(page)
        params = load_params(ROOT / "params" / "smoke_fast.yaml")
        assert {int(row["step"]) for row in rows} == set(range(1, params.max_steps + 1))
        check_completions_rows(rows, load_datasets(params)[0])

        # 3. The last checkpoint's logged model lists the held-out metrics notebook 03 measured on it.
        mlflow.set_tracking_uri(smoke_workbook.tracking_uri)
        models = mlflow.search_logged_models(experiment_ids=[experiment_id], output_format="list")
        final = max(
            (m for m in models if m.source_run_id == training.info.run_id), key=lambda m: int(m.tags["papo_nb.step"])
        )
        assert {"eval/accuracy_original", "eval/accuracy_masked", "eval/image_reliance_gap"} <= {
            m.key for m in final.metrics
        }
        page.goto(f"{url}/#/experiments/{experiment_id}/models/{final.model_id}{ml_view}")
        expect(page.get_by_text(final.name).first).to_be_visible()
        expect(page.get_by_text("eval/image_reliance_gap", exact=True)).to_be_visible()
        shoot(page, "mlflow_9_logged_model_metrics")
        page.goto(f"{url}/#/experiments/{experiment_id}/models{ml_view}")
        expect(page.get_by_role("link", name=final.name)).to_be_visible()
        # Issue 45 item 8: the models list names the notebook a checkpoint was logged from, its dataset, and its
        # held-out accuracy in a metric column (they read "ipykernel_launcher.py" and "-" before).
        choose_model_columns(page)
        page.set_viewport_size(MODELS_VIEWPORT)
        row = page.locator("[role=row]").filter(has_text=final.name).first
        index = row.get_attribute("row-index")
        cells = page.locator(f"[role=row][row-index='{index}']")
        expect(cells.filter(has_text="03_training_run.ipynb").first).to_be_visible()
        expect(cells.filter(has_text=f"{params.dataset}-train").first).to_be_visible()
        header = page.locator("[role=columnheader]").filter(has_text=HELDOUT_ACCURACY).first
        expect(header).to_be_visible()
        column = header.get_attribute("aria-colindex")
        cell = page.locator(f"[role=row][row-index='{index}'] [role=gridcell][aria-colindex='{column}']").first
        expect(cell).to_be_visible()
        final_accuracy = next(m.value for m in final.metrics if m.key == HELDOUT_ACCURACY)
        assert float(cell.inner_text()) == pytest.approx(final_accuracy, abs=5e-3)
        assert "ipykernel_launcher" not in page.inner_text("body")
        shoot(page, "mlflow_10_logged_models")

        # 4. One runs-table column holds the held-out accuracy of 03, 05 and every study arm.
        # (on a page of its own: the runs page keeps its earlier filter and expansion when only the hash changes)
        heldout_accuracy_column(browser.new_page(), url, client, experiment_id, runs, study_runs, shoot)

        # 5. The training run's page, and the study arms side by side in MLflow's compare view.
        page.goto(f"{url}/#/experiments/{experiment_id}/runs/{training.info.run_id}/model-metrics{ml_view}")
        expect(page.locator("svg.main-svg").first).to_be_visible()  # its charts drawn
        shoot(page, "mlflow_12_training_run_page")
        ids = ",".join(f'"{r.info.run_id}"' for r in study_runs)
        page.goto(f'{url}/#/compare-runs?runs=[{ids}]&experiments=["{experiment_id}"]')
        for run in study_runs:
            expect(page.get_by_text(run.info.run_name, exact=True).first).to_be_visible()
        shoot(page, "mlflow_13_compare_study_arms")

        # 6. The training run's system metrics are drawn as charts.
        page.goto(f"{url}/#/experiments/{experiment_id}/runs/{training.info.run_id}/system-metrics{ml_view}")
        expect(page.get_by_text("cpu_utilization_percentage", exact=True)).to_be_visible()
        expect(page.locator("svg.main-svg").first).to_be_visible()
        shoot(page, "mlflow_11_system_metrics")


# --------------------------------------------------------------------------------------------
# JupyterLab
# --------------------------------------------------------------------------------------------


def _lab_environment(tmp: Path) -> dict[str, str]:
    """A tmp MLflow store for the interactive run, and JupyterLab state (settings, workspaces) out of $HOME; no
    user setting, so what JupyterLab does is what ``papo-nb lab`` sets (``servers.LAB_SETTING_OVERRIDES``)."""
    return {
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime"),
    }


LAB_URL_LINE = re.compile(r"JupyterLab: (http://127\.0\.0\.1:(\d+))/lab\?token=([0-9a-f]{32,})\s")


def _start_papo_nb_lab(notebooks: Path, env: dict[str, str], *options: str) -> tuple[subprocess.Popen, str]:
    """``papo-nb lab --notebook-dir notebooks [options]`` as a user starts it, and the url line it prints once it
    answers."""
    command = [sys.executable, "-m", "papo_nb.cli", "lab", "--notebook-dir", str(notebooks), *options]
    full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    # SIGINT at its default in the child, whatever this process inherited (ignored, in a background job): the
    # plain Ctrl-C path (test_runner's ui test covers the inherited-ignored one).
    lab = subprocess.Popen(
        command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    return lab, lab.stdout.readline()


def _stop_with_ctrl_c(lab: subprocess.Popen) -> None:
    """Ctrl-C stops the server and its kernels (a kill would leave them running); a kill only if that hangs."""
    if lab.poll() is None:
        lab.send_signal(signal.SIGINT)
        try:
            lab.wait(timeout=60)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait()


# What the notebook shows so far: its verdict line, a traceback (an error output), a dead kernel, or nothing yet.
VERDICT_OR_ERROR = r"""() => {
    const outputs = Array.from(document.querySelectorAll('.jp-Notebook .jp-OutputArea-output'));
    if (outputs.some(o => /Traceback \(most recent call last\)/.test(o.textContent))) return 'error';
    if (outputs.some(o => /^\s*(PASS|FAIL):/m.test(o.textContent))) return 'verdict';
    const status = document.querySelector('#jp-main-statusbar');
    if (status && /\|\s*(Dead|Unknown)/.test(status.textContent)) return 'dead kernel';
    return false;
}"""


def test_jupyterlab_runs_the_contract_notebook_to_its_verdict(browser, shoot, tmp_path):
    expect = _expect()
    notebooks = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", notebooks)  # running writes outputs; never into the repo's notebooks
    env = _lab_environment(tmp_path)
    page = browser.new_page()

    with serve_jupyterlab(notebooks, env=env) as url:
        base, token = url.split("/lab?token=")
        assert base.startswith("http://127.0.0.1:") and len(token) >= 32

        # 1. Open 01 from its url; the notebook shows with its kernel, Python 3, idle.
        page.goto(f"{base}/lab/tree/01_contract_verification.ipynb?token={token}")
        expect(page.get_by_role("heading", name=re.compile("01 · Contract verification"))).to_be_visible()
        status = page.locator("#jp-main-statusbar")
        expect(status).to_contain_text(re.compile(r"Python 3.*\|\s*Idle"), timeout=NOTEBOOK_RUN_TIMEOUT_S * 1000)
        shoot(page, "lab_1_notebook_open")

        # 2. Run > Run All Cells, as a person would.
        page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        run_all = page.locator(".lm-Menu-item", has_text=re.compile(r"^Run All Cells$"))
        expect(run_all).to_be_visible()
        shoot(page, "lab_2_run_menu")
        run_all.click()
        started = time.monotonic()

        # 3. Wait for the last cell's verdict (or the first traceback, or a dead kernel).
        try:
            outcome = page.wait_for_function(
                VERDICT_OR_ERROR, timeout=NOTEBOOK_RUN_TIMEOUT_S * 1000, polling=1000
            ).json_value()
        except Exception as exc:  # playwright's TimeoutError
            shoot(page, "lab_3_timeout")
            pytest.fail(
                f"01_contract_verification showed no verdict line within {NOTEBOOK_RUN_TIMEOUT_S} s of "
                f"Run All Cells (status bar: {status.inner_text()!r}): {exc}"
            )
        last_cell = page.locator(".jp-Notebook .jp-CodeCell").last
        last_cell.scroll_into_view_if_needed()
        shoot(page, "lab_3_verdict")
        if outcome != "verdict":
            errors = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
            detail = errors.first.inner_text()[-2000:] if errors.count() else status.inner_text()
            pytest.fail(f"running 01_contract_verification in JupyterLab ended with {outcome}: {detail}")

        verdict = last_cell.locator(".jp-OutputArea-output").first
        expect(verdict).to_be_visible()
        expect(verdict).to_contain_text(
            re.compile(r"PASS: upstream SHA verified, live TRL contract holds, gamma-zero probe passed")
        )
        # The first code cell imported papo_nb in the kernel and attached an interactive MLflow run.
        expect(page.get_by_text(re.compile(r"^MLflow run [0-9a-f]{32}; files in ")).first).to_be_attached()
        print(f"Run All Cells to verdict: {time.monotonic() - started:.1f} s")

    # The interactive run went to the tmp store from the server's environment, not the project's mlflow.db.
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id])
    assert run.data.tags["papo_nb.interactive"] == "true" and run.data.tags["papo_nb.verdict"].startswith("PASS:")
    assert run.data.metrics["verdict/passed"] == 1.0


AUTOSAVE_INTERVAL_S = 2  # JupyterLab's default is 120 s; the test sets a short one to wait past it in seconds


def _tracked_notebook_files() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((ROOT / "notebooks").iterdir()) if path.is_file()}


def test_browsing_every_notebook_in_papo_nb_lab_leaves_the_tracked_files_byte_identical(browser, shoot, tmp_path):
    """Opening a notebook starts its kernel, and JupyterLab then holds it modified (kernelspec, language_info): with
    autosave on (JupyterLab's default) it rewrote the file within the interval. ``papo-nb lab`` turns autosave off,
    so only the user's own save writes. The served folder is a copy of the tracked files, so a failure here cannot
    rewrite the repository's notebooks; the check is against the tracked bytes."""
    expect = _expect()
    tracked = _tracked_notebook_files()
    notebooks = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", notebooks)
    env = _lab_environment(tmp_path)
    interval = (
        Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "docmanager-extension" / "plugin.jupyterlab-settings"
    )
    interval.parent.mkdir(parents=True)
    interval.write_text(
        f'{{"autosaveInterval": {AUTOSAVE_INTERVAL_S}}}'
    )  # the interval only; autosave is papo-nb lab's
    lab, line = _start_papo_nb_lab(notebooks, env)
    page = browser.new_page()
    try:
        match = LAB_URL_LINE.match(line)
        assert match, f"unexpected first line {line!r}"
        base, _, token = match.groups()
        status = page.locator("#jp-main-statusbar")
        for name in (n for n in tracked if n.endswith(".ipynb")):
            page.goto(f"{base}/lab/tree/{name}?token={token}")
            expect(status).to_contain_text(re.compile(r"Python 3.*\|\s*Idle"), timeout=NOTEBOOK_RUN_TIMEOUT_S * 1000)
            tab = page.locator(".lm-TabBar-tab.jp-mod-current", has_text=name)
            expect(tab).to_have_class(re.compile(r"\bjp-mod-dirty\b"))  # modified in the browser: autosave would write
            # Browse it: select the first cell, walk down every cell (command mode) and back to the top.
            page.locator(".jp-NotebookPanel:visible .jp-Cell").first.click()  # (earlier tabs stay, hidden)
            page.keyboard.press("Escape")
            for key in ("ArrowDown",) * 40 + ("Home",):
                page.keyboard.press(key)
            if name.startswith("03_"):
                shoot(page, "lab_4_notebook_03_open")
        page.wait_for_timeout(5 * AUTOSAVE_INTERVAL_S * 1000)
        # No "Jupyter news?" toast, nor any other notification.
        assert page.locator(".Toastify__toast").all_inner_texts() == []
        assert page.get_by_text(re.compile("Jupyter news", re.I)).count() == 0
        shoot(page, "lab_5_after_autosave_interval")
    finally:
        page.close()
        _stop_with_ctrl_c(lab)
    now = {path.name: path.read_bytes() for path in sorted(notebooks.iterdir()) if path.is_file()}
    assert [name for name in tracked if now.get(name) != tracked[name]] == []
    assert set(now) == set(tracked)  # nothing new beside them (JupyterLab's .ipynb_checkpoints/ is git-ignored)


# --------------------------------------------------------------------------------------------
# papo-nb lab, without a browser
# --------------------------------------------------------------------------------------------


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_papo_nb_lab_serves_the_notebooks_locally_with_a_token_and_stops_on_ctrl_c(tmp_path):
    notebooks = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", notebooks)
    lab, line = _start_papo_nb_lab(notebooks, _lab_environment(tmp_path))
    try:
        match = LAB_URL_LINE.match(line)  # the url line, printed once the server answers
        assert match, f"unexpected first line {line!r}"
        base, port, token = match.groups()
        assert str(notebooks) in line
        assert _status(f"{base}/api/contents") == 403, "the server must require the token"
        assert _status(f"{base}/api/contents?token={token}") == 200
        assert _status(f"{base}/lab/tree/01_contract_verification.ipynb?token={token}") == 200
        if shutil.which("ss"):  # bound to the loopback interface only
            listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
            local = [line.split()[3] for line in listening.splitlines() if line.strip()]
            assert local and all(address == f"127.0.0.1:{port}" for address in local), listening
        lab.send_signal(signal.SIGINT)
        out, _ = lab.communicate(timeout=60)
        assert lab.returncode == 0 and "JupyterLab stopped" in out
        deadline = time.monotonic() + 10
        while _port_open(int(port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _port_open(int(port)), "the server still listens after Ctrl-C"
    finally:
        _stop_with_ctrl_c(lab)  # after a failed check above


def _contents(base: str, token: str, path: str, model: dict | None = None) -> tuple[int, dict]:
    """GET (or PUT ``model``) ``/api/contents/<path>``: the status and the JSON answer."""
    import json

    data = None if model is None else json.dumps(model).encode()
    request = urllib.request.Request(
        f"{base}/api/contents/{path}?token={token}", data=data, method="PUT" if data else "GET"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_papo_nb_lab_lists_the_last_runs_executed_notebooks_and_refuses_to_overwrite_a_tracked_one(tmp_path):
    """Issue 45: the workbook runs' folder is reachable from Lab (``runs/`` in its file browser, the executed copies
    inside), and a save over a tracked notebook is refused with the reason (the bytes stay), while an executed copy
    saves as usual; ``--edit`` allows the save."""
    import json

    notebooks, runs = tmp_path / "notebooks", tmp_path / "runs"
    shutil.copytree(ROOT / "notebooks", notebooks)
    executed = runs / "20261203-101500-abc123" / "03_training_run.ipynb"
    executed.parent.mkdir(parents=True)
    shutil.copy2(notebooks / "03_training_run.ipynb", executed)
    tracked = (notebooks / "03_training_run.ipynb").read_bytes()
    for options, tracked_status in (((), 403), (("--edit",), 200)):
        lab, line = _start_papo_nb_lab(notebooks, _lab_environment(tmp_path), "--runs-dir", str(runs), *options)
        try:
            base, _, token = LAB_URL_LINE.match(line).groups()
            status, listing = _contents(base, token, "")
            assert status == 200 and "runs" in {item["name"] for item in listing["content"]}
            status, folder = _contents(base, token, f"runs/{executed.parent.name}")
            assert status == 200 and [item["name"] for item in folder["content"]] == [executed.name]
            model = {"type": "notebook", "format": "json", "content": json.loads(tracked)}
            status, answer = _contents(base, token, "03_training_run.ipynb", model)
            assert status == tracked_status, answer
            if tracked_status == 403:
                assert "tracked workbook notebook" in answer["message"] and "Save Notebook As" in answer["message"]
                assert (notebooks / "03_training_run.ipynb").read_bytes() == tracked
            status, _ = _contents(base, token, f"runs/{executed.parent.name}/{executed.name}", model)
            assert status == 200
        finally:
            _stop_with_ctrl_c(lab)
    assert (notebooks / "runs").resolve() == runs.resolve()


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0
