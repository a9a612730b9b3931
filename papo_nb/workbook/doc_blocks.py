"""Generated blocks inside hand-written pages: the text between two marker comments, replaced by what a command
regenerates (the study summary and verdicts, the adapter page's tables, the forecast and in-loop tables)."""

from __future__ import annotations

import argparse
import os
import sys
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
    (``document(text, load(root))`` into ``root / page``), else ``show(load(root))`` printed. A root without the
    page or its data is refused naming both; a reader that closes the pipe early (``| head``) ends it quietly."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root (default: here)")
    parser.add_argument("--write", action="store_true", help=f"write the blocks into {page}")
    args = parser.parse_args(argv)
    if not (args.root / page).is_file():  # not the repository: refused before anything is read
        parser.error(f"--root {str(args.root)!r} has no {page}: allowed: the repository's root")
    try:
        loaded = load(args.root)
        output = document((args.root / page).read_text(), loaded) if args.write else show(loaded)
    except FileNotFoundError as missing:
        parser.error(f"--root {str(args.root)!r} has no {missing.filename}: allowed: the repository's root")
    if args.write:
        (args.root / page).write_text(output)
        return 0
    try:
        print(output, flush=True)
    except BrokenPipeError:  # the reader has what it wanted; the interpreter's exit flush must not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
