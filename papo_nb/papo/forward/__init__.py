"""How each forward runs, in the order a loss call meets it.

- ``masked_branch.py``: the masked forward's timing (once per round, ``rollout_branch.py``; or per loss call) and its
  log-probs for the terms;
- ``prefill.py``: the no-grad masked branch with each prompt prefilled once (a key/value cache per prompt);
- ``prefix_sharing.py``: every log-prob forward TRL routes through ``_get_per_token_logps_and_entropies`` with each
  prompt group packed once (``packed_rows.py``), its attention grouped (``grouped_attention.py``; on CUDA by default
  one FlexAttention call with a block mask, ``flex_grouped.py``), its cost checked (``attention_cost.py``), its needed
  positions scored as the installed TRL scores them (``packed_head.py``: logits, 1.14's variadic method, 1.15+'s
  fused LM head) and, under ``prefix_sharing="auto"``, its first call checked against the plain forward
  (``self_check.py``);
- ``logp_inputs.py``: the parent's log-prob call arguments for a loss batch;
- ``common.py``: what both prefix paths need (model families, the model under its wrappers, rotary positions, the
  one chunker of whole groups).
"""
