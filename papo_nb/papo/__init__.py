"""PAPO-G (Perception-Aware Policy Optimization, arXiv 2507.06448) on TRL's ``GRPOTrainer`` (1.9.1-1.16.0), for VLMs.

The core, read first:

- ``papo_config.py``: ``PAPOGConfig``, the ``GRPOConfig`` fields PAPO-G adds, each documented.
- ``papo_trainer.py``: ``PAPOGTrainer``, the parent's loss plus the perception KL and the double entropy.
- ``terms.py``: the per-token maths (bounded k3 KL, the parent's reductions).
- ``layouts.py``: every image layout TRL passes to the forward, detected, and the real patches of a batch;
  ``masking.py``: the units drawn and blacked out; ``prompt_identity.py``: which rows are one prompt.
- ``forward/``: how each forward runs. ``masked_branch.py`` (with ``rollout_branch.py``): the masked forward, once
  per round or per loss call, skipped when the perception term is off for the whole run; ``prefill.py``: the no-grad
  masked branch with each prompt prefilled once; ``prefix_sharing.py`` (with ``packed_rows.py``,
  ``grouped_attention.py``, ``attention_cost.py``, ``self_check.py``): every log-prob forward with each prompt group
  packed once (on by default where supported, its first call checked against the plain forward);
  ``logp_inputs.py``: the parent's log-prob call arguments; ``common.py``: what both prefix paths need.

Set apart: ``contract.py`` (the TRL private API the trainer checks at construction, and the releases it
supports), ``trl_seams.py`` (the per-release seam: the three forms of TRL's log-prob method, 1.9.1's logits, 1.14's
variadic method, 1.15+'s fused LM head), ``recipes.py`` (the official recipes as presets).

Beside the core, never imported by it: ``probe/``, the gamma-zero probe (its verdicts, measurements, projection test,
roundoff, FSDP2 reductions and the spec's tolerances). The trainer reaches it through one observer hook
(``loss_observer.py``), and a copy of this folder without ``probe/`` trains as well.

The folder imports only the standard library, torch, transformers, trl and peft, and itself by relative imports,
so it lifts into another project by copying it.
"""

from .papo_config import PAPOGConfig
from .papo_trainer import PAPOGTrainer

__all__ = ["PAPOGConfig", "PAPOGTrainer"]
