"""Prefix sharing on any GRPOTrainer: the mixin that routes TRL's log-prob forward through packed prompt groups."""

from __future__ import annotations

import functools
import inspect

from trl import GRPOTrainer

from . import sharing, trl_seams
from .config import SHARING_FIELD_RULES


class PrefixSharingMixin:
    """Prefix sharing for a [`~trl.GRPOTrainer`] subclass: list it before the trainer in the bases, with a
    [`PrefixSharingConfig`] (or a config carrying its two fields).

    ```python
    class SharedGRPOTrainer(PrefixSharingMixin, GRPOTrainer):
        pass

    trainer = SharedGRPOTrainer(model=..., reward_funcs=..., args=PrefixSharingConfig(...), train_dataset=...)
    ```

    What changes against the parent:

    - ``_get_per_token_logps_and_entropies``: each call runs its prompt groups as packed rows (``sharing.py``) where
      the call and model allow it, the parent's method where not, with the same numbers;
    - ``_generate_and_score_completions``: tags each row with its block of G rows of one prompt;
    - ``_prepare_inputs``: the parent's, its round shuffled by whole blocks (TRL's draw, whole groups kept).

    ``runs_as_grpo`` is the one thing a subclass decides: True where its run is GRPO's in numbers and should keep
    TRL's own forwards under ``"auto"`` (PAPO-G at gamma 0 with nothing reading the masked branch)."""

    def __init__(self, *args, **kwargs):
        config = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments.get("args")
        if not all(hasattr(config, name) for name in SHARING_FIELD_RULES):  # before the parent loads any model
            raise TypeError(
                f"{type(self).__name__} needs args=PrefixSharingConfig(...) (or a config with the fields "
                f"{', '.join(SHARING_FIELD_RULES)}), got {type(config).__name__}"
            )
        super().__init__(*args, **kwargs)
        self.prefix_sharing = sharing.PrefixSharing(
            self.args,
            self.model,
            self.accelerator.num_processes,
            self._metrics,
            trl_seams.parent_forward_context(GRPOTrainer, self.accelerator),
            grpo_run=self.runs_as_grpo(),
        )

    def runs_as_grpo(self) -> bool:
        """Whether ``"auto"`` should keep TRL's own forwards because the run is GRPO as configured: never here."""
        return False

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        plain_forward = functools.partial(super()._get_per_token_logps_and_entropies, *args, **kwargs)
        if self.prefix_sharing.enabled:
            arguments = sharing.bound_arguments(trl_seams.signature_method(GRPOTrainer), self, args, kwargs)
            packed = self.prefix_sharing.compute(
                arguments.pop("model"),
                arguments,
                temperature=self.temperature,
                entropy_grad=bool(getattr(self, trl_seams.ENTROPY_GRAD_GATE)),
                training=self.model.training,
                plain_forward=plain_forward,
            )
            if packed is not None:
                return packed
        return plain_forward()

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.prefix_sharing.shuffles_whole_groups and self.model.training:
            batch[sharing.BLOCK_KEY] = sharing.block_ids(batch, self.num_generations)
        return batch

    def _prepare_inputs(self, generation_batch):
        if not self.prefix_sharing.shuffles_whole_groups:
            return super()._prepare_inputs(generation_batch)
        with sharing.whole_block_shuffle(GRPOTrainer):
            return super()._prepare_inputs(generation_batch)
