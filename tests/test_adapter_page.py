"""docs/adapter.md, the adapter's page in TRL's trainer-page format: its quick start runs (one ``trainer.train()``
step on a tiny offline Qwen2-VL), and its config, metric and override tables are the code's
(``python -m papo_nb.workbook.adapter_page``), so the page fails here when the code moves without it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from papo_nb.workbook import adapter_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adapter.md"


def quick_start(language: str = "python") -> str:
    """The quick start's one ``language`` block, as the page gives it."""
    section = PAGE.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)
    return block


def test_the_page_tables_are_the_code(tmp_path):
    text = PAGE.read_text()
    assert adapter_page.render(text) == text, "regenerate with: python -m papo_nb.workbook.adapter_page"
    assert adapter_page.main(["--check", "--root", str(ROOT)]) == 0
    stale = tmp_path / adapter_page.PAGE  # the page under another root, one table row gone: --check says so
    stale.parent.mkdir(parents=True)
    stale.write_text(text.replace("| `perception_kl` |", "| `gone` |", 1))
    assert adapter_page.main(["--check", "--root", str(tmp_path)]) == 1
    for field in adapter_page.papo_config.papo_fields():
        assert f"| `{field.name}` |" in text, field.name
    assert "| `perception_kl` |" in text and "| `papo/gamma_kl` |" in text


def test_a_metric_without_a_meaning_or_a_meaning_without_a_metric_is_refused(monkeypatch):
    meanings = dict(adapter_page.MEANINGS)
    del meanings["papo/discount"]
    monkeypatch.setattr(adapter_page, "MEANINGS", meanings)
    with pytest.raises(ValueError, match=r"without a meaning.*papo/discount"):
        adapter_page.metrics_markdown()
    monkeypatch.setattr(adapter_page, "MEANINGS", {**adapter_page.MEANINGS, "papo/discount": "", "papo/gone": ""})
    with pytest.raises(ValueError, match=r"no longer logs.*papo/gone"):
        adapter_page.metrics_markdown()


def test_an_override_missing_from_the_trainer_docstring_is_refused(monkeypatch):
    monkeypatch.setattr(adapter_page, "overridden_methods", lambda: ["_compute_loss", "training_step"])
    with pytest.raises(ValueError, match=r"overrides \['training_step'\]"):
        adapter_page.overrides_markdown()


@pytest.mark.model
def test_the_quick_start_runs_offline_as_written(tmp_path, monkeypatch):
    """The page's command makes the folders, then its code trains one step on them, both unchanged."""
    command, code = quick_start("bash"), quick_start()
    assert len(command.strip().splitlines()) == 1 and code.rstrip().endswith("trainer.train()")
    assert len([line for line in code.splitlines() if line.strip()]) <= 14  # about ten lines
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this environment's
    env = {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1"}
    made = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1
    logged = {key for entry in trainer.state.log_history for key in entry}
    ours = {k for k in logged if k.startswith(("papo/", "perception", "probe/")) or k.endswith("_entropy")}
    assert {"perception_kl", "papo/gamma_kl", "masked_entropy"} <= ours
    table = set(adapter_page.MEANINGS)
    assert not {k for k in ours if k not in table and not k.startswith(adapter_page.PROBE_PREFIX)}, ours - table
