"""Prefix sharing's configuration: every GRPOConfig field plus the two that turn it on and pick its kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from .flex_grouped import KERNELS as GROUPED_ATTENTION_KERNELS

AUTO_OR_BOOL = ("auto", True, False)

# name -> (rule, what is allowed); subclasses' tables extend it, and a params schema can be read off it.
SHARING_FIELD_RULES = {
    "prefix_sharing": (lambda v: v == "auto" or isinstance(v, bool), f"one of {AUTO_OR_BOOL}"),
    "grouped_attention_kernel": (lambda v: v in GROUPED_ATTENTION_KERNELS, f"one of {GROUPED_ATTENTION_KERNELS}"),
}


def field_problem(rules: dict, name: str, value: Any) -> str | None:
    """What is wrong with ``value`` for field ``name`` of a ``name -> (rule, what is allowed)`` table (the allowed
    values), or None when it is valid."""
    rule, allowed = rules[name]
    return None if rule(value) else f"expected {allowed}"


def check_field_rules(config: Any, rules: dict, owner: str) -> None:
    """Raise ValueError naming ``owner``'s field, its value and what is allowed, for the first field of ``rules``
    that ``config`` breaks. ``owner`` is the class whose table it is, not ``type(config)``: a subclass breaking a
    parent's rule is told so under the parent's name."""
    for name in rules:
        value = getattr(config, name)
        problem = field_problem(rules, name, value)
        if problem:
            raise ValueError(f"{owner}.{name}={value!r} is invalid: {problem}")


def sharing_fields_problem(args) -> str | None:
    """What is wrong with ``args``' prefix sharing against its batch shape (``"auto"`` is off there instead), naming
    the fields it joins with their values and what is allowed, or None."""
    batch, generations = args.per_device_train_batch_size, args.num_generations
    if args.prefix_sharing is True and generations and batch % generations:
        return (
            f"prefix_sharing=True is invalid with per_device_train_batch_size={batch} and num_generations="
            f"{generations}: the round is shuffled by whole prompt groups, so a device batch must hold whole "
            "groups; allowed: per_device_train_batch_size a multiple of num_generations, or prefix_sharing "
            "'auto' (off for such a batch) or False"
        )
    return None


@dataclass
class PrefixSharingConfig(GRPOConfig):
    r"""Configuration for a [`~trl.GRPOTrainer`] with [`PrefixSharingMixin`]: every [`~trl.GRPOConfig`] field, plus:

    Parameters:
        prefix_sharing (`str` or `bool`, defaults to `"auto"`):
            Pack each prompt group once, `[prompt; c1 ... cG]`, in every forward TRL routes through its log-prob
            method (the gradient forward and backward, old and reference log-probs), with grouped attention, and
            shuffle the round by whole groups. `"auto"`: on where supported and predicted cheaper, its first packed
            call checked against the plain forward (off for the run on a mismatch); `True`: forced (a device batch
            must hold whole groups); `False`: TRL's forward and shuffle, bit for bit. Supported models, releases and
            the checks: [docs/prefix_sharing.md](../../docs/prefix_sharing.md).
        grouped_attention_kernel (`str`, defaults to `"auto"`):
            The grouped attention's kernel: `"flex"` (one FlexAttention call with a block mask), `"sdpa"` (the text
            model's own attention in batched calls) or `"auto"` (flex on CUDA, SDPA elsewhere).
    """

    prefix_sharing: str | bool = field(
        default="auto",
        metadata={"help": "Each prompt group packed once in every log-prob forward.", "choices": AUTO_OR_BOOL},
    )
    grouped_attention_kernel: str = field(
        default="auto",
        metadata={
            "help": "Prefix sharing's grouped attention: 'flex' (FlexAttention block mask), 'sdpa' (batched calls) "
            "or 'auto' (flex on CUDA).",
            "choices": GROUPED_ATTENTION_KERNELS,
        },
    )

    def __post_init__(self):
        check_field_rules(self, SHARING_FIELD_RULES, "PrefixSharingConfig")
        problem = sharing_fields_problem(self)
        if problem is not None:
            raise ValueError(f"PrefixSharingConfig.{problem}")
        super().__post_init__()
