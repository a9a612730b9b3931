"""The arguments of the parent's ``_get_per_token_logps_and_entropies`` for a ``_compute_loss`` batch."""

from __future__ import annotations

from typing import Any

import torch

from .contract import VLM_FORWARD_KEYWORDS


def logp_call_arguments(inputs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``(input_ids, attention_mask, logits_to_keep)`` and the VLM keywords for ``_get_per_token_logps_and_entropies``
    on a ``_compute_loss`` batch, built as the parent builds them."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return (input_ids, attention_mask, inputs["completion_ids"].size(1)), {
        key: inputs.get(key) for key in VLM_FORWARD_KEYWORDS
    }
