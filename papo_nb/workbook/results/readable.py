"""An executed notebook as MLflow's artifact view can show it: MLflow renders HTML, but an ``.ipynb`` shows as raw
JSON, so every executed notebook gets an HTML copy (nbconvert's HTML exporter, outputs and figures inline) beside it.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbconvert import HTMLExporter


def write_html_copy(notebook: str | Path) -> Path:
    """Write ``<notebook>.html`` next to the executed ``notebook`` (failed cells and their tracebacks included);
    returns its path."""
    notebook = Path(notebook)
    body, _ = HTMLExporter().from_notebook_node(nbformat.read(notebook, as_version=4))
    target = notebook.with_suffix(".html")
    target.write_text(body, encoding="utf-8")
    return target
