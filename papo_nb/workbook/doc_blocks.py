"""Generated blocks inside hand-written pages: the text between two marker comments, replaced by what a command
regenerates (the study summary and verdicts, the adapter page's tables, the forecast and in-loop tables)."""

from __future__ import annotations

import argparse
from pathlib import Path


def replace_block(text: str, block: str, markers: tuple[str, str]) -> str:
    """``text`` with what stands between ``markers`` replaced by ``block`` (its own last newline included)."""
    start, end = markers
    if start not in text or end not in text:
        raise ValueError(f"the page has no {start} ... {end} block to write into")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{block}{end}{rest.split(end, 1)[1]}"


def block_command(argv, description: str, page: str, load, document, show) -> int:
    """The command behind a page's generated blocks: ``--root`` (the repository, default here) and ``--write``
    (``document(text, load(root))`` into ``root / page``), else ``show(load(root))`` printed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: here)")
    parser.add_argument("--write", action="store_true", help=f"write the blocks into {page}")
    args = parser.parse_args(argv)
    loaded = load(args.root)
    if args.write:
        path = args.root / page
        path.write_text(document(path.read_text(), loaded))
    else:
        print(show(loaded))
    return 0
