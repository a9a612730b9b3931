"""Skip an optimizer step whose gradient norm is not finite, as the official actor does, and stop after several.

The official update drops the step's gradients when ``grad_norm`` is not finite
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L185-L188); Hugging Face's
Trainer steps the optimizer anyway, and one NaN gradient turns every AdamW moment, and then every weight, into NaN.
The trainer's ``_get_grad_norm`` override hands the norm here before ``optimizer.step()``: a non-finite one sets every
gradient to None (AdamW then leaves those parameters and their state untouched), is logged and counted; ``limit`` in
a row raise with the norms and steps seen. The norm is the global one (all ranks, all shards), so every rank skips
alike.

Two cases are not that one:

- **fp16 loss scaling.** Under ``fp16=True`` the GradScaler starts at a large scale and backs off by skipping the
  steps whose scaled gradients overflow: their norm is inf by design. While the scale is above 1 such a step is an
  *overflow* (``papo/fp16_overflow_steps``): the scaler skips it itself, the gradients are left to it and it does not
  count toward ``limit``; at a scale of 1 or below no scaling explains it, and it is a non-finite gradient.
- **DeepSpeed.** accelerate's ``DeepSpeedEngineWrapper.backward`` runs ``engine.step()`` at the accumulation
  boundary, before the Trainer computes the norm, and ZeRO keeps its own gradient buffers: the step cannot be
  skipped here. A step DeepSpeed did not apply (``engine.was_step_applied()`` false: its own fp16 loss scaler
  skipped an overflow) is counted as an overflow; a non-finite norm of an applied step stops the run at once, with a
  message that says so, rather than train on weights it has already updated.
"""

from __future__ import annotations

import math

from transformers.utils import logging

logger = logging.get_logger(__name__)


class NonFiniteGradientError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite gradient norm, or one was applied by DeepSpeed."""


class NonFiniteStepGuard:
    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0  # skipped steps in the run
        self.overflows = 0  # fp16 loss-scale overflows in the run (skipped by the scaler or DeepSpeed)
        self.in_a_row: list[tuple[int, float]] = []  # (optimizer step, norm) of the current run of skips

    def metrics(self) -> dict[str, list[float]]:
        return {"papo/nonfinite_grad_steps": [float(self.total)], "papo/fp16_overflow_steps": [float(self.overflows)]}

    def check(self, state, model, norm, *, scaler=None, engine=None) -> str:
        """``"finite"``, ``"overflow"`` (an fp16 loss-scale overflow, skipped by the scaler) or ``"skipped"`` (the
        gradients dropped); raises after ``limit`` skips in a row, or at once for a step DeepSpeed applied.
        ``state``: the Trainer's ``TrainerState``; ``scaler``: the accelerator's GradScaler or None; ``engine``:
        the DeepSpeed engine or None."""
        value = float(norm) if norm is not None else 0.0
        if math.isfinite(value):
            self.in_a_row = []
            return "finite"
        step = state.global_step
        if engine is not None:
            if not engine.was_step_applied():
                return self._overflow(step, value, "DeepSpeed's fp16 loss scaler did not apply the step")
            raise NonFiniteGradientError(
                f"gradient norm {value} at optimizer step {step} is not finite and DeepSpeed has already applied "
                "the step (accelerate's DeepSpeedEngineWrapper.backward runs engine.step() before the Trainer sees "
                "the norm, and ZeRO keeps its own gradient buffers), so it cannot be skipped: the run stops here; "
                "under DeepSpeed, fp16 overflow steps are skipped by DeepSpeed's loss scaler"
            )
        if scaler is not None and scaler.is_enabled() and scaler.get_scale() > 1.0:
            return self._overflow(
                step, value, f"the fp16 GradScaler skips it and lowers its scale {scaler.get_scale()}"
            )
        return self._skip(state, model, step, value)

    def _overflow(self, step: int, value: float, what: str) -> str:
        self.overflows += 1
        logger.info("PAPO-G: fp16 overflow at optimizer step %d (norm %s): %s", step, value, what)
        return "overflow"

    def _skip(self, state, model, step: int, value: float) -> str:
        for parameter in model.parameters():
            parameter.grad = None
        self.total += 1
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
        return "skipped"
