"""Generated blocks inside hand-written pages: the text between two marker comments, replaced by what a command
regenerates (the study summary and verdicts, the adapter page's tables, the forecast and in-loop tables)."""

from __future__ import annotations


def replace_block(text: str, block: str, markers: tuple[str, str]) -> str:
    """``text`` with what stands between ``markers`` replaced by ``block`` (its own last newline included)."""
    start, end = markers
    if start not in text or end not in text:
        raise ValueError(f"the page has no {start} ... {end} block to write into")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{block}{end}{rest.split(end, 1)[1]}"
