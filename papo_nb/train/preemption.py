"""Preemption: SIGTERM (a cluster's preemption) or SIGUSR1 (SLURM's ``--signal``) ends a run at a complete checkpoint.

The handler only records the signal. At the end of the optimizer step under way every rank agrees (one summed flag,
so ranks that got the signal at different moments stop at the same step), the Trainer saves a checkpoint at that
step (adapter, optimizer, scheduler, RNG states with the masking generator's, trainer state) and stops. The runner
then checks the checkpoint complete, marks it (``preempted.json``: signal, step, seconds from the signal to the
saved checkpoint) and exits with ``PREEMPTED_EXIT``; ``--resume`` continues from it. A signal during the last step
lets the run finish normally.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from papo_nb.train.run_folder import PROGRESS_PREFIX, write_json

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run again with --resume
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTION_MARK = "preempted.json"


class Preempted(RuntimeError):
    """The run stopped on a preemption signal at a complete, marked checkpoint."""

    def __init__(self, checkpoint: Path, mark: dict):
        super().__init__(
            f"stopped by {mark['signal']} after step {mark['step']}: checkpoint {checkpoint} is complete and marked "
            f"({mark['seconds_signal_to_checkpoint']:.1f} s from the signal); continue with --resume"
        )
        self.checkpoint, self.mark = checkpoint, mark


class PreemptionCallback(TrainerCallback):
    """Saves a checkpoint and stops training at the end of the step during which a preemption signal arrived."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.signal: str | None = None
        self.received_at: float | None = None
        self.stopped_at_step: int | None = None
        self.previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal, self.received_at = signal.Signals(signum).name, time.time()
            # Never raise here: an exception from a signal handler lands wherever the main thread is, inside a
            # lock tqdm holds, say, and the run hangs at the next close; a gone terminal must not stop the run.
            with contextlib.suppress(OSError, ValueError):
                print(
                    f"{PROGRESS_PREFIX} {self.signal} received: finishing the current step, then a checkpoint",
                    file=sys.stderr,
                    flush=True,
                )

    def on_train_begin(self, args, state, control, **kwargs):
        for sig in PREEMPTION_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)

    def on_train_end(self, args, state, control, **kwargs):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()

    def on_step_end(self, args, state, control, **kwargs):
        if self._any_rank_signalled() and state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True
            self.stopped_at_step = state.global_step
        return control

    def _any_rank_signalled(self) -> bool:
        if self.accelerator.num_processes == 1:
            return self.signal is not None
        import torch

        flag = torch.tensor([1.0 if self.signal is not None else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    def mark(self, output_dir: Path, is_main: bool) -> Preempted | None:
        """After ``train`` returned: the marked checkpoint of a preempted run (None when not preempted). Raises
        RuntimeError when the checkpoint is not complete."""
        from papo_nb.train.integrity import checkpoint_problems
        from papo_nb.workbook.training.checkpoints import CHECKPOINT_PREFIX

        if self.stopped_at_step is None:
            return None
        checkpoint = Path(output_dir) / f"{CHECKPOINT_PREFIX}{self.stopped_at_step}"
        problems = checkpoint_problems(checkpoint)
        if problems:
            raise RuntimeError(f"the preemption checkpoint {checkpoint} is incomplete: {'; '.join(problems)}")
        saved_at = time.time()
        mark = {
            "signal": self.signal or "(another rank's)",
            "step": self.stopped_at_step,
            "received_at": self.received_at,
            "saved_at": saved_at,
            "seconds_signal_to_checkpoint": saved_at - self.received_at if self.received_at else 0.0,
        }
        if is_main:
            write_json(checkpoint / PREEMPTION_MARK, mark)
        return Preempted(checkpoint, mark)
