"""The grouped attention through FlexAttention (``torch.nn.attention.flex_attention``): the whole flat packed row
``[p1; c11 ... c1g; p2; ...]`` in one call with a block mask, in place of ``grouped_attention.py``'s batched SDPA
calls (``PAPOGConfig.grouped_attention_kernel``).

The mask is the grouped layout's, position by position: query ``q`` sees key ``k <= q`` of its own group where ``k``
is its group's prompt or its own segment (the prompt causal over itself; each completion over its prompt and
causally over itself; never another completion or group). Since the row is ``[prompt; completions]`` per group,
``k <= q`` within the prompt segment is the whole prompt for a completion's query. The block mask skips every
128 x 128 block no query of it may see (other groups, other completions, the upper triangle), which is what the
stacked and split SDPA forms approximate with their batching; it is built once per packed forward and shared by
every layer (and by a checkpointed layer's recomputation).

Where it runs (torch 2.14.1): on CUDA, forward and backward, compiled (``torch.compile(flex_attention)``, the fused
kernel); on the CPU, the forward only, compiled in fp32/fp16/bf16 (inductor's CPU lowering refuses fp64) and eager
in fp64: torch has no FlexAttention backward on the CPU (``_validate_device`` raises for inputs that require grad),
so a gradient forward on the CPU runs the SDPA calls, with the reason logged once. ``"auto"`` takes it on CUDA only.
"""

from __future__ import annotations

import functools

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

KERNELS = ("auto", "sdpa", "flex")  # PAPOGConfig.grouped_attention_kernel
FLEX = "flex"
SDPA = "sdpa"
# inductor's CPU lowering of flex_attention takes these; any other dtype runs flex eagerly on the CPU
CPU_COMPILED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CUDA_MIN_HEAD_DIM = 16  # inductor's CUDA kernel: "NYI: embedding dimension ... must be at least 16"

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - the pinned torch has it
    create_block_mask = flex_attention = None

_logged: set[str] = set()


def unavailable_reason() -> str | None:
    """Why this torch has no FlexAttention, or None."""
    if flex_attention is None:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def sdpa_reason(request: str, device: torch.device, grad: bool, dropout: float, head_dim: int) -> str | None:
    """Why a packed forward asked for ``request`` (``KERNELS``) runs the SDPA calls rather than FlexAttention on
    ``device`` (``grad``: the forward records a graph; ``dropout`` and ``head_dim``: the text model's attention
    dropout and head width), or None (FlexAttention runs)."""
    if request == SDPA:
        return "grouped_attention_kernel='sdpa'"
    if request == "auto" and device.type != "cuda":
        return f"grouped_attention_kernel='auto' on {device.type} (FlexAttention is taken on CUDA)"
    reason = unavailable_reason()
    if reason is None and device.type == "cpu" and grad:
        reason = f"torch {torch.__version__} has no FlexAttention backward on the CPU (this forward records gradients)"
    if reason is None and device.type == "cuda" and head_dim < CUDA_MIN_HEAD_DIM:
        reason = f"head dimension {head_dim} (FlexAttention's CUDA kernel needs at least {CUDA_MIN_HEAD_DIM})"
    if reason is None and dropout:
        reason = f"attention dropout {dropout} (FlexAttention has no dropout)"
    if reason is None and device.type not in ("cuda", "cpu"):
        reason = f"FlexAttention is not run on {device.type} here"
    return reason


def choose(request: str, device: torch.device, grad: bool, dropout: float, head_dim: int) -> str:
    """The kernel a packed forward runs (``FLEX`` or ``SDPA``); where flex was asked for (``"flex"``, or ``"auto"``
    on CUDA) and cannot run, the reason is logged once (a warning for ``"flex"``, an info line for ``"auto"``)."""
    if request not in KERNELS:
        raise ValueError(f"grouped_attention_kernel={request!r} is invalid; allowed: one of {KERNELS}")
    reason = sdpa_reason(request, device, grad, dropout, head_dim)
    if reason is None:
        return FLEX
    if request != SDPA and reason not in _logged and (request == FLEX or device.type == "cuda"):
        _logged.add(reason)
        log = logger.warning if request == FLEX else logger.info
        log("PAPO-G grouped attention: the SDPA calls run in place of FlexAttention, because %s", reason)
    return SDPA


def description(request: str, device: torch.device, inner: str, head_dim: int) -> str:
    """What a packed forward asked for ``request`` runs on ``device`` (``inner``: the text model's own
    implementation, which the batched calls run), for the forward plan."""
    if sdpa_reason(request, device, grad=False, dropout=0.0, head_dim=head_dim) is not None:
        return repr(inner)
    if device.type == "cpu":
        return f"FlexAttention's block mask in no-grad forwards, {inner!r} in gradient forwards (no CPU backward)"
    return f"FlexAttention's block mask (grouped_attention_kernel={request!r})"


def head_dim_of(config) -> int:
    """The text model's attention head width (``head_dim``, else hidden size over heads, as Qwen-VL reads it)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def block_mask(token_groups: torch.Tensor, segments: torch.Tensor):
    """The block mask of a flat row from each position's group and segment (0 its group's prompt, k its k-th
    completion), as ``grouped_attention.build_layout`` reads them."""
    width = len(token_groups)

    def grouped_mask(batch, head, query, key):
        same_group = token_groups[query] == token_groups[key]
        own_or_prompt = (segments[key] == 0) | (segments[key] == segments[query])
        return same_group & own_or_prompt & (key <= query)

    device = token_groups.device
    return create_block_mask(grouped_mask, None, None, width, width, device=device, _compile=device.type == "cuda")


def compiled_here(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FlexAttention runs compiled on ``device`` in ``dtype`` (else eagerly: the CPU in fp64)."""
    return device.type != "cpu" or dtype in CPU_COMPILED_DTYPES


@functools.cache
def _compiled():
    return torch.compile(flex_attention)


def attention(query, key, value, mask, scaling):
    """``(1, W, heads, d)``: the flat row's queries ``(1, heads, W, d)`` over its keys and values ``(1, kv heads, W,
    d)`` under ``mask`` (``block_mask``), grouped-query heads shared as the model's repeat would share them."""
    function = _compiled() if compiled_here(query.device, query.dtype) else flex_attention
    output = function(query, key, value, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous()
