"""Output never kills training: ``papo-nb train``'s stdout and stderr, copied into the run's own log file.

Under ``papo-nb train ... | tee log`` a cluster's SIGTERM reaches the whole process group: ``tee`` dies, and the
next progress line would raise BrokenPipeError in a Trainer callback (the run lost, no checkpoint), or in the
preemption signal handler, from where it lands wherever the main thread is, inside tqdm's write lock too (the run
then hangs at a progress bar's close, waiting on that lock: this module's test, run on the code before it, was
killed at its 300 s deadline). ``surviving_output`` swaps both streams for ``SurvivingStream``s: every line
goes to ``train.log`` in the run folder first, then to the terminal or pipe; a write that fails marks the stream
lost, points its file descriptor at /dev/null (so writers holding the old stream, and the interpreter's flush at
exit, succeed too) and training carries on, the log file complete.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback
from pathlib import Path

LOG_FILE = "train.log"
# Set by ``papo-nb train`` for the job it launches (num_processes > 1): it streams every rank's output into its own
# log, so the job's rank 0 writes none of its own (each line would be there twice).
LAUNCHER_KEEPS_LOG_ENV = "PAPO_NB_LAUNCHER_KEEPS_LOG"


def run_log_path(output_dir, rank: int) -> Path | None:
    """The run's log file for this process: rank 0's, unless ``papo-nb train`` launched it and keeps the log."""
    if rank != 0 or os.environ.get(LAUNCHER_KEEPS_LOG_ENV):
        return None
    return Path(output_dir) / LOG_FILE


class SurvivingStream(io.TextIOBase):
    """A text stream that writes to ``log`` (when given) and to ``stream``, and never raises for a closed or broken
    ``stream``: it is dropped at its first failure."""

    def __init__(self, stream, log=None):
        # None: Python started with that descriptor closed (``papo-nb train >&-``): the log alone
        self.stream, self.log, self.lost = stream, log, stream is None

    def write(self, text: str) -> int:
        if self.log is not None:
            try:
                self.log.write(text)
                self.log.flush()  # the log is the run's record when the terminal is gone: each line as it comes
            except (OSError, ValueError):  # a full disk is the checkpoint's to report (disk_full), not the log's
                self.log = None
        if not self.lost:
            try:
                self.stream.write(text)
                if "\n" in text:
                    self.stream.flush()
            except (OSError, ValueError):  # EPIPE, a closed file
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return not self.lost and bool(getattr(self.stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        if self.stream is None:
            raise io.UnsupportedOperation("the stream was closed when the run started")
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"


class RunLog:
    """The run's log file, opened only once the run is accepted (``start_run_log``): until then its lines wait in
    memory, so a refused run (a resume with other parameters, a missing column) writes nothing in its folder."""

    def __init__(self, path: Path):
        self.path, self.file, self.pending = path, None, []

    def write(self, text: str) -> None:
        if self.file is None:
            self.pending.append(text)
        else:
            self.file.write(text)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def start(self) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by surviving_output)
            self.file.write("".join(self.pending))
            self.file.flush()
            self.pending = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def start_run_log() -> None:
    """The run is accepted: its log file opens with the lines written so far (a no-op outside ``surviving_output``
    or where this process keeps no log)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, SurvivingStream) and isinstance(stream.log, RunLog):
            stream.log.start()


@contextlib.contextmanager
def surviving_output(log_path: Path | None):
    """``sys.stdout`` and ``sys.stderr`` as ``SurvivingStream``s for the duration, both copied into ``log_path``
    once ``start_run_log`` is called (appended: each attempt of a resumed run adds to it; None: no log, as on a
    launched job's other ranks)."""
    log = RunLog(log_path) if log_path is not None else None
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SurvivingStream(saved[0], log), SurvivingStream(saved[1], log)
    try:
        yield
    except BaseException:
        if log is not None and log.file is not None:  # the traceback Python prints after the streams are restored
            with contextlib.suppress(OSError, ValueError):
                log.write(traceback.format_exc())
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
        if log is not None:
            log.close()
