"""PAPO-G as an adapter on TRL 1.9.1's GRPOTrainer.

The parent computes the GRPO loss untouched (``super()._compute_loss``); the adapter adds

    - gamma * KL_prcp(pi(.|q,I) || pi(.|q,I_mask)) + eta1 * H[pi(.|q,I)] + eta2 * H[pi(.|q,I_mask)]

with the per-token k3 estimator for KL_prcp, restricted to completion tokens and normalised the way the
parent normalises its policy term. The unmasked log-probs and entropies are the parent's own: a thin
override of ``_get_per_token_logps_and_entropies`` captures them while the parent computes its loss, so
only one extra (masked) forward runs per step. It runs before the parent's, so that under no-grad its logits
are gone before the parent's (kept for backward) exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer

from papo_nb.papo import masking
from papo_nb.papo.contract import ENTROPY_GRAD_GATE, VLM_FORWARD_KEYWORDS, validate_trl_parent_contract
from papo_nb.papo.papo_config import PAPOGConfig


def logp_call_arguments(inputs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``(input_ids, attention_mask, logits_to_keep)`` and the VLM keywords for ``_get_per_token_logps_and_entropies``
    on a ``_compute_loss`` batch, built as the parent builds them."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return (input_ids, attention_mask, inputs["completion_ids"].size(1)), {
        key: inputs.get(key) for key in VLM_FORWARD_KEYWORDS
    }


@dataclass
class PerceptionTerms:
    """The adapter's differentiable pieces for one batch, each normalised like the parent's policy term."""

    perception_kl: torch.Tensor  # normalised mean k3 KL, to be maximised
    original_entropy: torch.Tensor
    masked_entropy: torch.Tensor
    kl_sum: torch.Tensor  # un-normalised sums (no grad), reduced across ranks by the probe
    token_count: torch.Tensor
    has_images: bool


class PAPOGTrainer(GRPOTrainer):
    """GRPOTrainer plus the PAPO-G perception and double-entropy terms. See the module docstring."""

    _tag_names = ["trl", "grpo", "papo"]

    def __init__(self, *args, **kwargs):
        validate_trl_parent_contract(GRPOTrainer)
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, PAPOGConfig):
            raise TypeError(f"PAPOGTrainer needs args=PAPOGConfig(...), got {type(self.args).__name__}")
        # Trainer sets this in its training loop; the probe and fixed-batch losses may run before train().
        self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        self._capture_parent_logps = False
        self._captured_parent_logps = None
        self.mask_generator = torch.Generator().manual_seed(self.args.mask_seed)
        self.probe = None
        if self.args.require_gpu_contract_probe:
            from papo_nb.papo.probe import GammaZeroProbe

            self.probe = GammaZeroProbe(max_degenerate_batches=self.args.probe_max_degenerate_batches)

    # ---- the one place the total loss is assembled (the probe differentiates it at gamma = 0) ----
    @staticmethod
    def assemble_loss(
        parent_loss: torch.Tensor, terms: PerceptionTerms, gamma: float, eta1: float, eta2: float
    ) -> torch.Tensor:
        papo = -gamma * terms.perception_kl + eta1 * terms.original_entropy + eta2 * terms.masked_entropy
        return parent_loss + papo

    def current_gamma(self) -> float:
        args = self.args
        if args.perception_loss_schedule == "fixed" or args.max_steps <= 0:
            return args.perception_loss_weight
        progress = min(self.state.global_step / args.max_steps, 1.0)
        return (
            args.perception_loss_weight + (args.perception_loss_weight_final - args.perception_loss_weight) * progress
        )

    # ---- hooks ----
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not self._capture_parent_logps:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._capture_parent_logps = False  # only the parent's main forward of this loss call
        outputs = self._with_entropy_grad(self.args.original_entropy_weight > 0, *args, **kwargs)
        self._captured_parent_logps = outputs
        return outputs

    def _compute_loss(self, model, inputs):
        parent_loss, terms = self.papo_loss_parts(model, inputs)
        if self.probe is not None and self.probe.pending and self.model.training:
            self.probe.observe(self, model, parent_loss, terms, step=self.state.global_step)
            self._metrics["train"].update({f"probe/{k}": [v] for k, v in self.probe.metrics().items()})
        args = self.args
        return self.assemble_loss(
            parent_loss, terms, self.current_gamma(), args.original_entropy_weight, args.masked_entropy_weight
        )

    # ---- pieces ----
    def _with_entropy_grad(self, want_grad: bool, *args, **kwargs):
        """Call the parent's log-prob method; with ``want_grad`` its entropies keep their graph."""
        gate = getattr(self, ENTROPY_GRAD_GATE)
        setattr(self, ENTROPY_GRAD_GATE, gate or (want_grad and torch.is_grad_enabled()))
        try:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        finally:
            setattr(self, ENTROPY_GRAD_GATE, gate)

    def papo_loss_parts(self, model, inputs) -> tuple[torch.Tensor, PerceptionTerms]:
        """The parent's loss and the adapter's terms for ``inputs`` (which is never modified).

        The masked forward runs *before* the parent's: under no-grad (the default) its full-vocabulary logits are
        freed before the parent's forward creates the logits autograd keeps for backward, so the two never coexist
        and PAPO-G's peak memory stays that of the parent step (it is the same math in either order)."""
        has_images = inputs.get("pixel_values") is not None
        masked = self._masked_forward(model, inputs) if has_images else None
        if not has_images and self._images_on_any_rank(has_images):
            self._masked_forward(model, inputs)  # result unused: see _images_on_any_rank
        self._capture_parent_logps, self._captured_parent_logps = True, None
        try:
            parent_loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_parent_logps = False
        logps, entropies, _ = self._captured_parent_logps
        self._captured_parent_logps = None
        terms = self._perception_terms(model, inputs, logps, entropies, masked)
        return parent_loss, terms

    def masked_pixel_values(self, inputs: dict[str, Any]) -> torch.Tensor:
        image_processor = self.processing_class.image_processor
        stats = dict(image_mean=image_processor.image_mean, image_std=image_processor.image_std)
        if self.args.mask_type == "random":
            return masking.mask_random_elements(
                inputs["pixel_values"], self.args.mask_ratio, generator=self.mask_generator, **stats
            )
        if inputs.get("image_grid_thw") is None:
            raise ValueError(
                f"mask_type={self.args.mask_type!r} needs image_grid_thw (Qwen-VL layout); use mask_type='random'"
            )
        return masking.mask_patches(
            inputs["pixel_values"],
            inputs["image_grid_thw"],
            self.args.mask_ratio,
            unit=self.args.mask_type,
            merge_size=getattr(image_processor, "merge_size", 2),
            generator=self.mask_generator,
            **stats,
        )

    def _perception_terms(self, model, inputs, logps, entropies, masked) -> PerceptionTerms:
        """``masked``: the ``(logps, entropies)`` of ``_masked_forward``, or None for a text-only batch."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        has_images = inputs.get("pixel_values") is not None
        if has_images:
            masked_logps, masked_entropies = masked
        else:  # the masked branch of a text-only batch is the original branch: KL 0, no forward needed
            masked_logps, masked_entropies = logps.detach(), entropies.detach()
        log_ratio = masked_logps - logps
        per_token_kl = torch.exp(log_ratio) - log_ratio - 1.0
        if self.args.perception_kl_clamp is not None:
            per_token_kl = per_token_kl.clamp(0.0, self.args.perception_kl_clamp)
        mask_f = mask.to(per_token_kl.dtype)
        with torch.no_grad():
            kl_sum, entropy_sum, token_count = (
                (per_token_kl * mask_f).sum(),
                (masked_entropies * mask_f).sum(),
                mask_f.sum(),
            )
        terms = PerceptionTerms(
            perception_kl=self._normalise_like_parent(per_token_kl, mask_f, inputs),
            original_entropy=self._normalise_like_parent(entropies, mask_f, inputs),
            masked_entropy=self._normalise_like_parent(masked_entropies, mask_f, inputs),
            kl_sum=kl_sum,
            token_count=token_count,
            has_images=has_images,
        )
        self._log_perception_metrics(kl_sum, entropy_sum, token_count)
        return terms

    def _masked_forward(self, model, inputs):
        positional, vlm_kwargs = logp_call_arguments(inputs)
        if inputs.get("pixel_values") is not None:  # else a text-only batch's parity forward (see _images_on_any_rank)
            vlm_kwargs["pixel_values"] = self.masked_pixel_values(inputs)
        want_entropy_grad = self.args.masked_branch_grad and self.args.masked_entropy_weight > 0
        with torch.set_grad_enabled(self.args.masked_branch_grad and torch.is_grad_enabled()):
            logps, entropies, _ = self._with_entropy_grad(
                want_entropy_grad, model, *positional, compute_entropy=True, **vlm_kwargs
            )
        return logps, entropies

    def _images_on_any_rank(self, has_images: bool) -> bool:
        """Whether any process's batch has images; every process must call it (one scalar all-reduce).

        Under DDP (buffer broadcast), ZeRO-3 and FSDP a forward is a collective, so every process must run the same
        number of forwards: a text-only batch next to an image batch on another rank runs the masked forward too
        (on its unmasked inputs, result unused; its perception term stays exactly 0). One process: no collective."""
        if self.accelerator.num_processes == 1:
            return has_images
        flag = torch.tensor([float(has_images)], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)

    # ---- checkpoints: the masking generator is resumed with the RNG states the Trainer saves ----
    def _mask_rng_file(self, folder: str) -> str:
        return os.path.join(folder, f"papo_mask_rng_{self.args.process_index}.pth")

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        torch.save(self.mask_generator.get_state(), self._mask_rng_file(output_dir))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if checkpoint is not None and os.path.isfile(self._mask_rng_file(checkpoint)):
            self.mask_generator.set_state(torch.load(self._mask_rng_file(checkpoint), weights_only=True))

    def _normalise_like_parent(self, per_token: torch.Tensor, mask: torch.Tensor, inputs) -> torch.Tensor:
        """Reduce a (B, T) per-token quantity exactly as GRPOTrainer 1.9.1 reduces its policy term."""
        training = self.model.training
        accumulation = self.current_gradient_accumulation_steps if training else 1.0
        masked = per_token * mask
        loss_type = self.loss_type
        if loss_type in ("grpo", "sapo"):
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
        if loss_type == "bnpo":
            return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
        if loss_type == "dr_grpo":
            return masked.sum() / (per_token.size(0) * self.max_completion_length) / accumulation
        if loss_type in ("cispo", "dapo", "vespo"):
            normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if training:
                normaliser = normaliser * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return masked.sum() / normaliser
        if loss_type == "luspo":  # per-sequence mean times length = per-sequence sum
            return masked.sum(-1).mean() / accumulation
        raise ValueError(f"PAPOGTrainer does not know how to normalise for loss_type={loss_type!r}")

    def _log_perception_metrics(self, kl_sum, entropy_sum, token_count) -> None:
        mode = "train" if self.model.training else "eval"
        totals = self.accelerator.reduce(
            torch.stack([kl_sum, entropy_sum, token_count]).detach().float(), reduction="sum"
        )
        kl, masked_entropy = (totals[:2] / totals[2].clamp(min=1.0)).tolist()
        metrics = self._metrics[mode]
        metrics["perception_kl"].append(kl)
        metrics["perception_loss"].append(-kl)
        metrics["masked_entropy"].append(masked_entropy)
        metrics["perception_gamma"].append(self.current_gamma())
