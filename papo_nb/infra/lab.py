"""What ``papo-nb lab`` adds to JupyterLab: the workbook's results in its file browser, and the tracked notebooks kept
safe from a reflexive save.

- ``link_results``: a ``runs`` link in the served folder to the workbook's run folder (``papo-nb run`` writes each
  run's executed notebooks, with their outputs, to ``runs/<timestamp>-<id>/``), so the last runs' executed copies
  open from Lab's file browser beside the notebooks. The link is a file of the served folder only (git ignores
  ``notebooks/runs``); the server follows it, as it stays inside its root by path.
- ``refuse_tracked_save``: JupyterLab marks a notebook modified as soon as its kernel starts (it fills in the
  kernelspec and ``language_info``), so Ctrl-S rewrote a tracked notebook with nothing changed by hand. The hook
  refuses to overwrite a workbook notebook (``NN_name.ipynb`` at the top of the served folder) with a message saying
  what to do instead (Save As, e.g. into ``runs/``); ``papo-nb lab --edit`` leaves it out, for editing the workbook.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tornado.web import HTTPError

RESULTS_LINK = "runs"
TRACKED_NOTEBOOK = re.compile(r"^\d\d_[^/]+\.ipynb$")  # a workbook notebook, at the top of the served folder
# The ContentsManager option that installs the hook (an import string, as traitlets takes it on the command line).
PROTECT_TRACKED_ARGS = ("--ContentsManager.pre_save_hook=papo_nb.infra.lab.refuse_tracked_save",)


def link_results(notebook_dir: str | Path, runs_dir: str | Path) -> Path:
    """``<notebook_dir>/runs`` pointing at ``runs_dir`` (created when missing); an existing ``runs`` entry that is
    not such a link is left as it is. Returns the entry's path."""
    link = Path(notebook_dir) / RESULTS_LINK
    runs_dir = Path(runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() != runs_dir:
        link.unlink()  # a link to another run folder (the project moved): point it here
    if not link.exists() and not link.is_symlink():
        link.symlink_to(os.path.relpath(runs_dir, link.parent), target_is_directory=True)
    return link


def refuse_tracked_save(model: dict, path: str, contents_manager=None, **kwargs) -> None:
    """Jupyter Server pre-save hook: a workbook notebook is not overwritten (HTTP 403 with the reason, which Lab shows
    in its "File Save Error" dialog); every other file saves as usual."""
    if model.get("type") == "notebook" and TRACKED_NOTEBOOK.match(path.lstrip("/")):
        raise HTTPError(
            403,
            f"{path} is a tracked workbook notebook: papo-nb lab does not overwrite it (opening it already marks it "
            "modified). Use File > Save Notebook As... (for example into runs/), or start papo-nb lab --edit to "
            "edit the workbook itself.",
        )
