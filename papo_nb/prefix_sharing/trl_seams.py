"""The per-release seam: where TRL releases differ inside the log-prob method the adapter leans on, named.

Every TRL release from 1.9.1 to 1.16.0 keeps ``_compute_loss(self, model, inputs)`` and the batch keys it reads; what
moves is the inside of ``GRPOTrainer._get_per_token_logps_and_entropies``, through which the parent's forwards and the
adapter's masked branch run. Three forms exist, told apart by what the method does (never by a version number):

- ``logits`` (1.9.1-1.13.0): explicit parameters; ``model(**inputs).logits`` divided by ``self.temperature``
  (in place up to 1.9.2, ``logits = logits / self.temperature`` from 1.10.0: the same numbers), entropies under
  no-grad unless ``self._entropy_bonus_enabled``
  (https://github.com/huggingface/trl/blob/v1.9.1/trl/trainer/grpo_trainer.py#L1435-L1545).
- ``variadic`` (1.14.x): ``(self, model, *args, batch_size=None, compute_aux_loss=False, **kwargs)`` dispatching to
  ``_full_logits_logps`` (the explicit parameters, temperature and row mask inside ``selective_log_softmax``) or
  ``_chunked_logps`` (``use_liger_kernel``, which the adapter refuses); the arguments are named by
  ``_full_logits_logps``'s signature (https://github.com/huggingface/trl/blob/v1.14.2/trl/trainer/grpo_trainer.py).
- ``fused`` (1.15.0+): explicit parameters again; ``__init__`` patches the policy with
  ``add_fused_lm_head(temperature=..., outputs=("log_probs", "entropy"))`` and the method calls
  ``model(**inputs, labels=..., fused_lm_head=True)`` and reads ``outputs.log_probs`` / ``outputs.entropy``: no
  logits exist, temperature is applied inside the model, and the kernel's entropies keep their graph whatever
  ``_entropy_bonus_enabled`` says (huggingface/trl#7077).

The adapter's masked branch calls the parent's method, so it takes TRL's own path on every form (the fused one on
1.15+). Prefix sharing computes each form's numbers from its packed rows (``packed_head.py``: logits divided
by the temperature, 1.14's ``selective_log_softmax(..., temperature=)``, 1.15+'s fused head called with
``shift_labels`` on the packed rows' needed positions); the shared prompt prefix (``papo/prefill.py``) builds
logits as 1.9.1 does and falls back to the parent's method on the other forms, with one log line that says why
(``prefill_reason``). ``contract.py`` pins each form's facts (``seam_violations``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

LOGP_METHOD = "_get_per_token_logps_and_entropies"
FULL_LOGITS_METHOD = "_full_logits_logps"
INIT_METHOD = "__init__"
ENTROPY_GRAD_GATE = "_entropy_bonus_enabled"
# The module function _prepare_inputs shuffles a generation round with, looked up by name in its module.
PARENT_SHUFFLE_FUNCTION = "shuffle_sequence_dict"
FUSED_KEYWORD = "fused_lm_head"
FUSED_PATCH = "add_fused_lm_head"
FUSED_OUTPUTS = ("log_probs", "entropy")
# The fused head's keyword for labels scored as given (no shift): prefix sharing's packed rows name their positions.
FUSED_UNSHIFTED_LABELS = "shift_labels"
# What prefix sharing relies on inside add_fused_lm_head's patched forward, as TRL 1.15+ writes it: the backbone is
# the model's ``base_model`` (transformers 5) called with the forward's arguments, and with ``shift_labels`` its last
# hidden state is scored against them unshifted, so a hook on the backbone can gather the needed positions.
# TRL 1.15+ opens the accelerator's autocast around the model call inside the log-prob method itself (1.9.1 leaves it
# to accelerate's wrapper of the prepared model, which a call outside ``train()`` does not pass through): a packed
# forward that skipped it would compute in float32 beside a parent computing in bf16 (issue: 1.2e-3 apart).
LOGP_AUTOCAST = "self.accelerator.autocast()"
FUSED_HEAD_STATEMENTS = (
    "backbone_attr = 'base_model'",
    "backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)",
    "hidden_states = backbone_outputs.last_hidden_state",
    "labels = shift_labels",
)


@dataclass(frozen=True)
class LogpSeam:
    """One form of the parent's log-prob method: ``signature_method`` names its parameters; ``packed_paths`` says
    whether prefix sharing reproduces its numbers (``packed_head.py``), ``prefill_path`` whether the shared
    prompt prefix does; ``summary`` is the form in a user's words."""

    name: str
    signature_method: str
    packed_paths: bool
    summary: str
    prefill_path: bool = False


LOGITS = LogpSeam(
    "logits", LOGP_METHOD, True, "log-probs from the model's logits divided by the temperature (as 1.9.1)", True
)
VARIADIC = LogpSeam(
    "variadic",
    FULL_LOGITS_METHOD,
    True,
    f"{LOGP_METHOD}(model, *args, **kwargs) dispatches to {FULL_LOGITS_METHOD} (temperature inside "
    "selective_log_softmax)",
)
FUSED = LogpSeam(
    "fused",
    LOGP_METHOD,
    True,
    "fused LM head: the model returns log-probs and entropies, no logits (temperature inside the model)",
)
SEAMS = (LOGITS, VARIADIC, FUSED)
# The two statements TRL has used to divide the logits by the temperature on the logits form (same numbers).
LOGITS_TEMPERATURE = ("logits.div_(self.temperature)", "logits = logits / self.temperature")


def _calls_with_keyword(node: ast.AST, keyword: str) -> bool:
    return any(
        isinstance(n, ast.Call)
        and any(k.arg == keyword and isinstance(k.value, ast.Constant) and k.value.value is True for k in n.keywords)
        for n in ast.walk(node)
    )


def _calls_method(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == f"self.{name}" for n in ast.walk(node))


def seam_of(methods: dict[str, ast.FunctionDef | None]) -> LogpSeam:
    """The form of the parsed log-prob method (``methods``: the parent's parsed methods by name)."""
    logp = methods.get(LOGP_METHOD)
    if logp is not None and _calls_with_keyword(logp, FUSED_KEYWORD):
        return FUSED
    if logp is not None and logp.args.vararg is not None and _calls_method(logp, FULL_LOGITS_METHOD):
        return VARIADIC
    return LOGITS


def _reads_attribute(node: ast.AST | None, attribute: str) -> bool:
    return node is not None and any(isinstance(n, ast.Attribute) and n.attr == attribute for n in ast.walk(node))


def _statements(node: ast.AST | None) -> set[str]:
    return {ast.unparse(n) for n in ast.walk(node) if isinstance(n, ast.stmt)} if node is not None else set()


def seam_violations(seam: LogpSeam, methods: dict[str, ast.FunctionDef | None], parent: str) -> list[str]:
    """The facts of ``seam`` the adapter relies on that the parsed methods no longer hold, in words."""
    logp, full = methods.get(LOGP_METHOD), methods.get(FULL_LOGITS_METHOD)
    problems = []
    if seam is VARIADIC:
        if full is None:
            return [f"{parent} has no method {FULL_LOGITS_METHOD} for {LOGP_METHOD}(*args, **kwargs) to reach"]
        if logp.args.kwarg is None:
            problems.append(f"{parent}.{LOGP_METHOD} no longer forwards **kwargs to {FULL_LOGITS_METHOD}")
    if seam is FUSED:
        init = methods.get(INIT_METHOD)
        patches = init is not None and any(
            isinstance(n, ast.Call) and ast.unparse(n.func) == FUSED_PATCH and str(FUSED_OUTPUTS) in ast.unparse(n)
            for n in ast.walk(init)
        )
        if not patches:
            problems.append(
                f"{parent}.__init__ no longer patches the policy with {FUSED_PATCH}(..., outputs={FUSED_OUTPUTS}): "
                "the masked branch's entropies would not exist"
            )
        read = {ast.unparse(n) for n in ast.walk(logp) if isinstance(n, ast.Attribute)}
        for field in FUSED_OUTPUTS:
            if f"outputs.{field}" not in read:
                problems.append(f"{parent}.{LOGP_METHOD} no longer reads outputs.{field} from the fused head")
    elif not _reads_attribute(full if seam is VARIADIC else logp, ENTROPY_GRAD_GATE):
        problems.append(f"{parent}.{seam.signature_method} no longer reads self.{ENTROPY_GRAD_GATE}")
    if seam is LOGITS and not _statements(logp) & set(LOGITS_TEMPERATURE):
        problems.append(
            f"{parent}.{LOGP_METHOD} no longer divides its logits by self.temperature as "
            f"`{LOGITS_TEMPERATURE[0]}` or `{LOGITS_TEMPERATURE[1]}` (prefix sharing relies on it)"
        )
    return problems


def fused_head_violations(patch: ast.FunctionDef | None) -> list[str]:
    """The facts of the parsed ``add_fused_lm_head`` prefix sharing relies on (``FUSED_HEAD_STATEMENTS``, the
    patched forward's ``shift_labels`` keyword) that it no longer holds, in words."""
    if patch is None:
        return [f"TRL has no {FUSED_PATCH} where GRPOTrainer's module imports it"]
    inner = [n for n in ast.walk(patch) if isinstance(n, ast.FunctionDef) and n is not patch]
    problems = []
    if not any(FUSED_UNSHIFTED_LABELS in [a.arg for a in f.args.kwonlyargs] for f in inner):
        problems.append(f"{FUSED_PATCH}'s patched forward no longer takes {FUSED_UNSHIFTED_LABELS}=")
    written = _statements(patch)
    problems += [f"{FUSED_PATCH} no longer runs `{s}` (prefix sharing relies on it)" for s in FUSED_HEAD_STATEMENTS
                 if s not in written]  # fmt: skip
    return problems


@functools.cache
def installed_fused_head_violations(parent_class: type) -> tuple[str, ...]:
    """``fused_head_violations`` of the ``add_fused_lm_head`` that ``parent_class``'s module calls."""
    patch = getattr(inspect.getmodule(parent_class), FUSED_PATCH, None)
    parsed = None if patch is None else ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(patch)))).body[0]
    return tuple(fused_head_violations(parsed))


def parsed_method(cls: Any, name: str) -> ast.FunctionDef | None:
    """``cls.name`` parsed (unwrapped from TRL's profiling decorator), or None where the class has no such method."""
    method = getattr(cls, name, None)
    if method is None:
        return None
    method = inspect.unwrap(method)
    return ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]


@functools.cache
def live_seam(parent_class: type) -> LogpSeam:
    """The form of the installed parent's log-prob method."""
    return seam_of({name: parsed_method(parent_class, name) for name in (LOGP_METHOD, FULL_LOGITS_METHOD)})


@functools.cache
def opens_autocast(parent_class: type) -> bool:
    """Whether the installed parent's log-prob method (or the method it dispatches to) runs its model call inside
    ``LOGP_AUTOCAST``."""
    methods = (parsed_method(parent_class, name) for name in (LOGP_METHOD, FULL_LOGITS_METHOD))
    return any(
        isinstance(node, ast.With) and any(ast.unparse(item.context_expr) == LOGP_AUTOCAST for item in node.items)
        for method in methods
        if method is not None
        for node in ast.walk(method)
    )


def parent_forward_context(parent_class: type, accelerator):
    """The context the parent's log-prob method runs its model call in, for a forward that must compute as it does:
    the accelerator's autocast where the installed release opens it (``opens_autocast``), else none."""
    return accelerator.autocast if opens_autocast(parent_class) else contextlib.nullcontext


def signature_method(parent_class: type):
    """The function whose parameters name the arguments of a log-prob call on this release."""
    return getattr(parent_class, live_seam(parent_class).signature_method)


def installed_seam(parent_class: type | None = None) -> LogpSeam:
    """The form of the installed (or given) parent's log-prob method."""
    if parent_class is None:
        from trl import GRPOTrainer as parent_class
    return live_seam(parent_class)


def packed_path_reason(parent_class: type | None = None) -> str | None:
    """Why prefix sharing cannot run on the installed TRL, or None (it runs on every form, ``packed_paths``)."""
    return _release_reason(installed_seam(parent_class), "packed_paths")


def prefill_reason(parent_class: type | None = None) -> str | None:
    """Why the shared prompt prefix (the no-grad masked branch, ``papo/prefill.py``) cannot run on the installed
    TRL, or None."""
    return _release_reason(installed_seam(parent_class), "prefill_path")


def _release_reason(seam: LogpSeam, path: str) -> str | None:
    if getattr(seam, path):
        return None
    import trl

    return (
        f"TRL {trl.__version__}'s log-prob method is the {seam.name!r} form ({seam.summary}); this path builds "
        "logits as 1.9.1 does and would not reproduce its numbers, so the parent's own forward runs instead"
    )
