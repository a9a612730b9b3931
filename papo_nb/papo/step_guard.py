"""Skip an optimizer step whose gradient norm is not finite, as the official actor does, and stop after several.

The official update drops the step's gradients when ``grad_norm`` is not finite
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L185-L188); Hugging Face's
Trainer steps the optimizer anyway, and one NaN gradient turns every AdamW moment, and then every weight, into NaN.
The trainer's ``_get_grad_norm`` override hands the norm here before ``optimizer.step()``: a non-finite one sets every
gradient to None (AdamW then leaves those parameters and their state untouched), is logged and counted; ``limit`` in
a row raise with the norms and steps seen. The norm is the global one (all ranks, all shards), so every rank skips
alike.
"""

from __future__ import annotations

import math

from transformers.utils import logging

logger = logging.get_logger(__name__)


class NonFiniteGradientError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient norm."""


class NonFiniteStepGuard:
    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0  # skipped steps in the run
        self.in_a_row: list[tuple[int, float]] = []  # (optimizer step, norm) of the current run of skips

    def check(self, state, model, norm) -> bool:
        """True when the step is skipped (its gradients dropped); raises after ``limit`` in a row. ``state``: the
        Trainer's ``TrainerState`` (the step and the last logs, for the message)."""
        value = float(norm) if norm is not None else 0.0
        if math.isfinite(value):
            self.in_a_row = []
            return False
        for parameter in model.parameters():
            parameter.grad = None
        self.total += 1
        step = state.global_step
        self.in_a_row.append((step, value))
        logger.warning(
            "PAPO-G: gradient norm %s at optimizer step %d is not finite; the step is skipped (%d in a row, %d in "
            "the run)",
            value,
            step,
            len(self.in_a_row),
            self.total,
        )
        if len(self.in_a_row) >= self.limit:
            last_logs = state.log_history[-1] if state.log_history else {}
            raise NonFiniteGradientError(
                f"{len(self.in_a_row)} optimizer steps in a row had a non-finite gradient norm "
                f"(max_consecutive_nonfinite_grad_steps={self.limit}): (step, norm) = {self.in_a_row}; "
                f"{self.total} skipped in the run; last logged metrics: {last_logs}"
            )
        return True
