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
1.15+). The two paths that call the model themselves and build logits (the shared prompt prefix, prefix sharing)
reproduce the ``logits`` form's numbers only; on the others they fall back to the parent's method, with one log line
that says why (``packed_path_reason``). ``contract.py`` pins each form's facts (``seam_violations``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

LOGP_METHOD = "_get_per_token_logps_and_entropies"
FULL_LOGITS_METHOD = "_full_logits_logps"
INIT_METHOD = "__init__"
ENTROPY_GRAD_GATE = "_entropy_bonus_enabled"
FUSED_KEYWORD = "fused_lm_head"
FUSED_PATCH = "add_fused_lm_head"
FUSED_OUTPUTS = ("log_probs", "entropy")


@dataclass(frozen=True)
class LogpSeam:
    """One form of the parent's log-prob method: ``signature_method`` names its parameters; ``packed_paths`` says
    whether the adapter's own logits paths (shared prefix, prefix sharing) reproduce its numbers; ``summary`` is the
    form in a user's words."""

    name: str
    signature_method: str
    packed_paths: bool
    summary: str


LOGITS = LogpSeam(
    "logits", LOGP_METHOD, True, "log-probs from the model's logits divided by the temperature (as 1.9.1)"
)
VARIADIC = LogpSeam(
    "variadic",
    FULL_LOGITS_METHOD,
    False,
    f"{LOGP_METHOD}(model, *args, **kwargs) dispatches to {FULL_LOGITS_METHOD} (temperature inside "
    "selective_log_softmax)",
)
FUSED = LogpSeam(
    "fused",
    LOGP_METHOD,
    False,
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


def signature_method(parent_class: type):
    """The function whose parameters name the arguments of a log-prob call on this release."""
    return getattr(parent_class, live_seam(parent_class).signature_method)


def packed_path_reason(parent_class: type | None = None) -> str | None:
    """Why the adapter's own logits paths (shared prefix, prefix sharing) cannot run on the installed TRL, or None."""
    if parent_class is None:
        from trl import GRPOTrainer as parent_class
    seam = live_seam(parent_class)
    if seam.packed_paths:
        return None
    import trl

    return (
        f"TRL {trl.__version__}'s log-prob method is the {seam.name!r} form ({seam.summary}); this path builds "
        "logits as 1.9.1 does and would not reproduce its numbers, so the parent's own forward runs instead"
    )
