"""Qwen-VL models compute two things in float32 whatever the model's dtype: the text model's RMSNorm
(``hidden_states.to(float32)``) and the vision tower's rotary embedding (``q.float(), k.float()``), in transformers
5.24's ``modeling_qwen2_vl``, ``modeling_qwen2_5_vl`` and ``modeling_qwen3_vl``.

In a float64 model those islands round to float32 in the backward. A packed forward sums a shared prompt's gradient
over its completions before an island and the plain forward after it, so the two differ by float32 roundoff (6.2e-8
of the largest gradient, measured on the tiny Qwen2-VL) though their forward values agree to the bit. With the
islands computed in the model's own dtype (the same formulas, no cast) they agree to 5.4e-16: float64 roundoff. An
exactness test of a float64 model lifts them, so that a real error anywhere above 1e-12 shows."""

import torch
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen3_vl import modeling_qwen3_vl

# Each family's module and its text RMSNorm class.
ISLANDS = (
    (modeling_qwen2_vl, modeling_qwen2_vl.Qwen2VLRMSNorm),
    (modeling_qwen2_5_vl, modeling_qwen2_5_vl.Qwen2_5_VLRMSNorm),
    (modeling_qwen3_vl, modeling_qwen3_vl.Qwen3VLTextRMSNorm),
)


def rms_norm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def vision_rotary_in_input_dtype(q, k, cos, sin):
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    rotate = modeling_qwen2_vl.rotate_half  # the same half rotation in every family's module
    return (q * cos) + (rotate(q) * sin), (k * cos) + (rotate(k) * sin)


def lift_float32_islands(monkeypatch) -> None:
    """The float32 islands in the model's dtype for the rest of the test (``monkeypatch`` undoes it)."""
    for module, rms_norm in ISLANDS:
        monkeypatch.setattr(rms_norm, "forward", rms_norm_in_input_dtype)
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", vision_rotary_in_input_dtype)
