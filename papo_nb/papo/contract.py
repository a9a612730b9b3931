"""What the PAPO-G adapter pins: the upstream source it ports and the TRL private API it calls.

- ``validate_trl_parent_contract(cls)``: the live GRPOTrainer class still has the private
  methods the adapter overrides and calls, with the parameters it passes.
- ``static_contract_violations(source)``: the same rules applied with ``ast`` to the text of
  ``trl/trainer/grpo_trainer.py`` of any TRL release, without importing it.
- ``validate_grad_norm_hook(cls)``: the Hugging Face Trainer still computes the gradient norm in the method the
  adapter overrides to skip a non-finite step, before the optimizer steps.

The rollout-time masked branch overrides ``_generate_and_score_completions``: the contract pins its signature, the
batch keys the override reads from what it returns, and that ``_prepare_inputs`` still buffers its result and serves
it by ``self._step % steps_per_generation`` (so the stored masked log-probs travel with the round as
``old_per_token_logps`` does). The masks' round (``mask_state.generation_round``) is TRL's cadence: the contract pins
that ``_prepare_inputs`` generates when ``self._step % (steps_per_generation * num_iterations) == 0`` and that
``training_step`` counts ``self._step`` up by one.

Prefix sharing (``prefix_sharing/sharing.py``) replaces the log-prob method's per-row forward by packed rows and the
round's shuffle by a whole-group one: the contract pins that every caller it serves passes ``[prompt_ids;
completion_ids]`` with ``logits_to_keep`` the completion width, that the method divides the logits by
``self.temperature``, and that ``_prepare_inputs`` shuffles the round with the module's ``shuffle_sequence_dict``
(looked up by name, so it can be swapped for the call) before cutting it into ``steps_per_generation`` device batches.

Releases: the contract accepts a TRL release by its facts, never by its number; the log-prob method's facts are
those of its form (``trl_seams.py``: the logits form 1.9.1-1.13.0, 1.14's variadic method, 1.15+'s fused LM head).
``SUPPORTED_TRL`` is the range the adapter tier runs on; a release whose facts break is refused at trainer construction
with the release, each broken fact and the newest supported release; one outside the range whose facts hold is logged
as untested.

The pinned upstream SHA-256 is that of the file inside the ``trl==0.29.1`` wheel on PyPI
(https://github.com/huggingface/trl/blob/v0.29.1/trl/experimental/papo/papo_trainer.py).
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

from transformers.utils import logging

from ..prefix_sharing import trl_seams

logger = logging.get_logger(__name__)

PAPO_ADAPTER_VERSION = "trl_0.29.1_papo_g_on_trl_1.9.1_v1"
PAPO_UPSTREAM_TRL_VERSION = "0.29.1"
PAPO_UPSTREAM_SOURCE_PATH = "trl/experimental/papo/papo_trainer.py"
PAPO_UPSTREAM_SOURCE_URL = "https://github.com/huggingface/trl/blob/v0.29.1/trl/experimental/papo/papo_trainer.py"
PAPO_UPSTREAM_SOURCE_SHA256 = "9836f4505f7026c90cd5ca5b97151dd14c1bc27bcd2bc5a8fca6626c68279175"

# A batch whose completion log-probs do not move when the image is masked (mean KL exactly 0)
# cannot show liveness; the probe defers on it. This many in a row means the masked forward
# never reaches the logits: a wiring bug, not bad luck.
PAPO_PROBE_MAX_DEGENERATE_BATCHES = 20

PARENT_GRPO_FILE = "trl/trainer/grpo_trainer.py"
PARENT_CLASS = "GRPOTrainer"
LOSS_METHOD = "_compute_loss"
LOSS_PARAMETERS = ("self", "model", "inputs")
LOGP_METHOD = "_get_per_token_logps_and_entropies"
# The spec's audited parameters of the log-prob method.
LOGP_REQUIRED_PARAMETERS = frozenset(
    {
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "spatial_shapes",
        "image_position_ids",
    }
)
# Every keyword the adapter's masked forward passes on, as the parent's own call does.
VLM_FORWARD_KEYWORDS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
ROLLOUT_METHOD = "_generate_and_score_completions"
ROLLOUT_PARAMETERS = ("self", "inputs")
# What the rollout-time masked branch reads from the parent's returned batch (the VLM keys too, where present).
ROLLOUT_RETURNED_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask") + VLM_FORWARD_KEYWORDS
PREPARE_METHOD = "_prepare_inputs"
BUFFER_ATTRIBUTE = "_buffered_inputs"
TRAINING_STEP_METHOD = "training_step"
# The loss calls one generation round serves, and the device batch of the round a loss call gets, as TRL writes them.
ROUND_LENGTH = "self.args.steps_per_generation * self.num_iterations"
BUFFER_INDEX = "self._buffered_inputs[self._step % self.args.steps_per_generation]"
STEP_COUNT = "self._step += 1"
# The Trainer method whose result decides whether the optimizer steps (transformers 5.x Trainer._run_epoch).
GRAD_NORM_METHOD = "_get_grad_norm"
GRAD_NORM_PARAMETERS = ("self", "model", "grad_norm")
# The adapter flips this attribute around the parent's entropy computation to get entropies with gradient (TRL
# computes them under no_grad otherwise on the logits forms; trl_seams.py pins where it is read, per form).
ENTROPY_GRAD_GATE = trl_seams.ENTROPY_GRAD_GATE
# What prefix sharing relies on, as TRL writes it: the callers' rows and kept logits, the shuffle (and the temperature,
# trl_seams.LOGITS_TEMPERATURE).
PACKED_CALLERS = {
    LOSS_METHOD: (
        "input_ids = torch.cat([prompt_ids, completion_ids], dim=1)",
        "logits_to_keep = completion_ids.size(1)",
    ),
    ROLLOUT_METHOD: (
        "prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)",
        "logits_to_keep = completion_ids.size(1)",
    ),
}
PARENT_SHUFFLE_FUNCTION = trl_seams.PARENT_SHUFFLE_FUNCTION
ROUND_SHUFFLE = (
    "generation_batch = shuffle_sequence_dict(generation_batch)",
    "generation_batches = split_tensor_dict(generation_batch, self.args.steps_per_generation)",
)


# The TRL releases the adapter tier runs on (1.9.1 in .venv, the newest in CI's second virtualenv; .ci/run): the
# contract accepts a release by its facts, and a rejected one is told this range.
SUPPORTED_TRL = ("1.9.1", "1.16.0")
# The parent methods the contract reads: the loss, the log-prob method and its 1.14 delegate, the generation round,
# its buffer and cadence, and __init__ (where 1.15+ patches the fused head).
PARSED_METHODS = (
    LOSS_METHOD,
    LOGP_METHOD,
    trl_seams.FULL_LOGITS_METHOD,
    ROLLOUT_METHOD,
    PREPARE_METHOD,
    TRAINING_STEP_METHOD,
    trl_seams.INIT_METHOD,
)


class ContractError(RuntimeError):
    """TRL's private API no longer matches what the adapter was audited against."""


def contract_violations(loss_parameters: tuple[str, ...], methods: dict[str, ast.FunctionDef | None]) -> list[str]:
    """The contract's rules, shared by the live (inspect) and static (ast) checks; ``methods``: the parent's parsed
    methods by name (``PARSED_METHODS``). The log-prob method's facts are its form's (``trl_seams.py``)."""
    prepare, training_step = methods.get(PREPARE_METHOD), methods.get(TRAINING_STEP_METHOD)
    problems = rollout_violations(methods.get(ROLLOUT_METHOD), prepare) + cadence_violations(prepare, training_step)
    if tuple(loss_parameters) != LOSS_PARAMETERS:
        problems.append(
            f"{PARENT_CLASS}.{LOSS_METHOD} signature changed: {tuple(loss_parameters)} != {LOSS_PARAMETERS}"
        )
    seam = trl_seams.seam_of(methods)
    named_by = methods.get(seam.signature_method)
    if named_by is not None:
        missing = sorted((LOGP_REQUIRED_PARAMETERS | set(VLM_FORWARD_KEYWORDS)) - set(_arg_names(named_by)))
        for name in missing:
            problems.append(f"{PARENT_CLASS}.{seam.signature_method} has no parameter {name!r}")
    return problems + trl_seams.seam_violations(seam, methods, PARENT_CLASS)


def returned_keys(function: ast.FunctionDef) -> set[str]:
    """The string keys of the dict the function builds as ``output`` (a literal and ``output[KEY] = ...``)."""
    keys = set()
    for node in ast.walk(function):
        assigns_output = isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "output" for t in node.targets
        )
        if assigns_output and isinstance(node.value, ast.Dict):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        stores_output = (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "output"
            and isinstance(node.ctx, ast.Store)
        )
        if stores_output and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name)) and name in ast.unparse(n.func)
        for n in ast.walk(node)
    )


def rollout_violations(rollout: ast.FunctionDef | None, prepare: ast.FunctionDef | None) -> list[str]:
    """What the rollout-time masked branch relies on in the parent's generation round."""
    if rollout is None or prepare is None:
        return [
            f"{PARENT_CLASS} has no method {m}"
            for m, f in ((ROLLOUT_METHOD, rollout), (PREPARE_METHOD, prepare))
            if f is None
        ]
    problems = []
    if tuple(_arg_names(rollout)) != ROLLOUT_PARAMETERS:
        problems.append(
            f"{PARENT_CLASS}.{ROLLOUT_METHOD} signature changed: {tuple(_arg_names(rollout))} != {ROLLOUT_PARAMETERS}"
        )
    missing = [key for key in ROLLOUT_RETURNED_KEYS if key not in returned_keys(rollout)]
    for key in missing:
        problems.append(f"{PARENT_CLASS}.{ROLLOUT_METHOD} no longer returns {key!r}")
    serves = any(ast.unparse(node) == BUFFER_INDEX for node in ast.walk(prepare))
    if not (_calls(prepare, ROLLOUT_METHOD) and _assigns_attribute(prepare, BUFFER_ATTRIBUTE) and serves):
        problems.append(
            f"{PARENT_CLASS}.{PREPARE_METHOD} no longer buffers the result of {ROLLOUT_METHOD} in "
            f"self.{BUFFER_ATTRIBUTE} and serves it as {BUFFER_INDEX}"
        )
    return problems


def cadence_violations(prepare: ast.FunctionDef | None, training_step: ast.FunctionDef | None) -> list[str]:
    """The generation round's cadence the masks share: a new round when ``self._step % (ROUND_LENGTH) == 0``, and
    ``self._step`` counted up by one per loss call."""
    if prepare is None or training_step is None:
        return [] if prepare is None else [f"{PARENT_CLASS} has no method {TRAINING_STEP_METHOD}"]
    names = {
        target.id
        for node in ast.walk(prepare)
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == ROUND_LENGTH
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    starts = {f"self._step % {name} == 0" for name in names} | {f"self._step % ({ROUND_LENGTH}) == 0"}
    regenerates = any(
        isinstance(node, ast.If)
        and _calls(node, ROLLOUT_METHOD)
        and any(ast.unparse(c) in starts for c in ast.walk(node.test))
        for node in ast.walk(prepare)
    )
    problems = []
    if not regenerates:
        problems.append(
            f"{PARENT_CLASS}.{PREPARE_METHOD} no longer starts a generation round when self._step % "
            f"({ROUND_LENGTH}) == 0: the masks' generation_round would not be TRL's"
        )
    if not any(ast.unparse(node) == STEP_COUNT for node in ast.walk(training_step)):
        problems.append(f"{PARENT_CLASS}.{TRAINING_STEP_METHOD} no longer counts {STEP_COUNT}")
    return problems


def prefix_sharing_violations(methods: dict[str, ast.FunctionDef | None]) -> list[str]:
    """What prefix sharing relies on (``PACKED_CALLERS``, ``ROUND_SHUFFLE``; the temperature is the log-prob form's
    fact) in the parsed methods by name, on a form where it runs; a missing method is another rule's to name."""
    if not trl_seams.seam_of(methods).packed_paths:
        return []  # prefix sharing falls back to the parent's method there (trl_seams.packed_path_reason)
    problems = []
    for name, statements in [*PACKED_CALLERS.items(), (PREPARE_METHOD, ROUND_SHUFFLE)]:
        method = methods.get(name)
        if method is None:
            continue
        written = {ast.unparse(node) for node in ast.walk(method) if isinstance(node, ast.stmt)}
        for statement in statements:
            if statement not in written:
                problems.append(f"{PARENT_CLASS}.{name} no longer runs `{statement}` (prefix sharing relies on it)")
    return problems


def _assigns_attribute(node: ast.AST, attribute: str) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == attribute and isinstance(n.ctx, ast.Store) for n in ast.walk(node)
    )


def _violations_of(methods: dict[str, ast.FunctionDef | None]) -> list[str]:
    missing = [f"{PARENT_CLASS} has no method {m}" for m in (LOSS_METHOD, LOGP_METHOD) if methods.get(m) is None]
    if missing:
        return missing
    loss_parameters = tuple(_arg_names(methods[LOSS_METHOD]))
    return contract_violations(loss_parameters, methods) + prefix_sharing_violations(methods)


def live_contract_violations(grpo_trainer_class: Any) -> list[str]:
    """The contract on the installed (or given) class, its methods read with ``inspect``."""
    return _violations_of({name: trl_seams.parsed_method(grpo_trainer_class, name) for name in PARSED_METHODS})


def validate_grad_norm_hook(trainer_class: Any) -> None:
    """Raise ContractError unless ``trainer_class`` computes the gradient norm in ``_get_grad_norm(model,
    grad_norm)`` and its training loop calls it before ``optimizer.step()``."""
    import transformers

    method = getattr(trainer_class, GRAD_NORM_METHOD, None)
    problems = []
    if method is None:
        problems.append(f"{trainer_class.__name__} has no method {GRAD_NORM_METHOD}")
    elif tuple(inspect.signature(method).parameters) != GRAD_NORM_PARAMETERS:
        problems.append(
            f"{trainer_class.__name__}.{GRAD_NORM_METHOD} signature changed: "
            f"{tuple(inspect.signature(method).parameters)} != {GRAD_NORM_PARAMETERS}"
        )
    loop = inspect.getsource(transformers.Trainer._run_epoch)
    call, step = loop.find(f"self.{GRAD_NORM_METHOD}("), loop.find("self.optimizer.step()")
    if not 0 <= call < step:
        problems.append(f"Trainer._run_epoch no longer calls {GRAD_NORM_METHOD} before optimizer.step()")
    if problems:
        raise ContractError("transformers Trainer contract broken:\n- " + "\n- ".join(problems))


def supported_release(version: str) -> bool:
    """Whether ``version`` lies in the range the adapter tier has been run on (``SUPPORTED_TRL``); a pre-release or
    local build counts as its release."""
    return release_key(SUPPORTED_TRL[0]) <= release_key(version) <= release_key(SUPPORTED_TRL[1])


def release_key(version: str) -> tuple[int, ...]:
    """``"1.14.2"`` as ``(1, 14, 2)``: the leading numeric parts of a version string."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def validate_trl_parent_contract(grpo_trainer_class: Any, trl_version: str | None = None) -> None:
    """Raise ContractError naming the TRL release, every broken fact of the parent's private API and the newest
    supported release; a release outside ``SUPPORTED_TRL`` whose facts all hold is logged as untested."""
    if trl_version is None:
        import trl

        trl_version = trl.__version__
    problems = live_contract_violations(grpo_trainer_class)
    if problems:
        raise ContractError(
            f"TRL {trl_version} is not supported by the PAPO-G adapter: its private API no longer holds what the "
            f"adapter relies on:\n- " + "\n- ".join(problems) + f"\nNewest supported release: trl=={SUPPORTED_TRL[1]} "
            f"(supported: {SUPPORTED_TRL[0]} to {SUPPORTED_TRL[1]}; pip install 'trl=={SUPPORTED_TRL[1]}')"
        )
    if not supported_release(trl_version):
        logger.warning(
            "TRL %s is outside the releases the PAPO-G adapter was tested on (%s to %s): its contract holds, but run "
            "the gamma-zero probe (require_gpu_contract_probe=True) before trusting a run",
            trl_version,
            *SUPPORTED_TRL,
        )


def _arg_names(function: ast.FunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]


def source_methods(grpo_trainer_source: str) -> dict[str, ast.FunctionDef] | None:
    """The parent class's parsed methods by name in the text of ``grpo_trainer.py``, or None without the class."""
    tree = ast.parse(grpo_trainer_source)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == PARENT_CLASS]
    if not classes:
        return None
    return {n.name: n for n in classes[0].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def static_contract_violations(grpo_trainer_source: str) -> list[str]:
    """Apply the contract to the text of ``grpo_trainer.py`` without importing it."""
    methods = source_methods(grpo_trainer_source)
    return [f"no class {PARENT_CLASS} in the source"] if methods is None else _violations_of(methods)
