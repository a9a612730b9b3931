"""The masked branch computed in the loss call (``masked_branch="update"``, and batches built outside a round).

With ``masked_branch_grad=True`` this is the official ``RECOMPUTE_AUG_LOG_PROBS=True``: a masked forward per update
micro-batch with the current policy and with gradient
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L46).
"""

from __future__ import annotations

import torch

from . import shared_prefix
from .probe_reduce import sharded
from .rollout_branch import logp_call_arguments


def masked_forward(trainer, model, inputs):
    """The masked branch now, for this batch: ``(logps, entropies)``, shared prefix or full forward, with gradient
    when ``masked_branch_grad`` asks for it."""
    positional, vlm_kwargs = logp_call_arguments(inputs)
    if inputs.get("pixel_values") is not None:  # else a text-only batch's parity forward (see _images_on_any_rank)
        vlm_kwargs["pixel_values"] = trainer.masked_pixel_values(inputs)
    args = trainer.args
    want_entropy_grad = args.masked_branch_grad and trainer._full_entropy_grad(args.masked_entropy_weight)
    # The sampled estimator needs only log-probs; the full one asks the parent for vocabulary entropies.
    compute_entropy = args.entropy_estimator == "full"
    # Under no-grad, one prefill per prompt and its completions against the cached prefix (same numbers, see
    # shared_prefix.py); None where it does not apply (the reason is logged and in the metrics).
    shared = shared_prefix.masked_forward(trainer, model, inputs, vlm_kwargs.get("pixel_values"), compute_entropy)
    if shared is not None:
        return shared
    with torch.set_grad_enabled(args.masked_branch_grad and torch.is_grad_enabled()):
        logps, entropies, _ = trainer._with_entropy_grad(
            want_entropy_grad, model, *positional, compute_entropy=compute_entropy, **vlm_kwargs
        )
    return logps, entropies


def images_on_any_rank(trainer, has_images: bool) -> bool:
    """Whether any process's batch has images; every process must call it (one scalar all-reduce).

    Under DDP (buffer broadcast), ZeRO-3 and FSDP a forward is a collective, so every process must run the same
    number of forwards: a text-only batch next to an image batch on another rank runs the masked forward too
    (on its unmasked inputs, result unused; its perception term stays exactly 0). One process: no collective."""
    if trainer.accelerator.num_processes == 1:
        return has_images
    flag = torch.tensor([float(has_images)], device=trainer.accelerator.device)
    ranks = int(trainer.accelerator.reduce(flag, reduction="sum").item())
    if 0 < ranks < trainer.accelerator.num_processes and sharded(list(trainer.model.parameters())):
        # Only the image ranks would run the sharded vision tower, whose all-gathers the others never join
        # (measured: a 2-rank FSDP job aborts in all_gather); the same on every rank, so all raise.
        raise RuntimeError(
            f"under FSDP every rank's batch must have images or none; {ranks} of "
            f"{trainer.accelerator.num_processes} ranks have images in this batch (mixed text-only data)"
        )
    return ranks > 0
