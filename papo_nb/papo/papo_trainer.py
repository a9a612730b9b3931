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

import functools
import inspect
from typing import Any

import torch
from transformers.utils import logging
from trl import GRPOTrainer

from ..prefix_sharing import PrefixSharingMixin
from . import token_suppression, vllm_rollouts
from .citation import PAPO_PAPER
from .contract import ENTROPY_GRAD_GATE, validate_grad_norm_hook, validate_trl_parent_contract
from .forward_plan import ForwardPlanAtTrainStart, forward_plan, refresh_forward_plan
from .loss_observer import training_observer
from .mask_state import MaskedImages, MaskState, generation_round
from .masked_branch import MaskedBranch, nothing_reads_the_branch
from .papo_config import PAPOGConfig
from .perception_metrics import ROLLOUT_ROW_KEY, PerceptionRecord, log_perception_metrics
from .schedule import LossWeights, loss_weights
from .step_guard import NonFiniteStepGuard
from .terms import PerceptionTerms, assemble_loss, normalise_like_parent, perception_terms

# The parent's constructor parameters, which __init__ forwards by name (its own signature spells them out).
PARENT_PARAMETERS = tuple(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
__all__ = ["PAPOGTrainer"]


class PAPOGTrainer(PrefixSharingMixin, GRPOTrainer):
    """[`~trl.GRPOTrainer`] plus the PAPO-G perception KL and double-entropy terms.

    What changes against the parent:

    - ``_compute_loss``: the parent's loss, untouched, plus the PAPO-G terms (``terms.assemble_loss``);
    - ``_get_per_token_logps_and_entropies``: captures the parent's own log-probs (and, for the full-vocabulary
      estimator with eta1 > 0, entropies with gradient) while it computes its loss;
    - ``_generate_and_score_completions``: with vLLM, the rollout-fidelity guard (``vllm_rollouts.py``); with
      ``masked_branch="rollout"`` (default) adds the masked branch of the round to the batch it returns
      (``MaskedBranch.rollout_entries``);
    - ``_get_grad_norm``: skips an optimizer step whose gradient norm is not finite (``step_guard.py``);
    - ``_save_rng_state`` / ``_load_rng_state``: also save and restore the masking generator.

    Collaborators hold the state: ``masks`` (``MaskState``: generator, per-round mask cache, patch size),
    ``masked_branch`` (``MaskedBranch``: plan, clock, owner tag, the skip at gamma 0), ``perception_record`` (per
    completion terms, for review) and ``step_guard``; ``probe`` is the one observer hook (``loss_observer.py``).

    Every log-prob forward runs through prefix sharing (``PrefixSharingMixin``, ``papo_nb/prefix_sharing/``: each
    prompt group packed once where supported and cheaper, ``"auto"`` by default); ``runs_as_grpo`` keeps TRL's own
    forwards where the run is GRPO (gamma 0, nothing reading the masked branch). Everything else (generation,
    rewards, advantages, reference KL, clipping, logging) is the parent's.

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
    assemble_loss = staticmethod(assemble_loss)

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
        with vllm_rollouts.cpu_server_client(args):  # vLLM's CPU platform in server mode: no NCCL communicator
            super().__init__(**parent_arguments)
        self.vllm_expansion = vllm_rollouts.install(self)  # with use_vllm: prompts vLLM expands once
        token_suppression.apply(self)  # with vLLM (by default): the trainer scores what generation samples from
        self.fidelity_guard = vllm_rollouts.RolloutFidelityGuard(
            self.args.vllm_fidelity_every, self.args.vllm_fidelity_logprob_tolerance, self._metrics["train"]
        )
        # the in-training probe when the config asks for it (refused here if the model is too large for it), else None
        self.probe = training_observer(self.args, self.model)
        # Trainer sets this in its training loop; the probe and fixed-batch losses may run before train().
        self.current_gradient_accumulation_steps = self.args.gradient_accumulation_steps
        self._captured_parent_logps = None  # a list while the parent's loss runs: its main forward's outputs
        self.masks = MaskState(self.args, self.model, self.processing_class)
        self.masked_branch = MaskedBranch(self.args, self.model, self.accelerator, self._metrics, self.temperature)
        self.forward_plan = forward_plan(self.args, self.masked_branch, self.prefix_sharing, self.model)
        logging.get_logger(__name__).info("PAPO-G forward plan: %s", self.forward_plan.describe())
        self.add_callback(ForwardPlanAtTrainStart(self))  # train() turns checkpointing on: the plan read again
        self.perception_record = PerceptionRecord(keep=self.args.generation_batch_size)
        self.step_guard = NonFiniteStepGuard(self.args.max_consecutive_nonfinite_grad_steps)

    def runs_as_grpo(self) -> bool:
        """Gamma 0 for the whole run and nothing reading the masked branch: prefix sharing's ``"auto"`` keeps TRL's
        own forwards, so the run costs and computes what GRPOTrainer does."""
        return nothing_reads_the_branch(self.args)

    # ---- the schedule (``schedule.py``), at this trainer's step ----
    def schedule_steps(self) -> int:
        """Total optimizer steps of the run: the Trainer's resolved ``state.max_steps`` (set from epochs too), else
        ``args.max_steps`` before train(); <= 0 when unknown."""
        return self.state.max_steps if self.state.max_steps > 0 else self.args.max_steps

    def loss_weights(self) -> LossWeights:
        """gamma_t, the discount and the effective entropy weights at this step, computed once per loss call."""
        return loss_weights(self.args, self.state.global_step, self.schedule_steps())

    def current_gamma(self) -> float:
        return self.loss_weights().gamma

    # ---- hooks ----
    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        capturing = self._captured_parent_logps == []  # the parent's main forward of a loss call, not a later one
        if not capturing:
            return self._logps_and_entropies(*args, **kwargs)
        entropy_grad = self.args.entropy_estimator == "full" and self.args.original_entropy_weight > 0
        self._captured_parent_logps.append(self._with_entropy_grad(entropy_grad, *args, **kwargs))
        return self._captured_parent_logps[0]

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:  # with use_vllm: stops a round sampled from other prompts or weights
            self.fidelity_guard.check(batch, self.vllm_expansion)
        self.perception_record.rollout, self.masks.rollout_masks = {}, {}
        batch[ROLLOUT_ROW_KEY] = torch.arange(len(batch["prompt_ids"]))  # the row in TRL's logs, after shuffling
        batch.update(self.masks.excluded_entries(inputs))  # mask_excluded_column: units no mask may cover
        if self.args.masked_branch == "rollout" and not self.masked_branch.skipped:
            batch.update(self.masked_branch.rollout_entries(batch, self.masked_pixel_values, self._with_entropy_grad))
        return batch

    def _get_grad_norm(self, model, grad_norm=None):
        norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        engine = model if self.is_deepspeed_enabled else None
        outcome = self.step_guard.check(self.state, model, norm, scaler=self.accelerator.scaler, engine=engine)
        if outcome != "finite":  # counted: skipped (gradients dropped) or an fp16 overflow the scaler skips
            self._metrics["train"].update(self.step_guard.metrics())
        return norm

    def _compute_loss(self, model, inputs):
        weights = self.loss_weights()
        parent_loss, terms = self.papo_loss_parts(model, inputs, weights)
        if self.probe is not None and self.probe.pending and self.model.training:
            self.probe.observe(self, model, parent_loss, terms, step=self.state.global_step)
            self._metrics["train"].update({f"probe/{k}": [v] for k, v in self.probe.metrics().items()})
        return self.assemble_loss(parent_loss, terms, weights.gamma, weights.eta1, weights.eta2)

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        self.masks.save(output_dir)

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        self.masks.load(checkpoint)

    # ---- pieces ----
    def _with_entropy_grad(self, want_grad: bool, *args, **kwargs):
        """Call the parent's log-prob method; with ``want_grad`` its entropies keep their graph."""
        gate = getattr(self, ENTROPY_GRAD_GATE)
        setattr(self, ENTROPY_GRAD_GATE, gate or (want_grad and torch.is_grad_enabled()))
        try:
            return self._logps_and_entropies(*args, **kwargs)
        finally:
            setattr(self, ENTROPY_GRAD_GATE, gate)

    def _logps_and_entropies(self, *args, **kwargs):
        """The parent's log-prob method through prefix sharing (``PrefixSharingMixin``), without the capture."""
        checked = self.prefix_sharing.checked
        outputs = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self.prefix_sharing.checked is not checked:  # "auto"'s first-batch check: the plan says its outcome
            refresh_forward_plan(self, "after prefix sharing's first-batch check")
        return outputs

    def papo_loss_parts(
        self, model, inputs, weights: LossWeights | None = None
    ) -> tuple[torch.Tensor, PerceptionTerms]:
        """The parent's loss and the adapter's terms for ``inputs`` (which is never modified); ``weights`` (this
        step's, computed now when None) are logged with the terms.

        The masked branch (``MaskedBranch.for_loss``: stored with the round, computed now, or skipped) runs *before*
        the parent's forward: under no-grad (the default) its full-vocabulary logits are freed before the parent's
        forward creates the logits autograd keeps for backward, so the two never coexist (same math in either
        order)."""
        masked = self.masked_branch.for_loss(model, inputs, self.masked_images, self._with_entropy_grad)
        self._captured_parent_logps = []
        try:
            parent_loss = super()._compute_loss(model, inputs)
            ((logps, entropies, _),) = self._captured_parent_logps
        finally:
            self._captured_parent_logps = None
        weights = self.loss_weights() if weights is None else weights
        return parent_loss, self._perception_terms(inputs, logps, entropies, masked, weights, parent_loss)

    def masked_forward(self, model, inputs):
        """The masked branch of ``inputs`` computed now (masking, then the forward), as the loss call runs it."""
        masked = self.masked_images(inputs) if inputs.get("pixel_values") is not None else None
        return self.masked_branch.compute(model, inputs, masked, self._with_entropy_grad)

    def masked_images(self, inputs: dict[str, Any]) -> MaskedImages:
        """``inputs``' images with this trainer's masks for the current generation round (in eval: no round)."""
        round_ = generation_round(self._step, self.args.steps_per_generation, self.num_iterations)
        return self.masks.masked_images(inputs, round_ if self.model.training else None)

    def masked_pixel_values(self, inputs: dict[str, Any]) -> torch.Tensor:
        """``pixel_values`` with this trainer's masks for the current generation round (in eval: no round)."""
        return self.masked_images(inputs).pixel_values

    @property
    def mask_generator(self) -> torch.Generator:
        return self.masks.generator

    def _perception_terms(self, inputs, logps, entropies, masked, weights, parent_loss=None) -> PerceptionTerms:
        """``masked``: the masked branch's ``(logps, entropies)``, or None where it is the original (``terms.py``);
        ``weights``: the loss call's ``LossWeights``, logged with the terms."""
        training = self.model.training
        normalise = functools.partial(
            normalise_like_parent,
            loss_type=self.loss_type,
            accumulation=self.current_gradient_accumulation_steps if training else 1.0,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
            training=training,
        )
        args = self.args
        terms, sums, rows = perception_terms(
            inputs, logps, entropies, masked, kl_clamp=args.perception_kl_clamp, estimator=args.entropy_estimator,
            normalise=normalise,
        )  # fmt: skip
        self.perception_record.add(inputs, rows)
        metrics = self._metrics["train" if training else "eval"]
        log_perception_metrics(
            metrics, self.accelerator, sums, terms.token_count, parent_loss, gamma=weights.gamma,
            discount=weights.discount, eta=(weights.eta1, weights.eta2),
            masked_measured=not self.masked_branch.skipped,
        )  # fmt: skip
        return terms
