"""The log-probs and entropies of a packed batch's needed positions, as the installed TRL's log-prob method computes
them (its form: ``trl_seams.py``), so that prefix sharing reproduces the release's plain forward.

- ``logits`` (1.9.1-1.13): the model's logits at the needed positions (``logits_to_keep`` the list of them), divided
  by the temperature in place, ``selective_log_softmax`` and ``entropy_from_logits``, entropies under no-grad unless
  the parent's entropy gate is open.
- ``variadic`` (1.14): the same logits, the temperature inside ``selective_log_softmax(..., temperature=)`` and, with
  entropies, ``selective_log_softmax_and_entropy(..., entropy_requires_grad=gate, temperature=)``, as
  ``_full_logits_logps`` calls them (https://github.com/huggingface/trl/blob/v1.14.2/trl/trainer/grpo_trainer.py).
- ``fused`` (1.15+): no logits. The policy carries the head ``GRPOTrainer.__init__`` installed
  (``add_fused_lm_head(temperature=..., outputs=("log_probs", "entropy"))``); the packed row goes through it, a
  forward hook on the backbone keeping its last hidden state at the needed positions only (repeats included), with
  ``shift_labels`` (labels scored as given, no shift) their targets, so TRL's own tiled kernel projects exactly those
  hidden states onto the vocabulary, on every device, and no ``(rows, tokens, vocab)`` tensor exists (TRL's plain
  fused forward scores every position off Triton devices). Its entropies keep their graph, as the parent's do on
  this form. What this relies on inside ``add_fused_lm_head`` is pinned (``trl_seams.FUSED_HEAD_STATEMENTS``).

``LOGIT_ROWS`` rows of logits at a time on the logits forms: the log-softmax temporaries stay as small as the
parent's per-sequence loop keeps them.
"""

from __future__ import annotations

import inspect

import torch

from . import trl_seams
from .common import core_model

LOGIT_ROWS = 256  # vocabulary-sized rows per log-softmax call


def release_reason(model) -> str | None:
    """Why ``model`` cannot take the packed path on the installed form (1.15+: a fused head whose facts changed,
    ``trl_seams.FUSED_HEAD_STATEMENTS``, or the policy without the head ``GRPOTrainer.__init__`` installs), or None."""
    from trl import GRPOTrainer

    if trl_seams.installed_seam(GRPOTrainer) is not trl_seams.FUSED:
        return None
    changed = trl_seams.installed_fused_head_violations(GRPOTrainer)
    if changed:
        return f"TRL's fused LM head changed ({'; '.join(changed)}), so the parent's own forward runs instead"
    forward = core_model(model).forward
    parameters = inspect.signature(forward, follow_wrapped=False).parameters
    if trl_seams.FUSED_KEYWORD in parameters and trl_seams.FUSED_UNSHIFTED_LABELS in parameters:
        return None
    return (
        f"{type(core_model(model)).__name__}.forward has no {trl_seams.FUSED_KEYWORD}= / "
        f"{trl_seams.FUSED_UNSHIFTED_LABELS}= (TRL's {trl_seams.FUSED_PATCH} is not installed on it)"
    )


def logps_and_entropies(model, model_inputs: dict, targets: torch.Tensor, *, temperature: float,
                        compute_entropy: bool, entropy_grad: bool):  # fmt: skip
    """``(logps, entropies or None)`` at the packed row's needed positions (``model_inputs["logits_to_keep"]``, in
    its order; ``targets`` the token each predicts), computed as the installed release's log-prob method computes
    them. Runs the model: call it inside the batch's grouped attention."""
    seam = trl_seams.installed_seam()
    if seam is trl_seams.FUSED:
        return _fused(model, model_inputs, targets, compute_entropy)
    picked = model(**model_inputs, use_cache=False).logits[0]  # the needed positions only
    if seam is trl_seams.VARIADIC:
        return _variadic(picked, targets, temperature, compute_entropy, entropy_grad)
    return _logits(picked, targets, temperature, compute_entropy, entropy_grad)


def _logits(picked, targets, temperature: float, compute_entropy: bool, entropy_grad: bool):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    picked.div_(temperature)  # in place, as the parent divides its logits
    logps = torch.cat(
        [
            selective_log_softmax(rows[None], chosen[None])[0]
            for rows, chosen in zip(picked.split(LOGIT_ROWS), targets.split(LOGIT_ROWS), strict=True)
        ]
    )
    entropies = None
    if compute_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = entropy_from_logits(picked)
    return logps, entropies


def _variadic(picked, targets, temperature: float, compute_entropy: bool, entropy_grad: bool):
    from trl.trainer import utils

    chunks = list(zip(picked.split(LOGIT_ROWS), targets.split(LOGIT_ROWS), strict=True))
    if not compute_entropy:
        logps = [
            utils.selective_log_softmax(rows[None], chosen[None], temperature=temperature) for rows, chosen in chunks
        ]
        return torch.cat(logps, dim=1)[0], None
    both = [
        utils.selective_log_softmax_and_entropy(
            rows[None], chosen[None], entropy_requires_grad=entropy_grad, temperature=temperature
        )
        for rows, chosen in chunks
    ]
    return torch.cat([logps for logps, _ in both], dim=1)[0], torch.cat([ent for _, ent in both], dim=1)[0]


def _fused(model, model_inputs: dict, targets: torch.Tensor, compute_entropy: bool):
    inputs = dict(model_inputs)
    positions = inputs.pop("logits_to_keep")
    hf_model = core_model(model)
    # The prompt's last position predicts every completion's first token, so a position can carry several targets:
    # the backbone's hidden states are gathered at the needed positions (repeats included) before TRL's head scores
    # them, each against its own target, as labels given unshifted.
    hook = hf_model.base_model.register_forward_hook(lambda _module, _args, output: _at(output, positions))
    try:
        outputs = model(**inputs, **{trl_seams.FUSED_UNSHIFTED_LABELS: targets[None], trl_seams.FUSED_KEYWORD: True})
    finally:
        hook.remove()
    if compute_entropy and outputs.entropy is None:
        raise ValueError(
            f"compute_entropy=True but the fused head of {type(hf_model).__name__} computes no entropy: allowed: "
            f"a head installed with {trl_seams.FUSED_PATCH}(..., outputs={trl_seams.FUSED_OUTPUTS})"
        )
    return outputs.log_probs[0], outputs.entropy[0] if compute_entropy else None


def _at(backbone_output, positions: torch.Tensor):
    """The backbone's output with its last hidden state at ``positions`` of the packed row only."""
    backbone_output.last_hidden_state = backbone_output.last_hidden_state[:, positions]
    return backbone_output
