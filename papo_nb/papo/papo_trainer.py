"""PAPO-G as an adapter on TRL 1.9.1's GRPOTrainer.

The parent computes the GRPO loss untouched (``super()._compute_loss``); the adapter adds

    - gamma_t * KL_prcp(pi(.|q,I) || pi(.|q,I_mask)) + d_t * (eta1 * H[pi(.|q,I)] + eta2 * H[pi(.|q,I_mask)])

with the official bounded k3 estimator for KL_prcp (log-ratio in [-20, 20], k3 <= 10, fp32: ``terms.py``), restricted
to completion tokens and normalised the way the parent normalises its policy term; d_t = gamma_t / gamma_0 is the
official annealing discount of the entropy terms
(https://github.com/MikeWangWZHL/PAPO/blob/fb63bf4/verl/workers/actor/dp_actor.py#L364-L381). H is the official
sampled-token estimator -mean(log pi(o_t)) by default, or the full-vocabulary entropy. The unmasked log-probs are the
parent's own: a thin override of ``_get_per_token_logps_and_entropies`` captures them while the parent computes its
loss. The masked branch (``masked_branch.py``) runs once per generation round by default (``rollout_branch.py``, the
official timing), or in every loss call (``masked_branch="update"``), then before the parent's forward, so that
under no-grad its logits are gone before the parent's (kept for backward) exist.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

import torch
from trl import GRPOTrainer

from .citation import PAPO_PAPER
from .contract import ENTROPY_GRAD_GATE, validate_grad_norm_hook, validate_trl_parent_contract
from .loss_observer import training_observer
from .mask_state import ROLLOUT_ROW_KEY, MaskState
from .masked_branch import MaskedBranch
from .papo_config import PAPOGConfig
from .perception_metrics import log_perception_metrics
from .rollout_branch import MASKED_LOGPS_KEY
from .step_guard import NonFiniteStepGuard
from .terms import PerceptionTerms, normalise_like_parent, perception_terms

# The parent's constructor parameters, which __init__ forwards by name (its own signature spells them out).
PARENT_PARAMETERS = tuple(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
__all__ = ["PAPOGTrainer"]


class PAPOGTrainer(GRPOTrainer):
    """[`~trl.GRPOTrainer`] plus the PAPO-G perception KL and double-entropy terms.

    What changes against the parent:

    - ``_compute_loss``: the parent's loss, untouched, plus the PAPO-G terms (``assemble_loss``);
    - ``_get_per_token_logps_and_entropies``: captures the parent's own log-probs (and, for the full-vocabulary
      estimator with eta1 > 0, entropies with gradient) while it computes its loss;
    - ``_generate_and_score_completions``: with ``masked_branch="rollout"`` (default) adds the masked branch of the
      round to the batch it returns (``MaskedBranch.rollout_entries``);
    - ``_get_grad_norm``: skips an optimizer step whose gradient norm is not finite (``step_guard.py``);
    - ``_save_rng_state`` / ``_load_rng_state``: also save and restore the masking generator.

    Two collaborators hold the state: ``masks`` (``MaskState``: generator, per-round mask cache, patch size) and
    ``masked_branch`` (``MaskedBranch``: plan, clock, owner tag); ``probe`` is the one observer hook
    (``loss_observer.py``).

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
        parent_arguments = {name: value for name, value in locals().items() if name in PARENT_PARAMETERS}
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
        super().__init__(**parent_arguments)
        # Trainer sets this in its training loop; the probe and fixed-batch losses may run before train().
        self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        self._capture_parent_logps = False
        self._captured_parent_logps = None
        self.masks = MaskState(self.args, self.model, self.processing_class)  # generator, round cache, patch size
        self.masked_branch = MaskedBranch(self.args, self.model, self.accelerator, self._metrics, self.temperature)
        # (prompt_ids, completion_ids, KL, H, H_masked) token means per completion of the latest rollouts, this rank
        self.completion_perception: deque = deque(maxlen=self.args.generation_batch_size)
        # for a reviewer, by a completion's row in this rank's latest generation batch (ROLLOUT_ROW_KEY, carried
        # through TRL's shuffle): its (KL, H, H_masked) token means; its mask is in masks.rollout_masks
        self.rollout_perception: dict[int, tuple[float, float, float]] = {}
        self.step_guard = NonFiniteStepGuard(self.args.max_consecutive_nonfinite_grad_steps)
        # The one observer hook (loss_observer.py): the in-training probe when the config asks for it, else None.
        self.probe = training_observer(self.args)

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
        self.rollout_perception, self.masks.rollout_masks = {}, {}
        batch[ROLLOUT_ROW_KEY] = torch.arange(len(batch["prompt_ids"]))  # the row in TRL's logs, after shuffling
        if self.args.masked_branch == "rollout":
            batch.update(self.masked_branch.rollout_entries(batch, self.masked_pixel_values, self._with_entropy_grad))
        return batch

    def _get_grad_norm(self, model, grad_norm=None):
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.step_guard.check(self.state, model, norm):  # not finite: gradients dropped, so the optimizer skips
            self._metrics["train"]["papo/nonfinite_grad_steps"].append(float(self.step_guard.total))
        return norm

    def _compute_loss(self, model, inputs):
        parent_loss, terms = self.papo_loss_parts(model, inputs)
        if self.probe is not None and self.probe.pending and self.model.training:
            self.probe.observe(self, model, parent_loss, terms, step=self.state.global_step)
            self._metrics["train"].update({f"probe/{k}": [v] for k, v in self.probe.metrics().items()})
        discount, args = self.annealing_discount(), self.args
        eta1, eta2 = args.original_entropy_weight * discount, args.masked_entropy_weight * discount
        return self.assemble_loss(parent_loss, terms, self.current_gamma(), eta1, eta2)

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
        masked = self._masked_branch_of(model, inputs)
        self._capture_parent_logps, self._captured_parent_logps = True, None
        try:
            parent_loss = super()._compute_loss(model, inputs)
        finally:
            self._capture_parent_logps = False
        logps, entropies, _ = self._captured_parent_logps
        self._captured_parent_logps = None
        return parent_loss, self._perception_terms(inputs, logps, entropies, masked, parent_loss)

    def _masked_branch_of(self, model, inputs):
        """The batch's masked ``(logps, entropies)``: stored by the rollout pass, or computed now; None without
        images."""
        has_images = inputs.get("pixel_values") is not None
        stored = self.masked_branch.stored(inputs)
        in_round = any(inputs is batch for batch in getattr(self, "_buffered_inputs", None) or [])
        if self.args.masked_branch == "rollout" and (stored is not None or in_round):
            if has_images and stored is None:
                raise RuntimeError(
                    "masked_branch='rollout': a device batch of this generation round has images but no stored "
                    f"masked branch ({MASKED_LOGPS_KEY} missing or from another trainer)"
                )
            return stored if has_images else None  # the same choice on every rank: no collective needed
        # masked_branch='update', or a batch built outside a round (probe, tests, benchmarks): compute it now
        with self.masked_branch.clock.timing():
            any_images = self.masked_branch.images_on_any_rank(has_images)  # a collective: every rank calls it
            if has_images:
                return self.masked_forward(model, inputs)
            if any_images:  # result unused: see MaskedBranch.images_on_any_rank
                self.masked_forward(model, inputs)
        return None

    def masked_forward(self, model, inputs):
        """The masked branch of ``inputs`` computed now (masking, then the forward), as the loss call runs it."""
        pixels = self.masked_pixel_values(inputs) if inputs.get("pixel_values") is not None else None
        entropy_grad = self._full_entropy_grad(self.args.masked_entropy_weight)
        return self.masked_branch.compute(model, inputs, pixels, self._with_entropy_grad, entropy_grad)

    # ---- masks: the state is MaskState's; the trainer only knows which generation round a batch belongs to ----
    def _mask_round(self) -> int | None:
        """Which generation round the current batch belongs to (masks are shared within it); None in eval."""
        if not self.model.training:
            return None
        return self._step // (self.args.steps_per_generation * self.num_iterations)

    @property
    def mask_generator(self) -> torch.Generator:
        return self.masks.generator

    @property
    def rollout_masks(self) -> dict[int, torch.Tensor]:
        return self.masks.rollout_masks

    def mask_patch_size(self) -> int:
        return self.masks.patch_size()

    def masked_pixel_values(self, inputs: dict[str, Any]) -> torch.Tensor:
        """``pixel_values`` with this trainer's masks for the current round (``MaskState.masked_pixel_values``)."""
        return self.masks.masked_pixel_values(inputs, self._mask_round())

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
        """``masked``: the masked branch's ``(logps, entropies)``, or None for a text-only batch (``terms.py``)."""
        terms, sums, rows = perception_terms(
            inputs,
            logps,
            entropies,
            masked,
            kl_clamp=self.args.perception_kl_clamp,
            estimator=self.args.entropy_estimator,
            normalise=lambda per_token, mask: self._normalise(per_token, mask, inputs),
        )
        ids = zip(inputs["prompt_ids"].tolist(), inputs["completion_ids"].tolist(), strict=True)
        self.completion_perception.extend((p, c, *r) for (p, c), r in zip(ids, rows, strict=True))
        for row, row_terms in zip(inputs.get(ROLLOUT_ROW_KEY, torch.empty(0)).tolist(), rows, strict=False):
            self.rollout_perception[row] = tuple(row_terms)
        discount = self.annealing_discount()
        log_perception_metrics(
            self._metrics["train" if self.model.training else "eval"],
            self.accelerator,
            sums,
            terms.token_count,
            parent_loss,
            gamma=self.current_gamma(),
            discount=discount,
            eta=(self.args.original_entropy_weight * discount, self.args.masked_entropy_weight * discount),
        )
        return terms

    # ---- checkpoints: the masking generator is resumed with the RNG states the Trainer saves ----
    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        self.masks.save(output_dir)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        self.masks.load(checkpoint)
