"""Prefix sharing for TRL's GRPOTrainer: each prompt group packed once, ``[prompt; c1 ... cG]``, in every log-prob
forward (the gradient forward and backward, old and reference log-probs), with grouped attention, so the prompt and
its images run once per group instead of G times. Same numbers as the plain forward; a feature of any GRPO trainer.

- ``config.py``: ``PrefixSharingConfig``, GRPOConfig plus ``prefix_sharing`` and ``grouped_attention_kernel``.
- ``trainer.py``: ``PrefixSharingMixin``, the one hook a ``GRPOTrainer`` subclass mixes in.
- ``sharing.py``: ``PrefixSharing``, the per-trainer choice (supported, cheaper, first batch checked) and the packed
  call; ``packed_rows.py`` builds the rows, ``grouped_attention.py`` (``flex_grouped.py``, ``layout_mask.py``) runs
  each completion over its prompt and itself, ``packed_head.py`` scores the needed positions as the installed TRL
  does, ``attention_cost.py`` is the FLOP model, ``self_check.py`` the first-batch comparison, ``ranks.py`` several
  processes.
- What it stands on, shared with the methods built over it: ``trl_seams.py`` (each TRL release's log-prob method
  form), ``prompt_identity.py`` (which rows are one prompt), ``image_rows.py`` (each sample's image rows),
  ``common.py`` (model families, the model under its wrappers, rotary positions), ``fsdp.py``.

The folder imports only the standard library, torch, transformers and trl, by relative imports, so it lifts into
another project by copying it; ``papo_nb/papo/`` builds on it.
"""

from .config import PrefixSharingConfig
from .trainer import PrefixSharingMixin

__all__ = ["PrefixSharingConfig", "PrefixSharingMixin"]
