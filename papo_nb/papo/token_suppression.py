"""One distribution for the sampler and the trainer: the tokens generation suppresses are suppressed in the trainer's
log-probs too.

Generation bans the vision placeholder tokens (HF ``suppress_tokens``; vLLM ``logit_bias`` -inf in colocate mode,
``bad_words`` in server mode), which renormalises the sampling distribution over the allowed tokens, while the
trainer's log-probs are over the whole vocabulary: every sampled token's log-prob is then lower in the trainer by
log(1 - P(banned tokens)), a steady gap that TRL's importance-sampling ratio reads as off-policy sampling (measured on
the tiny model: 0.014 nats per token, ratio about 0.8 over 16 tokens). With ``trainer_token_suppression`` the LM head
gets a bias of ``SUPPRESSED_LOGIT`` on those tokens, as a non-persistent buffer: every forward of the policy (and of
a separate reference model) then scores the distribution generation samples from, on each of TRL's forward forms
(logits through the head, and 1.15+'s fused head, which reads ``lm_head.bias``: ``trl/trainer/utils.py``
``add_fused_lm_head``). The buffer is neither a parameter nor in the state dict: nothing is saved, trained, or sent to
vLLM.
"""

from __future__ import annotations

import torch

# Finite: exp(-1e4) is exactly 0 in fp32 and bf16, while -inf would turn p * log p into NaN in the entropies.
SUPPRESSED_LOGIT = -1.0e4


def suppressed_token_ids(generation_kwargs: dict | None, tokenizer) -> list[int]:
    """The token ids ``generation_kwargs`` bans, in each engine's spelling (builder.generation_kwargs)."""
    kwargs = generation_kwargs or {}
    ids = set(kwargs.get("suppress_tokens") or [])
    ids |= {int(token) for token, bias in (kwargs.get("logit_bias") or {}).items() if bias == float("-inf")}
    words = kwargs.get("bad_words") or []
    if words:
        ids |= set(tokenizer.convert_tokens_to_ids(words))
    return sorted(ids)


def suppress_in_head(model, token_ids: list[int]) -> None:
    """Give ``model``'s LM head the bias that bans ``token_ids`` (a no-op without ids)."""
    head = model.get_output_embeddings()
    if not token_ids or head is None:
        return
    if isinstance(head.bias, torch.nn.Parameter):
        raise ValueError("trainer_token_suppression needs an LM head without a bias of its own; set it to False")
    bias = torch.zeros(head.weight.shape[0], dtype=head.weight.dtype, device=head.weight.device)
    bias[token_ids] = SUPPRESSED_LOGIT
    del head.bias
    head.register_buffer("bias", bias, persistent=False)


def apply(trainer) -> None:
    """``trainer_token_suppression`` on ``trainer``'s policy and separate reference model ("auto": with vLLM)."""
    setting = trainer.args.trainer_token_suppression
    if not (setting is True or (setting == "auto" and trainer.args.use_vllm)):
        return
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    banned = suppressed_token_ids(trainer.args.generation_kwargs, tokenizer)
    for policy in (trainer.model, trainer.ref_model):
        if policy is not None:
            suppress_in_head(policy, banned)
