"""The first-batch self-check of ``prefix_sharing="auto"``: the packed log-probs of the first packed call against the
plain forward's, on the call's completion tokens, within a bound per dtype (``LOGP_BOUNDS``).

The bounds sit between the roundoff the exactness tests measure and the error of a wrong layout:

- float64: the packed path is exact (0.0 measured, ``tests/test_prefix_sharing.py``); bound 1e-9.
- float32: at most 9.5e-7 measured (every grouped form, with and without checkpointing); the negative controls (a
  completion that sees the ones before it, positions one later) move log-probs by 1.3e-3 to 3.6e-2. Bound 1e-4:
  100x the roundoff, for wider models, still 13x below the smallest wrong layout.
- bfloat16 and float16: the packed path against the plain one measured 0.031 in bf16 and 0.0039 in fp16 (one
  step of each at log-probs of magnitude 4 to 8: 2^-5, 2^-8), as large as the plain forward's own error against fp32
  (0.030, 0.0038); tiny Qwen2-VL and Qwen2.5-VL, the batch of ``tests/test_prefix_sharing.py``. Bounds four steps:
  0.125 and 0.0156. A wrong layout that moves log-probs by less is inside the dtype's own resolution and is not told
  apart from roundoff (the fp32 negative controls, 1.3e-3 to 3.6e-2, all are in bf16): a run in fp32 checks tighter.

The bound is that of the precision the forward computed in, not of the log-probs it returns: under bf16 mixed
precision TRL's log-probs are float32 (accelerate converts the outputs, TRL's log-softmax runs in float32) while every
matmul ran in bf16, and the float32 bound would turn sharing off on roundoff alone (the rehearsal at Qwen2.5-VL-3B
widths measured 0.008 to 0.016 there). ``compute_dtypes`` names the autocast dtype the model's forward actually ran
under (``prefix_sharing.autocast_seen``: accelerate's wrapper of a prepared model, or TRL 1.15+'s own autocast around
its model call, which the packed forward opens too) and the weights' dtype; the loosest bound of those and the
log-probs' dtype applies. A configured ``bf16=True`` whose forward ran in float32 (a call outside ``train()`` on TRL
1.9.1) is held to the float32 bound: before, the configured mixed precision alone chose bf16's bound, which let a
packed forward in float32 beside a parent in bf16 (1.7e-3 apart on TRL 1.16) pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGP_BOUNDS = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 4 * 2.0**-5, torch.float16: 4 * 2.0**-8}


@dataclass(frozen=True)
class SelfCheck:
    """The outcome of one comparison: the largest absolute log-prob difference on completion tokens, where it is
    (row of the call, completion token), and the bound of the log-probs' dtype."""

    max_difference: float
    row: int
    token: int
    bound: float

    @property
    def passed(self) -> bool:
        return self.max_difference <= self.bound

    def describe(self) -> str:
        return (
            f"max |packed - plain| log-prob {self.max_difference:.3g} at row {self.row}, completion token "
            f"{self.token} (bound {self.bound:g})"
        )


def compare(
    packed_logps: torch.Tensor, plain_logps: torch.Tensor, completion_mask: torch.Tensor, compute_dtypes=()
) -> SelfCheck:
    """``packed_logps`` against ``plain_logps`` (each ``(B, logits_to_keep)``) where ``completion_mask`` is set,
    within the loosest bound of the log-probs' dtype and ``compute_dtypes``; a non-finite difference counts as
    infinite."""
    difference = (packed_logps.detach().double() - plain_logps.detach().double()).abs()
    difference = torch.where(difference.isfinite(), difference, torch.inf)
    difference = torch.where(completion_mask.bool(), difference, 0.0)
    flat = int(difference.argmax())
    row, token = divmod(flat, difference.shape[1])
    bound = max(LOGP_BOUNDS.get(dtype, LOGP_BOUNDS[torch.float32]) for dtype in (plain_logps.dtype, *compute_dtypes))
    return SelfCheck(max_difference=float(difference.max()), row=row, token=token, bound=bound)
