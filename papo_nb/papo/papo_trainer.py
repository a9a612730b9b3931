"""PAPO-G as an adapter on TRL 1.9.1's GRPOTrainer.

The parent computes the GRPO loss untouched (``super()._compute_loss``); the adapter adds

    - gamma_t * KL_prcp(pi(.|q,I) || pi(.|q,I_mask)) + d_t * (eta1 * H[pi(.|q,I)] + eta2 * H[pi(.|q,I_mask)])

with the official bounded k3 estimator for KL_prcp (log-ratio in [-20, 20], k3 <= 10, fp32: ``terms.py``), restricted
to completion tokens and normalised the way the parent normalises its policy term; d_t = gamma_t / gamma_0 is the
official annealing discount of the entropy terms
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L364-L381). H is the official
sampled-token estimator -mean(log pi(o_t)) by default, or the full-vocabulary entropy. The unmasked log-probs are the
parent's own: a thin override of ``_get_per_token_logps_and_entropies`` captures them while the parent computes its
loss. The masked branch runs once per generation round by default (``rollout_branch.py``, the official timing), or
in every loss call (``masked_branch="update"``), then before the parent's forward, so that under no-grad its logits
are gone before the parent's (kept for backward) exist.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOTrainer

from . import masking, rollout_branch, shared_prefix, update_branch
from .citation import PAPO_PAPER
from .contract import ENTROPY_GRAD_GATE, validate_grad_norm_hook, validate_trl_parent_contract
from .papo_config import PAPOGConfig
from .perception_metrics import log_perception_metrics
from .rollout_branch import logp_call_arguments
from .step_guard import NonFiniteStepGuard
from .terms import bounded_k3, normalise_like_parent, zero_outside

MASK_CACHE_LIMIT = 4096  # prompt masks remembered within one generation round (bounds memory outside train())
ROLLOUT_ROW_KEY = "papo_rollout_row"  # a batch entry: each completion's row in its generation batch, for review
__all__ = ["PAPOGTrainer", "PerceptionTerms", "logp_call_arguments"]


@dataclass
class PerceptionTerms:
    """The adapter's differentiable pieces for one batch (fp32), each normalised like the parent's policy term."""

    perception_kl: torch.Tensor  # normalised mean k3 KL, to be maximised
    original_entropy: torch.Tensor
    masked_entropy: torch.Tensor
    kl_sum: torch.Tensor  # un-normalised sums (no grad), reduced across ranks by the probe
    token_count: torch.Tensor
    has_images: bool


class PAPOGTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] plus the PAPO-G perception KL and double-entropy terms.

    What changes against the parent:

    - ``_compute_loss``: the parent's loss, untouched, plus the PAPO-G terms (``assemble_loss``);
    - ``_get_per_token_logps_and_entropies``: captures the parent's own log-probs (and, for the full-vocabulary
      estimator with eta1 > 0, entropies with gradient) while it computes its loss;
    - ``_generate_and_score_completions``: with ``masked_branch="rollout"`` (default) adds the masked branch of the
      round to the batch it returns (``rollout_branch.py``);
    - ``_get_grad_norm``: skips an optimizer step whose gradient norm is not finite (``step_guard.py``);
    - ``_save_rng_state`` / ``_load_rng_state``: also save and restore the masking generator.

    Everything else (generation, rewards, advantages, reference KL, clipping, logging) is the parent's.

    Example:

    ```python
    from datasets import load_dataset
    from papo_nb.papo import PAPOGConfig, PAPOGTrainer

    dataset = load_dataset("trl-lib/...", split="train")  # prompts with images
    trainer = PAPOGTrainer(
        model="Qwen/Qwen2.5-VL-3B-Instruct",
        reward_funcs=my_reward,
        args=PAPOGConfig(output_dir="papo-g", num_generations=5),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "papo", "papo-g"]
    _name = "PAPO-G"
    _paper = PAPO_PAPER

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: PAPOGConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        """The parent's parameters (same names and order, TRL 1.9.1); ``args`` must be a [`PAPOGConfig`]."""
        validate_trl_parent_contract(GRPOTrainer)
        validate_grad_norm_hook(GRPOTrainer)
        if not isinstance(args, PAPOGConfig):  # GRPOTrainer would build a GRPOConfig without the PAPO fields
            raise TypeError(f"PAPOGTrainer needs args=PAPOGConfig(...), got {type(args).__name__}")
        if args.use_liger_kernel:
            # GRPOTrainer.compute_loss sends a Liger run to compute_liger_loss and never calls _compute_loss
            # (grpo_trainer.py:2913-2917): the PAPO terms and the probe would vanish without a word.
            raise ValueError(
                "PAPOGConfig.use_liger_kernel=True is invalid: GRPOTrainer's Liger loss bypasses _compute_loss, so "
                "the perception and entropy terms would silently not be trained; allowed: False"
            )
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        # Trainer sets this in its training loop; the probe and fixed-batch losses may run before train().
        self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        self._capture_parent_logps = False
        self._captured_parent_logps = None
        self.mask_generator = torch.Generator().manual_seed(self.args.mask_seed + self.args.process_index)
        self._mask_cache: dict[str, torch.Tensor] = {}
        self._mask_cache_round: int | None = None
        # (prompt_ids, completion_ids, KL, H, H_masked) token means per completion of the latest rollouts, this rank
        self.completion_perception: deque = deque(maxlen=self.args.generation_batch_size)
        # For a reviewer, by a completion's row in this rank's latest generation batch (ROLLOUT_ROW_KEY, carried
        # through TRL's shuffle): its (KL, H, H_masked) token means and the mask selection it trained with.
        self.rollout_perception: dict[int, tuple[float, float, float]] = {}
        self.rollout_masks: dict[int, torch.Tensor] = {}
        # Which form the no-grad masked branch takes (shared prompt prefix or full forward); raises if asked for
        # the shared prefix where it cannot run.
        self.masked_forward_plan = shared_prefix.plan(self.args, self.model)
        self.masked_branch_owner = rollout_branch.new_owner_tag()
        self.masked_branch_clock = rollout_branch.BranchClock()  # its time and passes, wherever it runs
        self.step_guard = NonFiniteStepGuard(self.args.max_consecutive_nonfinite_grad_steps)
        self.probe = None
        if self.args.require_gpu_contract_probe:
            from .probe import GammaZeroProbe

            self.probe = GammaZeroProbe(max_degenerate_batches=self.args.probe_max_degenerate_batches)

    # ---- the one place the total loss is assembled (the probe differentiates it at gamma = 0) ----
    @staticmethod
    def assemble_loss(
        parent_loss: torch.Tensor, terms: PerceptionTerms, gamma: float, eta1: float, eta2: float
    ) -> torch.Tensor:
        """``eta1``/``eta2`` here are the effective weights, the annealing discount already applied."""
        papo = -gamma * terms.perception_kl + eta1 * terms.original_entropy + eta2 * terms.masked_entropy
        return parent_loss + papo

    def schedule_steps(self) -> int:
        """Total optimizer steps of the run: the Trainer's resolved ``state.max_steps`` (set from epochs too), else
        ``args.max_steps`` before train(); <= 0 when unknown."""
        return self.state.max_steps if self.state.max_steps > 0 else self.args.max_steps

    def current_gamma(self) -> float:
        """gamma_t: fixed, or the official linear annealing (MikeWangWZHL/PAPO at fb63bf4, verl/trainer/core_algos.py
        L75-L90, ray_trainer.py L327-L338) over ``int(total_steps * perception_annealing_ratio)`` optimizer steps."""
        args = self.args
        total = self.schedule_steps()
        if args.perception_loss_schedule == "fixed" or total <= 0:
            return args.perception_loss_weight
        span = max(1, int(total * args.perception_annealing_ratio))
        progress = min(self.state.global_step / span, 1.0)
        start, end = args.perception_loss_weight, args.perception_loss_weight_final
        return start + (end - start) * progress

    def annealing_discount(self) -> float:
        """gamma_t / gamma_0, the official factor on both entropy terms (the module docstring's dp_actor.py link)."""
        gamma0 = self.args.perception_loss_weight
        return self.current_gamma() / gamma0 if gamma0 > 0 else 1.0

    # ---- hooks ----
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not self._capture_parent_logps:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._capture_parent_logps = False  # only the parent's main forward of this loss call
        outputs = self._with_entropy_grad(self._full_entropy_grad(self.args.original_entropy_weight), *args, **kwargs)
        self._captured_parent_logps = outputs
        return outputs

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.rollout_perception, self.rollout_masks = {}, {}
        batch[ROLLOUT_ROW_KEY] = torch.arange(len(batch["prompt_ids"]))  # the row in TRL's logs, after shuffling
        if self.args.masked_branch == "rollout":
            batch.update(rollout_branch.masked_branch_entries(self, batch))
        return batch

    def _get_grad_norm(self, model, grad_norm=None):
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.step_guard.check(self, model, norm):  # not finite: gradients dropped, so the optimizer skips
            self._metrics["train"]["papo/nonfinite_grad_steps"].append(float(self.step_guard.total))
        return norm

    def _compute_loss(self, model, inputs):
        parent_loss, terms = self.papo_loss_parts(model, inputs)
        if self.probe is not None and self.probe.pending and self.model.training:
            self.probe.observe(self, model, parent_loss, terms, step=self.state.global_step)
            self._metrics["train"].update({f"probe/{k}": [v] for k, v in self.probe.metrics().items()})
        discount = self.annealing_discount()
        args = self.args
        return self.assemble_loss(
            parent_loss,
            terms,
            self.current_gamma(),
            args.original_entropy_weight * discount,
            args.masked_entropy_weight * discount,
        )

    # ---- pieces ----
    def _full_entropy_grad(self, weight: float) -> bool:
        return self.args.entropy_estimator == "full" and weight > 0

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

        The masked branch is the one this trainer's rollout pass stored with the batch (``masked_branch="rollout"``;
        a device batch of a round without it raises), else it is computed now. Computed now, it runs *before* the
        parent's forward: under no-grad (the default) its full-vocabulary logits are freed before the parent's
        forward creates the logits autograd keeps for backward, so the two never coexist (same math in either
        order)."""
        has_images = inputs.get("pixel_values") is not None
        stored = rollout_branch.stored_branch(self, inputs)
        if self.args.masked_branch == "rollout" and (
            stored is not None or rollout_branch.in_buffered_round(self, inputs)
        ):
            if has_images and stored is None:
                raise RuntimeError(
                    "masked_branch='rollout': a device batch of this generation round has images but no stored "
                    f"masked branch ({rollout_branch.MASKED_LOGPS_KEY} missing or from another trainer)"
                )
            masked = stored if has_images else None  # the same choice on every rank: no collective needed
        else:  # masked_branch='update', or a batch built outside a round (probe, tests, benchmarks): compute it now
            with self.masked_branch_clock.timing():
                any_images = self._images_on_any_rank(has_images)  # a collective: every rank calls it
                masked = self._masked_forward(model, inputs) if has_images else None
                if not has_images and any_images:
                    self._masked_forward(model, inputs)  # result unused: see _images_on_any_rank
        self._capture_parent_logps, self._captured_parent_logps = True, None
        try:
            parent_loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_parent_logps = False
        logps, entropies, _ = self._captured_parent_logps
        self._captured_parent_logps = None
        terms = self._perception_terms(inputs, logps, entropies, masked, parent_loss)
        return parent_loss, terms

    # ---- masks ----
    def _mask_round(self) -> int | None:
        """Which generation round the current batch belongs to (masks are shared within it); None in eval."""
        if not self.model.training:
            return None
        return self._step // (self.args.steps_per_generation * self.num_iterations)

    def mask_patch_size(self) -> int:
        """The model's own vision patch size: the vision config's, cross-checked with the image processor's."""
        image_processor = self.processing_class.image_processor
        vision = getattr(getattr(self.model, "config", None), "vision_config", None)
        sizes = {
            name: value
            for name, value in (
                ("vision_config.patch_size", getattr(vision, "patch_size", None)),
                ("image_processor.patch_size", getattr(image_processor, "patch_size", None)),
                ("image_processor.encoder_patch_size", getattr(image_processor, "encoder_patch_size", None)),
            )
            if isinstance(value, int)
        }
        if not sizes or len(set(sizes.values())) > 1:
            raise ValueError(f"cannot tell the model's vision patch size for masking: found {sizes or 'none'}")
        return next(iter(sizes.values()))

    def batch_patch_map(self, inputs: dict[str, Any]) -> masking.PatchMap:
        """The real patches of this batch's pixel_values, in whichever layout it has (``masking``)."""
        image_processor = self.processing_class.image_processor
        merge = getattr(image_processor, "merge_size", 2) if self.args.mask_type == "merge_unit" else 1
        return masking.patch_map(
            inputs,
            patch_size=self.mask_patch_size(),
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
            merge_size=merge,
        )

    def _draw_mask(self, patches: masking.PatchMap, sample: int, sample_pixels: torch.Tensor) -> torch.Tensor:
        """A fresh mask for one sample: a bool per patch unit, or (``random``) a coin per pixel value."""
        if self.args.mask_type == "random":
            return torch.rand(sample_pixels.shape, generator=self.mask_generator) < self.args.mask_ratio
        return masking.select_units(patches.sample_segments(sample), self.args.mask_ratio, self.mask_generator)

    def _sample_masks(self, inputs: dict[str, Any], patches: masking.PatchMap) -> list[torch.Tensor]:
        """One mask per sample. ``mask_sharing='prompt'``: drawn once per prompt (content key) per generation round
        and reused by every rollout of that prompt, in this device batch or a later one of the same round (TRL
        shuffles rollouts across them); ``'completion'``: a fresh draw for each sample."""
        pixel_values = inputs["pixel_values"]
        if self.args.mask_sharing != "prompt":
            return [self._draw_mask(patches, i, pixel_values[a:b]) for i, (a, b) in enumerate(patches.sample_rows)]
        round_ = self._mask_round()
        if round_ is None or round_ != self._mask_cache_round or len(self._mask_cache) > MASK_CACHE_LIMIT:
            self._mask_cache, self._mask_cache_round = {}, round_
        keys = masking.sample_keys(inputs)
        for i, (start, end) in enumerate(patches.sample_rows):
            if keys[i] not in self._mask_cache:
                self._mask_cache[keys[i]] = self._draw_mask(patches, i, pixel_values[start:end])
        return [self._mask_cache[key] for key in keys]

    def masked_pixel_values(self, inputs: dict[str, Any]) -> torch.Tensor:
        """``pixel_values`` with the masks of ``mask_type`` applied: black after normalisation, only on real patches
        (padding pixels and padded tiles stay as they are); a new tensor, the input is never written."""
        patches = self.batch_patch_map(inputs)
        masks = self._sample_masks(inputs, patches)
        for i, row in enumerate(inputs.get(ROLLOUT_ROW_KEY, torch.empty(0)).tolist()):
            self.rollout_masks[row] = masks[i].cpu()
        if self.args.mask_type == "random":
            return patches.apply_values(inputs["pixel_values"], torch.cat(masks))
        return patches.apply(inputs["pixel_values"], torch.cat(masks))

    # ---- terms ----
    def _normalise(self, per_token: torch.Tensor, mask: torch.Tensor, inputs) -> torch.Tensor:
        training = self.model.training
        return normalise_like_parent(
            per_token,
            mask,
            loss_type=self.loss_type,
            accumulation=self.current_gradient_accumulation_steps if training else 1.0,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            training=training,
        )

    def _perception_terms(self, inputs, logps, entropies, masked, parent_loss=None) -> PerceptionTerms:
        """``masked``: the ``(logps, entropies)`` of ``_masked_forward``, or None for a text-only batch. All fp32."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mask = mask.float()
        has_images = inputs.get("pixel_values") is not None
        if has_images:
            masked_logps, masked_entropies = masked
        else:  # the masked branch of a text-only batch is the original branch: KL 0, no forward needed
            masked_logps, masked_entropies = logps.detach(), None if entropies is None else entropies.detach()
        per_token_kl = bounded_k3(masked_logps, logps, self.args.perception_kl_clamp)
        if self.args.entropy_estimator == "sampled":  # -log pi(o_t): its mean is the sampled entropy estimate
            original_h, masked_h = -logps.float(), -masked_logps.float()
        else:
            original_h, masked_h = entropies.float(), masked_entropies.float()
        with torch.no_grad():
            sums = torch.stack([(zero_outside(x, mask) * mask).sum() for x in (per_token_kl, original_h, masked_h)])
            token_count = mask.sum()
            rows = torch.stack([(zero_outside(x, mask) * mask).sum(1) for x in (per_token_kl, original_h, masked_h)])
            rows = (rows / mask.sum(1).clamp(min=1.0)).T.tolist()
            ids = zip(inputs["prompt_ids"].tolist(), inputs["completion_ids"].tolist(), strict=True)
            self.completion_perception.extend((p, c, *r) for (p, c), r in zip(ids, rows, strict=True))
            for row, terms in zip(inputs.get(ROLLOUT_ROW_KEY, torch.empty(0)).tolist(), rows, strict=False):
                self.rollout_perception[row] = tuple(terms)
        terms = PerceptionTerms(
            perception_kl=self._normalise(per_token_kl, mask, inputs),
            original_entropy=self._normalise(original_h, mask, inputs),
            masked_entropy=self._normalise(masked_h, mask, inputs),
            kl_sum=sums[0],
            token_count=token_count,
            has_images=has_images,
        )
        log_perception_metrics(self, sums, token_count, parent_loss)
        return terms

    def _masked_forward(self, model, inputs):
        return update_branch.masked_forward(self, model, inputs)

    def _images_on_any_rank(self, has_images: bool) -> bool:
        return update_branch.images_on_any_rank(self, has_images)

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
            self._mask_cache, self._mask_cache_round = {}, None  # TRL regenerates rollouts after a resume
