"""PAPO-G (Perception-Aware Policy Optimization, arXiv 2507.06448) on TRL's ``GRPOTrainer`` (1.9.1-1.16.0), for VLMs.

Read first:

- ``papo_config.py``: ``PAPOGConfig``, the fields PAPO-G adds to ``GRPOConfig``, each with its default and the official
  value.
- ``papo_trainer.py``: ``PAPOGTrainer``, the parent's loss plus the perception KL and the double entropy.
- ``terms.py``: the per-token maths (bounded k3 KL, the parent's reductions); ``schedule.py``: gamma_t and the
  discount of the entropy terms.
- ``masking.py``: the units drawn and blacked out, on ``layouts.py``'s map of a batch's real patches (every image
  layout TRL passes), one mask per prompt and round (``mask_state.py``).
- ``masked_branch.py``: the forward on masked images, once per round (``rollout_branch.py``, the official timing) or
  per loss call, skipped when nothing reads it; ``prefill.py``: its no-grad form with each prompt prefilled once.

Set apart: ``contract.py`` (the TRL private API the trainer checks at construction, and the releases it supports),
``forward_plan.py`` (what each forward of a run does, logged once), ``vllm_rollouts.py`` and ``token_suppression.py``
(vLLM rollouts scored as sampled), ``step_guard.py``, ``recipes.py`` (the official recipes as presets).

Built on ``papo_nb/prefix_sharing/`` (each prompt group packed once in every log-prob forward, a feature of any GRPO
trainer, mixed into ``PAPOGTrainer``): lift the two folders together, as siblings in one package. Beside the core,
never imported by it: ``probe/``, the gamma-zero probe, reached through one observer hook (``loss_observer.py``); a
copy without ``probe/`` trains as well.

The folder imports only the standard library, torch, transformers, trl and peft, and by relative imports itself and
its sibling ``prefix_sharing``.
"""

from .papo_config import PAPOGConfig
from .papo_trainer import PAPOGTrainer

__all__ = ["PAPOGConfig", "PAPOGTrainer"]
