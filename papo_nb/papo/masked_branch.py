"""The masked branch, one object per trainer: its plan (shared prompt prefix or full forward), its clock, the owner
tag of the rounds it stores, and its metrics and log lines.

A run whose perception term is off throughout (gamma 0 at every step, eta2 0, no in-training probe) never needs
the branch: ``skipped`` is then true, no image is masked and no masked forward runs (GRPOTrainer's cost, and every
model GRPOTrainer trains trains); its KL is exactly 0 and is logged so.

It runs in two places. In the loss call (``masked_branch="update"``, and batches built outside a round) as
``compute``: with ``masked_branch_grad=True`` this is the official ``RECOMPUTE_AUG_LOG_PROBS=True``, a masked forward
per update micro-batch with the current policy and with gradient
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L46). Once per generation round
(``masked_branch="rollout"``, the default) as ``rollout_entries`` (``rollout_branch.py``). Either way the caller hands
it the model, the batch, the function that masks a batch (its images, ``mask_state.MaskedImages``, in the loss call)
and the log-prob function explicitly; the object never reaches back into the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ..prefix_sharing.fsdp import partitioning
from . import prefill, rollout_branch
from .logp_inputs import logp_call_arguments
from .mask_state import MaskedImages
from .rollout_branch import MASKED_ENTROPIES_KEY, MASKED_LOGPS_KEY, OWNER_KEY, ROW_CHECK_KEY, row_checks
from .schedule import perception_off_for_the_run

logger = logging.get_logger(__name__)


@dataclass
class BranchClock:
    """Where the masked branch's time goes: wall and process CPU seconds, and how many passes ran."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    calls: int = 0

    @contextlib.contextmanager
    def timing(self):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - wall
            self.cpu_seconds += time.process_time() - cpu
            self.calls += 1


def nothing_reads_the_branch(args) -> bool:
    """True when nothing reads the masked branch of ``args``' run: gamma 0 for the whole run, eta2 0, no in-training
    probe, and the perception KL not asked for (``measure_perception_kl``)."""
    return (
        perception_off_for_the_run(args)
        and args.masked_entropy_weight == 0
        and not args.require_gpu_contract_probe
        and not args.measure_perception_kl
    )


class MaskedBranch:
    """``args``: the trainer's ``PAPOGConfig``; ``model``: the trainer's model (its mode and parameters);
    ``accelerator``: for the cross-rank choices; ``metrics``: the trainer's per-mode metric lists, where the branch
    records which forward it took; ``temperature``: the parent's sampling temperature."""

    def __init__(self, args, model, accelerator, metrics: dict, temperature: float):
        self.args, self.model, self.accelerator = args, model, accelerator
        self.metrics, self.temperature = metrics, temperature
        # Which form the no-grad branch takes; raises if asked for the shared prefix where it cannot run.
        self.plan = prefill.plan(args, model)
        self.owner = secrets.randbits(62)  # names this trainer's stored branches
        self.clock = BranchClock()
        self.reasons_logged: set[tuple[bool, str]] = set()

    @functools.cached_property
    def skipped(self) -> bool:
        """``nothing_reads_the_branch``, decided once from the config (later reads are the cached value)."""
        return nothing_reads_the_branch(self.args)

    def for_loss(self, model, inputs: dict[str, Any], mask_images, logps_of):
        """The batch's masked ``(logps, entropies)`` for the loss call: stored with this trainer's round, or computed
        now (``masked_branch="update"``, a batch built outside a round); None where it equals the original branch
        (a text-only batch, a skipped branch). ``mask_images(inputs)`` masks the batch's images (a
        ``mask_state.MaskedImages``), ``logps_of`` as in ``compute``."""
        if self.skipped:
            self.record_skip()
            return None
        has_images = inputs.get("pixel_values") is not None
        if self.args.masked_branch == "rollout" and self.owns(inputs):
            if not has_images:  # the same choice on every rank: no collective needed
                return None
            stored = self.stored(inputs)
            if stored is None:
                raise RuntimeError(
                    "masked_branch='rollout': a device batch of this generation round has images but no stored "
                    f"masked branch ({MASKED_LOGPS_KEY} missing)"
                )
            return stored
        with self.clock.timing():
            any_images = self.images_on_any_rank(has_images)  # a collective: every rank calls it
            if has_images:
                return self.compute(model, inputs, mask_images(inputs), logps_of)
            if any_images:  # result unused: see images_on_any_rank
                self.compute(model, inputs, None, logps_of)
        return None

    def record_skip(self) -> None:
        if (False, "skipped") not in self.reasons_logged:
            self.reasons_logged.add((False, "skipped"))
            logger.info(
                "PAPO-G masked branch skipped: gamma is 0 for the whole run, masked_entropy_weight is 0 and no "
                "in-training probe runs, so nothing reads it (perception KL exactly 0)"
            )

    # ---- the branch stored with a round ----
    def owns(self, inputs: dict[str, Any]) -> bool:
        """Whether ``inputs`` is (a device batch of) a round this branch's rollout pass saw."""
        owner = inputs.get(OWNER_KEY)
        return owner is not None and int(owner) == self.owner

    def stored(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(masked logps, masked entropies or None)`` stored with ``inputs`` by this branch's rollout pass, or
        None; raises when the stored rows are not the batch's (shape, or the per-row check)."""
        if not self.owns(inputs) or MASKED_LOGPS_KEY not in inputs:
            return None
        logps = inputs[MASKED_LOGPS_KEY]
        if logps.shape != inputs["completion_ids"].shape:
            raise RuntimeError(
                f"the stored masked log-probs have shape {tuple(logps.shape)}, the batch's completions "
                f"{tuple(inputs['completion_ids'].shape)}: the round was split or padded after the masked branch ran"
            )
        stored_checks = inputs.get(ROW_CHECK_KEY)
        if stored_checks is None:
            raise RuntimeError(f"the stored masked branch has no per-row check ({ROW_CHECK_KEY} missing)")
        wrong = (stored_checks.to(logps.device) != row_checks(inputs).to(logps.device)).nonzero().flatten()
        if len(wrong):
            raise RuntimeError(
                f"the stored masked branch is not aligned with the batch: rows {wrong.tolist()} of "
                f"{len(logps)} carry another completion's masked log-probs (their prompt and completion ids differ "
                "from those the branch was computed for): the round was reordered without the masked branch's keys"
            )
        return logps, inputs.get(MASKED_ENTROPIES_KEY)

    @torch.no_grad()
    def rollout_entries(self, batch: dict[str, Any], mask_pixels, logps_of) -> dict[str, Any]:
        """What the rollout pass adds to the parent's generation batch: the masked branch of every completion with an
        image with its per-row check, and the owner tag; only the tag for a round without images (its perception
        term is 0, no forward needed). ``mask_pixels(batch)`` masks a batch's images; ``logps_of`` is the parent's
        log-prob method."""
        has_images = batch.get("pixel_values") is not None
        # Every rank calls it (one all-reduce); it refuses a round with images on some ranks only under FSDP or
        # ZeRO-3, whose vision all-gathers would not pair. Under DDP this pass calls the unwrapped model, so a
        # text-only rank owes the others no forward.
        self.images_on_any_rank(has_images)
        if not has_images:
            return {OWNER_KEY: torch.tensor(self.owner)}
        with self.clock.timing():
            compute_entropy = self.args.entropy_estimator == "full"
            rows, processes = self.args.per_device_train_batch_size, self.accelerator.num_processes
            layout_reason = prefill_layout_reason(batch)
            if self.plan.shared and layout_reason is None:
                logps, entropies, completions, prefills = rollout_branch.shared_round(
                    self.model, batch, mask_pixels, self.temperature, compute_entropy, rows, processes
                )
                self.record(True, self.plan.reason + ", once per generation round", completions / prefills)
            else:
                logps, entropies = rollout_branch.full_round(
                    self.model, batch, mask_pixels, logps_of, compute_entropy, rows
                )
                self.record(False, layout_reason if self.plan.shared else self.plan.reason, None)
        entries = {MASKED_LOGPS_KEY: logps, OWNER_KEY: torch.tensor(self.owner), ROW_CHECK_KEY: row_checks(batch)}
        if entropies is not None:
            entries[MASKED_ENTROPIES_KEY] = entropies
        return entries

    # ---- the branch in the loss call ----
    def compute(self, model, inputs: dict[str, Any], masked: MaskedImages | None, logps_of):
        """The masked branch now, for this batch: ``(logps, entropies)``, shared prefix or full forward, with gradient
        when ``masked_branch_grad`` asks for it. ``masked``'s pixels replace the batch's images (None: a text-only
        batch's parity forward, see ``images_on_any_rank``), its groups and per-row pixels serve the shared prefix;
        ``logps_of(want_entropy_grad, model, *args, **kwargs)`` is the parent's log-prob method (the masked entropy
        keeps its gradient when the full estimator weighs it)."""
        # The sampled estimator needs only log-probs; the full one asks the parent for vocabulary entropies.
        compute_entropy = self.args.entropy_estimator == "full"
        entropy_grad = compute_entropy and self.args.masked_branch_grad and self.args.masked_entropy_weight > 0
        # Under no-grad, one prefill per prompt and its completions against the cached prefix (same numbers, see
        # prefill.py); None where it does not apply (the reason is logged and in the metrics).
        pixels = masked.pixel_values if masked is not None else inputs.get("pixel_values")
        shared = self._shared_prefix(model, inputs, masked, compute_entropy)
        if shared is not None:
            return shared
        positional, vlm_kwargs = logp_call_arguments(inputs)  # the full forward's arguments, as the parent's
        vlm_kwargs["pixel_values"] = pixels
        with torch.set_grad_enabled(self.args.masked_branch_grad and torch.is_grad_enabled()):
            logps, entropies, _ = logps_of(
                entropy_grad,
                model,
                *positional,
                compute_entropy=compute_entropy,
                **vlm_kwargs,
            )
        return logps, entropies

    def _shared_prefix(self, model, inputs: dict[str, Any], masked: MaskedImages | None, compute_entropy: bool):
        """``(logps, entropies)`` through the shared prefix where it applies (recorded in the metrics), else None.
        The masking's groups and per-row pixels are used as they are (a row's masked image is its group's); a batch
        without ``masked`` (text only) is grouped by its prompt tokens."""
        groups = None
        if masked is not None:
            groups = masked.groups
        elif self.plan.shared and inputs.get("prompt_ids") is not None:
            groups = prefill.prompt_groups(inputs, inputs.get("pixel_values"))
        shared, reason = self._choose(inputs, groups)
        if not shared:
            self.record(False, reason, None)
            return None
        group_pixels = None
        if masked is not None:  # each group's masked image: its first row's pixel rows
            group_pixels = [masked.pixel_values[slice(*masked.sample_rows[group[0]])] for group in groups]
        # Under FSDP/ZeRO-3 a forward is a collective: every rank runs one prefill and one completion forward here,
        # whatever its groups (chunks of whole groups would make the count depend on the batch).
        max_rows = len(inputs["prompt_ids"]) if self.accelerator.num_processes > 1 else None
        result = prefill.shared_prefix_logps(
            model,
            inputs,
            None,
            temperature=self.temperature,
            compute_entropy=compute_entropy,
            groups=groups,
            max_chunk_rows=max_rows,
            group_pixel_values=group_pixels,
        )
        self.record(True, reason, len(inputs["prompt_ids"]) / len(groups))
        return result

    def _choose(self, inputs: dict[str, Any], groups: list[list[int]] | None) -> tuple[bool, str]:
        """The choice for one batch: the plan, the grad mode, and (``"auto"``, one process) whether any prompt has two
        completions here. With several processes the choice must not depend on the batch: a forward is a collective
        under FSDP/ZeRO-3, so every rank must run as many."""
        if not self.plan.shared:
            return False, self.plan.reason
        layout_reason = prefill_layout_reason(inputs)
        if layout_reason is not None:
            return False, layout_reason
        if self.args.masked_branch_grad and torch.is_grad_enabled():
            return False, "masked_branch_grad=True with gradients enabled"
        single = self.accelerator.num_processes == 1
        if (
            self.args.masked_forward == "auto"
            and single
            and groups is not None
            and len(groups) == len(inputs["prompt_ids"])
        ):
            return False, "no prompt has two completions in this device batch"
        return True, self.plan.reason

    def record(self, shared: bool, reason: str, share: float | None) -> None:
        """The metric per batch, and one log line per distinct reason."""
        mode = "train" if self.model.training else "eval"
        self.metrics[mode][prefill.METRIC].append(float(shared))
        if share is not None:
            self.metrics[mode][prefill.SHARE_METRIC].append(share)
        if (shared, reason) not in self.reasons_logged:
            self.reasons_logged.add((shared, reason))
            if shared:
                logger.info("PAPO-G masked branch: shared-prompt-prefix forward (%s)", reason)
            else:
                logger.warning("PAPO-G masked branch: full forward per completion, because %s", reason)

    def images_on_any_rank(self, has_images: bool) -> bool:
        """Whether any process's batch has images; every process must call it (one scalar all-reduce).

        Under DDP (buffer broadcast), ZeRO-3 and FSDP a forward is a collective, so every process must run the same
        number of forwards: a text-only batch next to an image batch on another rank runs the masked forward too
        (on its unmasked inputs, result unused; its perception term stays exactly 0). One process: no collective."""
        processes = self.accelerator.num_processes
        if processes == 1:
            return has_images
        flag = torch.tensor([float(has_images)], device=self.accelerator.device)
        ranks = int(self.accelerator.reduce(flag, reduction="sum").item())
        refuse_mixed_images(ranks, processes, partitioning(list(self.model.parameters())))
        return ranks > 0


def prefill_layout_reason(inputs: dict[str, Any]) -> str | None:
    """Why a batch with images cannot be prefilled (its images' layout or positions), or None. Without
    ``mm_token_type_ids`` the full forward decides, as for every log-prob call: Qwen2-VL refuses the batch, Qwen2.5-VL
    runs it without multimodal positions; the prefill would otherwise need positions it cannot compute."""
    if inputs.get("pixel_values") is not None and inputs.get("image_grid_thw") is None:
        return "pixel_values without image_grid_thw"
    if inputs.get("image_grid_thw") is not None and inputs.get("mm_token_type_ids") is None:
        return "image_grid_thw without mm_token_type_ids (the full forward's own refusal or positions apply)"
    return None


def refuse_mixed_images(ranks: int, processes: int, partitioned_by: str | None) -> None:
    """Raise when ``ranks`` of ``processes`` have images and the parameters are gathered in a forward.

    Only the image ranks would run the sharded vision tower, whose all-gathers the others never join (measured: a
    2-rank FSDP job aborts in all_gather; ZeRO-3 gathers each module's partitions as its forward starts, the same
    pairing); the count is the same on every rank, so all raise."""
    if 0 < ranks < processes and partitioned_by is not None:
        raise RuntimeError(
            f"under {partitioned_by} every rank's batch must have images or none; {ranks} of {processes} ranks have "
            "images in this batch (mixed text-only data)"
        )
