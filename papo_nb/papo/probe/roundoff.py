"""Where the probe's roundoff comes from: a second backward over the same graph, or the batch split another way.

Two backward passes over one graph on the CPU run the same deterministic kernels, so ``g_zero - g_parent`` is exactly
0 there; on a GPU the atomic adds of the two passes land in different orders and leave real roundoff (about 2.4%
relative in bf16 on a trained policy, the figure REL_TOL is set from: contract.py). The probe needs a *measured*
roundoff sample to set the noise floor of its projection test, from a pass independent of the one it tests:

- ``"repeat"`` (the in-training default, more backward passes on the graph the probe already holds): the parent
  gradient twice more, and six more times when two leave the batch unpowered (``measure.ROUNDOFF_STAGES``).
  Exactly 0 on a deterministic backend, GPU atomic noise on a GPU: the noise the two probe passes themselves carry.
- ``"reordered"`` (calibration, notebook 02): the zero-gamma gradient accumulated over another split of the batch's
  sequences (two chunks, reversed and alternating), each chunk a forward and backward of its own, the way gradient
  accumulation would; the ``REORDERED_SAMPLES`` (8) roundoff samples are the parent gradient accumulated over as
  many further, distinct splits. Each chunk's gradient is rounded to the autocast dtype before the sum, so fp32
  and bf16 both show real, different-order roundoff. What it does not emulate: GPU atomics (nondeterministic order
  inside one kernel) and TF32 matmuls (a 10-bit mantissa inside fp32 kernels); those only show on a GPU, with
  ``"repeat"``.

The chunks are exact pieces of the batch loss: each chunk loss is weighted the way TRL 1.9.1 normalises
``loss_type`` (https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L3124-L3153), so the
weighted chunk losses add up to the batch loss; the sum is checked against the batch loss value before any gradient
is trusted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

ROUNDOFF_MODES = ("repeat", "reordered")
# Roundoff samples of the calibration mode: the degrees of freedom of its noise floor (threshold.py).
REORDERED_SAMPLES = 8
# Weighted chunk losses must add up to the batch loss to this relative accuracy: a wrong weight is off by a
# fraction of the chunk share (>= 1e-1 here), roundoff of the forward by <= 1e-2 even in bf16.
CHUNK_SUM_REL_TOL = 2e-2
_SEQUENCE_MEAN = ("grpo", "sapo", "luspo", "dr_grpo")  # per-sequence mean (dr_grpo: / (B * T_max))
_TOKEN_MEAN = ("bnpo",)
_GLOBAL_NORMALISER = ("cispo", "dapo", "vespo")  # / num_items_in_batch, the same scalar in every chunk


def check_mode(roundoff: str) -> None:
    if roundoff not in ROUNDOFF_MODES:
        raise ValueError(f"probe roundoff={roundoff!r} is not a roundoff mode; allowed: {', '.join(ROUNDOFF_MODES)}")


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """``d loss / d params`` as one flat float64 vector (zeros where the loss has no path to a parameter)."""
    if not loss.requires_grad:
        return torch.zeros(sum(p.numel() for p in params), dtype=torch.float64, device=params[0].device)
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double() for g, p in zip(grads, params)])


def batch_size(inputs: dict[str, Any]) -> int:
    return int(inputs["completion_ids"].size(0))


def select_sequences(inputs: dict[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """The batch restricted to ``rows`` (in that order), images included: TRL's own per-sample split of
    ``pixel_values`` (``split_pixel_values_by_grid``, as its training loop shuffles a generation batch)."""
    from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

    n = batch_size(inputs)
    index = torch.tensor(list(rows), dtype=torch.long)
    picked = {}
    for key, value in split_pixel_values_by_grid(inputs).items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.size(0) == n:
            picked[key] = value[index.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            picked[key] = [value[i] for i in rows]
        else:  # scalars (num_items_in_batch) and anything not per sequence
            picked[key] = value
    return unsplit_pixel_values_by_grid(picked)


def chunk_weight(loss_type: str, inputs: dict[str, Any], rows: Sequence[int]) -> float:
    """The factor that makes the chunk's loss its exact share of the batch loss, per TRL's ``loss_type``
    (the reductions of ``normalise_like_parent`` in terms.py)."""
    if loss_type in _SEQUENCE_MEAN:
        return len(rows) / batch_size(inputs)
    if loss_type in _TOKEN_MEAN:
        mask = inputs["completion_mask"].float()
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        chunk = mask[torch.tensor(list(rows), dtype=torch.long, device=mask.device)].sum()
        return (chunk / mask.sum().clamp(min=1.0)).item()
    if loss_type in _GLOBAL_NORMALISER:
        return 1.0
    raise ValueError(f"probe roundoff='reordered' does not know how to split loss_type={loss_type!r}")


def _split(rows: list[int], side: Callable[[int], int]) -> list[list[int]]:
    return [[r for i, r in enumerate(rows) if side(i) == c] for c in (0, 1)]


def splits(n: int, samples: int = 4) -> tuple[list[list[int]], list[list[list[int]]]]:
    """2-chunk splits of ``n`` sequences, every chunk mixing rollouts of different prompts: reversed and alternating
    (the tested pass), then ``samples`` others (the roundoff samples): four fixed patterns, then seeded shuffles,
    every split distinct (a repeated split repeats its roundoff exactly: a sample without information)."""
    if n < 4:
        raise ValueError(f"probe roundoff='reordered' needs a batch of at least 4 sequences to split, got {n}")
    rows = list(range(n))
    tested = _split(rows[::-1], lambda i: i % 2)
    sides = (
        lambda i: (i // 2) % 2,
        lambda i: (i + i // 2) % 2,
        lambda i: (i // 4 + i // 2) % 2,
        lambda i: (i + i // 4) % 2,
    )
    seen = {frozenset(map(frozenset, tested))}
    found = []
    candidates = [_split(rows, side) for side in sides]
    generator = torch.Generator().manual_seed(0)
    for _ in range(64 * samples):
        if len(found) == samples:
            break
        split = candidates.pop(0) if candidates else _split(torch.randperm(n, generator=generator).tolist(), _odd)
        key = frozenset(map(frozenset, split))
        if key not in seen and all(split):
            seen.add(key)
            found.append(split)
    if len(found) < samples:
        raise ValueError(f"probe roundoff='reordered': a batch of {n} sequences has no {samples} distinct splits")
    return tested, found


def _odd(i: int) -> int:
    return i % 2


def accumulated_gradients(
    trainer,
    model,
    inputs: dict[str, Any],
    params: list[torch.Tensor],
    losses: Sequence[Callable],
    chunks: list[list[int]],
    batch_loss_value: float,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """For each ``loss(parent_loss, terms)`` in ``losses``, its gradient accumulated over ``chunks`` (a forward and
    one backward per loss per chunk), each chunk weighted to its exact share; checked against the batch loss. Also
    the sum over chunks of the first loss's squared chunk gradients (the magnitudes the sum rounds at)."""
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        raise ValueError(
            "probe roundoff='reordered' cannot split a batch whose loss masks tokens by a batch-wide entropy quantile "
            f"(top_entropy_quantile={trainer.top_entropy_quantile}); allowed: 1.0"
        )
    size = sum(p.numel() for p in params)
    totals = [torch.zeros(size, dtype=torch.float64, device=params[0].device) for _ in losses]
    squares = torch.zeros_like(totals[0])
    value = 0.0
    for rows in chunks:
        weight = chunk_weight(trainer.loss_type, inputs, rows)
        parent, terms = trainer.papo_loss_parts(model, select_sequences(inputs, rows))
        value += weight * parent.item()
        for j, (total, loss) in enumerate(zip(totals, losses)):
            piece = weight * flat_grad(loss(parent, terms), params)
            total += piece
            if j == 0:
                squares += piece * piece
    if abs(value - batch_loss_value) > CHUNK_SUM_REL_TOL * abs(batch_loss_value) + 1e-7:
        raise ValueError(
            f"probe roundoff='reordered': the weighted chunk losses add up to {value!r}, not the batch loss "
            f"{batch_loss_value!r} (loss_type={trainer.loss_type!r}); this batch cannot be split exactly"
        )
    return totals, squares


def reordered_gradients(
    trainer,
    model,
    inputs,
    params,
    assembles: Sequence[Callable],
    parent_loss: torch.Tensor,
    g_parent: torch.Tensor,
    samples: int = REORDERED_SAMPLES,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The zero-gamma gradient of each assembly over the tested split; ``samples`` roundoff samples (the parent
    gradient over each other split, minus ``g_parent``); and the squared magnitudes the tested sum rounds at (chunk
    gradients and ``g_parent``), which weight the projection."""
    tested, sample_splits = splits(batch_size(inputs), samples)
    zero_gamma = [lambda p, t, a=assemble: a(p, t, 0.0, 0.0, 0.0) for assemble in assembles]
    value = parent_loss.item()
    g_zeros, squares = accumulated_gradients(trainer, model, inputs, params, zero_gamma, tested, value)
    samples = []
    for split in sample_splits:
        (g_parent_again,), _ = accumulated_gradients(trainer, model, inputs, params, [lambda p, t: p], split, value)
        samples.append(g_parent_again - g_parent)
    return g_zeros, samples, squares + g_parent * g_parent
