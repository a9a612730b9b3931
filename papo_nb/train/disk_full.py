"""A full disk (ENOSPC), an exceeded quota (EDQUOT) or a file-size limit (EFBIG) during a run: an error, not a
corruption.

``disk_full_cause`` recognises the failure however the writer reported it (an OSError; torch.save's "file write
failed" or short write; safetensors' "No space left on device"). ``set_aside_partial`` renames the checkpoints a
failed write left half-written (``incomplete-checkpoint-N-<time>``, a rename needs no space) and names the resume
point: the newest complete checkpoint, which ``--resume`` picks (``integrity.find_resume_checkpoint`` never picks a
partial one).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

DISK_FULL_EXIT = 74  # EX_IOERR (sysexits.h)
DISK_FULL_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT", errno.EFBIG: "EFBIG"}
DISK_FULL_TEXTS = {
    "No space left on device": "ENOSPC",
    "Disk quota exceeded": "EDQUOT",
    "File too large": "EFBIG",
    "file write failed": "a failed write (torch.save)",
    "unexpected pos": "a short write (torch.save)",  # PyTorchStreamWriter: fewer bytes landed than it wrote
    "database or disk is full": "ENOSPC (SQLite)",
}


class DiskFull(RuntimeError):
    """A write failed for lack of space; the message names the cause, what was set aside and the resume point."""


def disk_full_cause(exc: BaseException) -> str | None:
    """The name of the disk-full condition behind ``exc`` (its causes and contexts included), else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return DISK_FULL_ERRNOS[exc.errno]
        for text, cause in DISK_FULL_TEXTS.items():
            if text in str(exc):
                return cause
        exc = exc.__cause__ or exc.__context__
    return None


def set_aside_partial(output_dir: Path, cause: str) -> DiskFull:
    """Rename the checkpoints newer than the newest complete one; returns the error to raise."""
    from papo_nb.train.integrity import find_resume_checkpoint

    complete, partial = find_resume_checkpoint(output_dir, warn=False)
    moved = []
    for folder, _ in partial:
        target = folder.with_name(f"incomplete-{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        folder.rename(target)
        moved.append(f"{folder.name} -> {target.name}")
    written = f"the half-written {', '.join(moved)} set aside" if moved else "no checkpoint was half-written"
    resume_point = f"the resume point is {complete}" if complete else "there is no complete checkpoint to resume from"
    return DiskFull(
        f"the disk holding {output_dir} is full ({cause}); {written}; {resume_point}. Free space, then run the same "
        "command with --resume"
    )
