"""A training run's MLflow logging routed through its spool (``papo_nb.train.spool``), so the server never stalls
training.

``open_spool`` starts the spool of the run's folder and ``route_through_spool`` points the trainer's loggers at it:

- transformers' MLflowCallback (TrainingArguments as params at setup, every step's metrics) is replaced by
  ``SpooledMLflowCallback``, the same callback with ``SpooledFluent`` as its ``mlflow`` module;
- TRL's profiling timings (``trl/extras/profiling.py``, ``mlflow.log_metrics`` per profiled call) log through
  ``SpooledFluent`` while the run trains;
- the review callback's completions table and metrics go through ``SpooledClient``; its calls that need an answer
  (a checkpoint's LoggedModel, the system-metrics flush) are skipped while the store is unreachable, each skip named
  at the end (``ReviewGuard``);
- the start record and the probe's evidence are written through ``SpooledFluent`` by ``records``.

``close_spool`` journals the run's end status, delivers for at most ``PAPO_NB_TRACKING_DRAIN_S`` seconds (default
30) and ends the local MLflow run even when the store is down.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
from transformers import TrainerCallback
from transformers.integrations import MLflowCallback

from papo_nb.train.spool import TrackingSpool, fast_failing_http, is_unreachable

DRAIN_ENV = "PAPO_NB_TRACKING_DRAIN_S"
DEFAULT_DRAIN_SECONDS = 30.0


class SpooledFluent:
    """``mlflow``'s fluent module for one run whose logging calls (metrics, params, tags, dicts) are journalled to a
    spool and return at once; every other attribute is mlflow's own."""

    def __init__(self, spool: TrackingSpool):
        self.spool = spool

    def __getattr__(self, name: str) -> Any:
        return getattr(mlflow, name)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, **_: Any) -> None:
        self.spool.log_metrics(metrics, step)

    def log_params(self, params: dict[str, Any], **_: Any) -> None:
        self.spool.log_params(params)

    def set_tags(self, tags: dict[str, Any], **_: Any) -> None:
        self.spool.set_tags(tags)

    def set_tag(self, key: str, value: Any, **_: Any) -> None:
        self.spool.set_tags({key: value})

    def log_dict(self, dictionary: Any, artifact_file: str, **_: Any) -> None:
        self.spool.journal("log_dict", dictionary=dictionary, artifact_file=artifact_file)


class SpooledClient:
    """An MlflowClient of the spool's run whose ``log_table`` and ``log_metric`` are journalled; other calls are the
    client's own (synchronous)."""

    def __init__(self, spool: TrackingSpool, client):
        self.spool, self.client = spool, client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def log_table(self, run_id: str, data: Any, artifact_file: str) -> None:
        self.spool.journal("log_table", data=data, artifact_file=artifact_file)

    def log_metric(self, run_id: str, key: str, value: float, timestamp: int | None = None, step: int | None = None):
        self.spool.log_metrics({key: value}, step)


class SpooledMLflowCallback(MLflowCallback):
    """transformers' MLflowCallback, its mlflow calls journalled to the run's spool (nothing else changes)."""

    def __init__(self, spool: TrackingSpool):
        super().__init__()
        self._ml_flow = SpooledFluent(spool)


class ReviewGuard(TrainerCallback):
    """Added after the review callback: its table and metrics go to the spool, and its calls that wait for the
    store are skipped while it is unreachable (an outage found by such a call counts as one). ``skipped`` names
    each."""

    def __init__(self, spool: TrackingSpool, review):
        self.spool, self.review, self.skipped = spool, review, []
        for hook in ("on_save", "on_train_end"):
            setattr(review, hook, self._guarded(hook, getattr(review, hook)))

    def on_train_begin(self, args, state, control, **kwargs):
        if self.review.client is not None:
            self.review.client = SpooledClient(self.spool, self.review.client)

    def _guarded(self, hook: str, call):
        def guarded(args, state, control, **kwargs):
            if hook == "on_train_end" and self.spool.down_since is not None:
                self._stop_monitor(state.global_step)
            if hook == "on_save" and self.spool.down_since is not None:
                self.skipped.append(f"{hook} at step {state.global_step} (the checkpoint's LoggedModel)")
                return None
            try:
                return call(args, state, control, **kwargs)
            except Exception as exc:
                if not is_unreachable(exc):
                    raise
                self.spool._mark_down(exc)
                self.skipped.append(f"{hook} at step {state.global_step} ({type(exc).__name__})")
                return None

        return guarded

    def _stop_monitor(self, step: int) -> None:
        """The system-metrics monitor's last flush waits for the store: stop it without that flush."""
        monitor, self.review.monitor = self.review.monitor, None
        if monitor is not None:
            monitor._shutdown_event.set()
            self.skipped.append(f"the last system-metrics sample at step {step}")


def drain_seconds() -> float:
    raw = os.environ.get(DRAIN_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_DRAIN_SECONDS
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{DRAIN_ENV}: {raw!r} is not allowed; give seconds as a number >= 0")
    return value


def open_spool(output_dir: Path, run_id: str) -> TrackingSpool:
    """The run's spool, its worker started; MLflow's HTTP requests in this process fail fast from now on."""
    drain_seconds()  # a bad setting stops the run before it trains
    fast_failing_http()
    return TrackingSpool(output_dir, run_id, mlflow.get_tracking_uri())


def route_through_spool(trainer, spool: TrackingSpool) -> ReviewGuard | None:
    """Point the trainer's MLflow loggers at ``spool``; returns the review callback's guard, if it has one."""
    from trl.extras import profiling

    from papo_nb.workbook.training.review import ReviewCallback

    if trainer.pop_callback(MLflowCallback) is not None:
        trainer.add_callback(SpooledMLflowCallback(spool))
    # TRL's timing metrics (``profiling_context``, several per step) call ``mlflow.log_metrics`` through this module
    # name, synchronously; ``close_spool`` puts mlflow back.
    if getattr(profiling, "mlflow", None) is mlflow:
        profiling.mlflow = SpooledFluent(spool)
    review = next((c for c in trainer.callback_handler.callbacks if isinstance(c, ReviewCallback)), None)
    if review is None:
        return None
    guard = ReviewGuard(spool, review)
    trainer.add_callback(guard)
    return guard


def close_spool(spool: TrackingSpool, status: str, guard: ReviewGuard | None, *, end_run: bool) -> int:
    """Journal the run's end (when this run ``end_run``s it), deliver for a bounded time, end the local run; returns
    the calls left in the spool."""
    from trl.extras import profiling

    if isinstance(getattr(profiling, "mlflow", None), SpooledFluent):
        profiling.mlflow = mlflow
    if end_run:
        try:
            spool.journal("set_terminated", status=status, end_time=int(time.time() * 1000))
        except OSError as exc:  # a full disk: the end status is the one call that cannot be kept
            print(f"papo_nb: the run's end status was not spooled ({exc})", file=sys.stderr, flush=True)
    left = spool.close(drain_seconds())
    if guard is not None and guard.skipped:
        print(
            "papo_nb: skipped while the MLflow store was unreachable: " + "; ".join(guard.skipped),
            file=sys.stderr,
            flush=True,
        )
    if end_run:
        try:
            mlflow.end_run(status=status)  # pops the local run first; its own server call is repeated or fails fast
        except Exception as exc:
            if not is_unreachable(exc):
                raise
    return left
