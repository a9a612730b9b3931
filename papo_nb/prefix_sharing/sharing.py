"""Prefix sharing (``PrefixSharingConfig.prefix_sharing``): every forward TRL routes through
``_get_per_token_logps_and_entropies`` runs each prompt group as one packed row (``packed_rows.py``), and the round's
shuffle keeps whole groups so that a micro-batch holds them.

TRL 1.9.1 calls that one method for the policy's gradient forward (``_compute_loss``), the old log-probs and the
reference log-probs (``_generate_and_score_completions``); the adapter's masked branch calls it too where it takes the
full forward. Each call arrives as ``input_ids = [prompt_ids; completion_ids]`` with ``logits_to_keep`` the completion
width (pinned in ``contract.py``); log-probs are TRL's (logits / temperature, ``selective_log_softmax``,
``entropy_from_logits``) at the same positions, scattered back into the call's row order. The vision tower sees each
group's images once. Where a call or model is not supported the plain path runs, with one log line per reason.

The shuffle: TRL shuffles a round row by row before cutting it into ``steps_per_generation`` micro-batches
(``_prepare_inputs``), which at G = 5 leaves about 1.8 completions per prompt in a micro-batch. With sharing on,
``_generate_and_score_completions`` tags each row with its block (``BLOCK_KEY``: G rows of one prompt) and the
round is shuffled block by block (``shuffle_whole_blocks``) in place of TRL's ``shuffle_sequence_dict``, so a
micro-batch of a multiple of G rows holds whole groups. With several processes each rank does so with the whole
groups it holds (``ranks.py``: why a rank's round is whole groups, and where the plain path runs instead).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from transformers.utils import logging

from . import attention_cost, flex_grouped, packed_head, ranks, self_check
from .common import core_model, model_unsupported_reason, whole_group_chunks
from .grouped_attention import checkpointing_description, checkpointing_reason, grouped_attention
from .grouped_attention import text_config as grouped_text_config
from .grouped_attention import unsupported_reason as grouped_unsupported_reason
from .packed_rows import PackedBatch, completion_lengths, forward_positions, pack
from .prompt_identity import group_samples
from .trl_seams import PARENT_SHUFFLE_FUNCTION

logger = logging.get_logger(__name__)

METRIC = "papo/prefix_shared"  # per log-prob call: 1 packed, 0 plain
SHARE_METRIC = "papo/prefix_share"  # completions per packed prompt
COST_METRIC = "papo/prefix_cost_ratio"  # per call: predicted packed / plain forward FLOPs (above 1: plain runs)
BLOCK_KEY = "papo_prefix_block"  # per row: its block of G rows of one prompt, for the whole-group shuffle
# Keywords of layouts other than Qwen-VL's flattened patch rows: a call that carries one runs the plain path.
OTHER_LAYOUT_KEYWORDS = (
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "image_position_ids",
)


def unsupported_reason(model, processes: int, args=None) -> str | None:
    """Why this model (in a run of ``processes``, with ``args`` when given) cannot take the packed path, or None."""
    reason = model_unsupported_reason(model) or grouped_unsupported_reason(core_model(model))
    if reason is not None:
        return reason
    reason = ranks.several_processes_reason(args, processes)
    if reason is not None:
        return reason
    if args is not None and args.loss_type == "luspo" and args.beta != 0.0:
        # TRL 1.9.1's luspo aggregation averages the KL over every completion column, those after the end of a
        # completion included; the packed path does not compute those positions.
        return f"loss_type='luspo' with beta={args.beta} (its aggregation reads the KL after each completion's end)"
    return None


def call_reason(arguments: dict[str, Any]) -> str | None:
    """Why one log-prob call runs the plain path, or None (``arguments``: the parent's parameters by name)."""
    if arguments.get("compute_aux_loss"):
        return "compute_aux_loss=True (a mixture-of-experts load-balancing loss)"
    other = [key for key in OTHER_LAYOUT_KEYWORDS if arguments.get(key) is not None]
    if other:
        return f"the batch carries {other}: not Qwen-VL's patch-row layout"
    if arguments.get("pixel_values") is not None and arguments.get("image_grid_thw") is None:
        return "pixel_values without image_grid_thw"
    if arguments.get("image_grid_thw") is not None and arguments.get("mm_token_type_ids") is None:
        # The plain forward decides: Qwen2-VL refuses it, Qwen2.5-VL runs without multimodal rotary positions.
        return "image_grid_thw without mm_token_type_ids (the plain forward's own refusal or positions apply)"
    if completion_lengths(arguments["attention_mask"], arguments["logits_to_keep"]) is None:
        return "a completion mask with a gap, or a prompt that does not end in a real token"
    return None


def packed_batches(model, arguments: dict[str, Any]) -> Iterator[PackedBatch]:
    """The packed rows of a log-prob call (``arguments``: the parent's parameters by name, ``call_reason`` None),
    one ``PackedBatch`` per chunk of whole groups of at most ``batch_size`` rows (a larger group alone)."""
    input_ids, attention_mask = arguments["input_ids"], arguments["attention_mask"]
    n_completion = arguments["logits_to_keep"]
    pixel_values, grid = arguments.get("pixel_values"), arguments.get("image_grid_thw")
    grid = grid if pixel_values is not None else None
    mm_types, num_images = arguments.get("mm_token_type_ids"), arguments.get("num_images")
    n_prompt = input_ids.shape[1] - n_completion
    prompts = {"prompt_ids": input_ids[:, :n_prompt], "prompt_mask": attention_mask[:, :n_prompt]}
    groups = group_samples({**prompts, "pixel_values": pixel_values, "image_grid_thw": grid, "num_images": num_images})
    positions = forward_positions(core_model(model), input_ids, attention_mask, mm_types, grid)
    lengths = completion_lengths(attention_mask, n_completion)
    limit = max(arguments.get("batch_size") or len(input_ids), max(map(len, groups)))
    for chunk in whole_group_chunks(groups, limit):
        yield pack(
            input_ids, attention_mask, positions, n_completion, lengths, chunk,
            mm_token_type_ids=mm_types, pixel_values=pixel_values, image_grid_thw=grid, num_images=num_images,
        )  # fmt: skip


def shared_flops(widths: attention_cost.TextWidths, batch: PackedBatch) -> float:
    """The text model's forward FLOPs over one packed batch (its grouped attention's pairs included)."""
    return attention_cost.grouped(widths, batch.segments.shape[1], batch.layout.pairs)


def predicted_cost_ratio(model, arguments: dict[str, Any], batches: list[PackedBatch]) -> float:
    """The FLOP model's shared / plain forward cost of a log-prob call (``attention_cost``: the text decoder, the
    vocabulary head on the needed positions and the vision tower on the call's images): never above 1 with grouped
    attention, the guard's check that it stays so."""
    hf_model = core_model(model)
    widths = attention_cost.TextWidths.of(grouped_text_config(hf_model))
    vision_config = getattr(hf_model.config, "vision_config", None)
    vision = None if vision_config is None else attention_cost.VisionWidths.of(vision_config)
    rows, width = arguments["input_ids"].shape
    padded = not bool(arguments["attention_mask"].all())
    plain = attention_cost.plain(widths, rows, width, padded=padded) + attention_cost.call_flops(
        widths, vision, rows * arguments["logits_to_keep"], arguments.get("image_grid_thw")
    )
    shared = sum(
        shared_flops(widths, batch)
        + attention_cost.call_flops(widths, vision, len(batch.targets), batch.model_inputs.get("image_grid_thw"))
        for batch in batches
    )
    return shared / plain


def packed_logps_and_entropies(
    model,
    arguments: dict[str, Any],
    *,
    temperature: float,
    entropy_grad: bool,
    batches: list[PackedBatch] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, None, float]:
    """``(logps, entropies or None, None, completions per packed prompt)`` of a log-prob call (``arguments``: the
    parent's parameters by name, ``call_reason`` None), each ``(B, logits_to_keep)`` in the call's row order;
    entropies keep their graph when ``entropy_grad``, as the parent's do under its entropy gate; ``batches``: the
    call's ``packed_batches`` where already built."""
    n_rows, compute_entropy = len(arguments["input_ids"]), bool(arguments.get("compute_entropy"))
    logps = entropies = None
    packed_groups = 0
    for batch in packed_batches(model, arguments) if batches is None else batches:
        chunk_logps, chunk_entropies = logps_of_packed(
            model, batch, temperature=temperature, compute_entropy=compute_entropy, entropy_grad=entropy_grad
        )
        if logps is None:
            logps = chunk_logps.new_zeros((n_rows, arguments["logits_to_keep"]))
            entropies = logps.new_zeros(logps.shape) if compute_entropy else None
        logps = logps.index_put((batch.rows, batch.columns), chunk_logps)
        if compute_entropy:
            entropies = entropies.index_put((batch.rows, batch.columns), chunk_entropies)
        packed_groups += batch.layout.groups
    return logps, entropies, None, n_rows / packed_groups


def logps_of_packed(model, batch: PackedBatch, *, temperature: float, compute_entropy: bool, entropy_grad: bool):
    """``(logps, entropies or None)`` of the needed positions of one packed batch, one value per ``batch.rows``, as
    the installed release computes them (``packed_head.py``: logits, 1.14's variadic method, 1.15+'s fused head)."""
    with grouped_attention(core_model(model), batch.layout):
        return packed_head.logps_and_entropies(
            model, batch.model_inputs, batch.targets,
            temperature=temperature, compute_entropy=compute_entropy, entropy_grad=entropy_grad,
        )  # fmt: skip


def bound_arguments(parent_method, trainer, args, kwargs) -> dict[str, Any]:
    """The parent log-prob method's parameters by name for one call (defaults filled in), ``self`` dropped."""
    bound = inspect.signature(parent_method).bind(trainer, *args, **kwargs)
    bound.apply_defaults()
    return dict(list(bound.arguments.items())[1:])


class PrefixSharing:
    """One per trainer: the static choice (``reason`` None: packed where a call allows it), the choice against the
    model as each forward finds it (``reason_now``: its checkpointing, which ``Trainer.train`` turns on after
    construction), the per-call choice, its metric and one log line per reason. ``metrics``: the trainer's per-mode
    metric lists.

    ``args.prefix_sharing``: ``True`` forces it (each reason it cannot run is a warning); ``"auto"`` takes it where
    it is supported and predicted cheaper, and not in a run that is GRPO (``grpo_run``: gamma 0 and nothing reads
    the masked branch, where the parent's own forwards keep gamma 0 GRPO at GRPO's cost), each reason it is off an
    info line, and checks its first packed call against the plain forward (``self_check.py``): on a mismatch it is
    off for the run, with one warning naming the difference and its place; ``False`` never takes it.
    ``forward_context``: the context the parent's log-prob method opens around its model call, which the packed
    forward opens too."""

    def __init__(self, args, model, processes: int, metrics: dict, forward_context=contextlib.nullcontext, *,
                 grpo_run: bool = False):  # fmt: skip
        self.mode = args.prefix_sharing
        self.processes = processes
        self.kernel = args.grouped_attention_kernel  # the grouped attention's kernel (flex_grouped.py)
        # the context the parent's log-prob method opens around its model call (trl_seams.parent_forward_context):
        # the packed forward computes in the same precision, or it would differ from the parent by more than roundoff
        self.forward_context = forward_context
        self.enabled = self.mode is not False
        self.reason = None if self.enabled else "prefix_sharing=False"
        if self.enabled:
            self.reason = auto_reason(args, grpo_run) if self.mode == "auto" else None
            self.reason = self.reason or unsupported_reason(model, processes, args)
        self.paired_device = None  # where a sharded model's forwards pair across ranks (``ranks.py``), per call
        self.checked: self_check.SelfCheck | None = None  # "auto": the first packed call's comparison, once made
        self.metrics = metrics
        self.logged: set[tuple[bool, str]] = set()
        self.shuffles_whole_groups = self.enabled and self.reason is None  # for the run: a later "off" keeps it
        if self.enabled and self.reason is not None:
            self.note(False, self.reason)

    @property
    def label(self) -> str:
        return f"prefix_sharing={self.mode!r}"

    def reason_now(self, model) -> str | None:
        """Why ``model`` as it is now cannot take the packed path (the static reason first), or None."""
        return self.reason or checkpointing_reason(core_model(model)) or packed_head.release_reason(model)

    def supported_description(self, model) -> str:
        """What the packed path runs with on ``model`` now (``reason_now`` None), and under ``"auto"`` what its
        first-batch check found."""
        hf_model = core_model(model)
        config = grouped_text_config(hf_model)
        inner, device = config._attn_implementation, next(hf_model.parameters()).device
        kernel = flex_grouped.description(self.kernel, device, inner, flex_grouped.head_dim_of(config))
        described = f"grouped attention through {kernel}, {checkpointing_description(hf_model)}"
        if self.processes > 1:
            described += ranks.described(self.processes)
        if self.mode != "auto":
            return described
        if self.checked is None:
            return f"{described}; its first packed batch is checked against the plain forward"
        return f"{described}; first packed batch matched the plain forward, {self.checked.describe()}"

    def compute(self, model, arguments: dict[str, Any], *, temperature: float, entropy_grad: bool, training: bool,
                plain_forward=None):  # fmt: skip
        """The call's ``(logps, entropies, aux_loss)`` packed, or None where the plain path must run;
        ``plain_forward``: the call's plain forward (no arguments), which ``"auto"`` checks its first packed call
        against (the plain result is returned where they differ)."""
        if not self.enabled:
            return None
        reason = self.reason_now(model) or call_reason(arguments)
        mode = "train" if training else "eval"
        batches = None if reason is not None else list(packed_batches(model, arguments))
        if batches is not None:
            for batch in batches:
                batch.layout.kernel_request = self.kernel
            ratio = predicted_cost_ratio(model, arguments, batches)
            self.metrics[mode][COST_METRIC].append(ratio)
            if ratio > 1.0:
                reason = "the FLOP model predicts the packed forward would cost more than the plain one"
        if self.processes > 1:  # a sharded model's ranks agree on every call (``ranks.py``)
            self.paired_device = ranks.paired_device(model, self.processes)
            reason = ranks.agreed_reason(self.paired_device, reason, batches)
        if reason is not None:
            self.note(False, reason)
            self.metrics[mode][METRIC].append(0.0)
            return None
        checking = self.mode == "auto" and self.checked is None  # the first-batch check reads the autocast seen
        watch = autocast_seen(core_model(model)) if checking else contextlib.nullcontext(set())
        with self.forward_context(), watch as autocast_dtypes:
            logps, entropies, aux, share = packed_logps_and_entropies(
                model, arguments, temperature=temperature, entropy_grad=entropy_grad, batches=batches
            )
        if checking:
            compute_dtypes = self.compute_dtypes(model, autocast_dtypes)
            plain = self.first_batch_check(arguments, logps, plain_forward, compute_dtypes)
            if plain is not None:
                self.metrics[mode][METRIC].append(0.0)
                return plain
        self.metrics[mode][METRIC].append(1.0)
        self.metrics[mode][SHARE_METRIC].append(share)
        self.note(True, f"each prompt group packed once, its images once; {self.supported_description(model)}")
        return logps, entropies, aux

    @staticmethod
    def compute_dtypes(model, autocast_dtypes=()) -> tuple[torch.dtype, ...]:
        """The precisions the call's forwards computed in besides their outputs': the autocast the model's forward
        ran under (``autocast_seen``) and the output head's weight."""
        head = core_model(model).get_output_embeddings()
        return (*autocast_dtypes, *((head.weight.dtype,) if head is not None else ()))

    def first_batch_check(self, arguments: dict[str, Any], packed_logps: torch.Tensor, plain_forward,
                          compute_dtypes=()):  # fmt: skip
        """``"auto"``'s check of its first packed call against ``plain_forward``, within the bound of the
        precision they computed in (``compute_dtypes``): None where it matches (sharing stays on), else the plain
        result, with sharing off for the run and one warning naming the difference."""
        if plain_forward is None:
            raise TypeError("prefix_sharing='auto' needs the call's plain_forward for its first-batch check")
        with torch.no_grad():
            plain = plain_forward()
        completion_mask = arguments["attention_mask"][:, -arguments["logits_to_keep"] :]
        self.checked = self_check.compare(packed_logps, plain[0], completion_mask, compute_dtypes)
        passed = self.checked.passed
        if passed if self.paired_device is None else ranks.all_ranks(self.paired_device, passed):
            logger.info("PAPO-G prefix sharing: first packed batch matches the plain forward, %s",
                        self.checked.describe())  # fmt: skip
            return None
        found = self.checked.describe() if not self.checked.passed else "on another rank (a sharded model)"
        self.reason = (
            f"prefix_sharing='auto' turned itself off for the run: its first packed batch differs from the plain "
            f"forward, {found}"
        )
        logger.warning("PAPO-G prefix sharing: plain forward per completion, because %s", self.reason)
        self.logged.add((False, self.reason))
        return plain_forward() if torch.is_grad_enabled() else plain

    def note(self, shared: bool, reason: str) -> None:
        if (shared, reason) in self.logged:
            return
        self.logged.add((shared, reason))
        if shared:
            logger.info("PAPO-G prefix sharing: %s", reason)
        elif self.mode == "auto":  # off where it does not apply is what "auto" means: said once, not warned
            logger.info("PAPO-G prefix sharing (auto): plain forward per completion, because %s", reason)
        else:
            logger.warning("PAPO-G prefix sharing: plain forward per completion, because %s", reason)


GRPO_RUN_REASON = (
    "the perception term is off for the run and nothing reads the masked branch (gamma 0): TRL's own forward, so the "
    "run makes GRPOTrainer's forwards exactly (no first-batch check)"
)


def auto_reason(args, grpo_run: bool) -> str | None:
    """Why ``"auto"`` is off for the run before any model check: a run that is GRPO (``grpo_run``, the trainer's
    masked branch skipped) keeps GRPO's cost and numbers, and a device batch must hold whole groups."""
    return GRPO_RUN_REASON if grpo_run else auto_batch_reason(args)


def auto_batch_reason(args) -> str | None:
    """Why ``"auto"`` cannot shuffle whole groups into ``args``' device batches (``True`` refuses it at config
    time, ``config.sharing_fields_problem``), or None."""
    batch, generations = args.per_device_train_batch_size, args.num_generations
    if generations and batch % generations:
        return (
            f"per_device_train_batch_size={batch} is not a multiple of num_generations={generations} (a device "
            "batch must hold whole prompt groups)"
        )
    return None


@contextlib.contextmanager
def autocast_seen(hf_model):
    """The set of autocast dtypes in force when ``hf_model``'s forward ran inside the block, seen from inside it:
    accelerate opens mixed precision within a prepared model's forward, out of sight of the caller, and a release's
    log-prob method may open it around its call (``forward_context``)."""
    seen: set[torch.dtype] = set()
    device = next(hf_model.parameters()).device.type

    def record(_module, _args):
        if torch.is_autocast_enabled(device):
            seen.add(torch.get_autocast_dtype(device))

    handle = hf_model.register_forward_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


def block_ids(inputs: dict[str, Any], group_size: int) -> torch.Tensor:
    """Per row, its block: the rows of one prompt (``group_samples``) in runs of ``group_size`` (a prompt that occurs
    twice in a round is two blocks)."""
    blocks = torch.empty(len(inputs["prompt_ids"]), dtype=torch.long)
    next_block = 0
    for group in group_samples(inputs):
        for start in range(0, len(group), group_size):
            blocks[group[start : start + group_size]] = next_block
            next_block += 1
    return blocks


def shuffle_whole_blocks(seq_dict: dict[str, Any]) -> dict[str, Any]:
    """TRL's round shuffle with blocks for rows: TRL's own ``torch.randperm`` over the rows (the same draw from the
    same generator, so the run's random stream stays TRL's), the blocks (``BLOCK_KEY``) in the order their first row
    comes in it, each block's rows together; every sequence value permuted alike, 0-d tensors and None kept (as
    ``shuffle_sequence_dict``)."""
    blocks = seq_dict[BLOCK_KEY]
    rows = torch.randperm(len(blocks))
    first_seen = {}
    for row in rows.tolist():
        first_seen.setdefault(int(blocks[row]), len(first_seen))
    order = sorted(range(len(blocks)), key=lambda row: (first_seen[int(blocks[row])], row))
    permutation = torch.tensor(order, dtype=torch.long)

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[permutation.to(value.device)]
        return [value[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in seq_dict.items()}


@contextlib.contextmanager
def whole_block_shuffle(parent_class):
    """The round shuffle of ``parent_class``'s module (TRL's ``grpo_trainer.shuffle_sequence_dict``, which
    ``_prepare_inputs`` looks up by name there) replaced by ``shuffle_whole_blocks`` for the duration."""
    module = inspect.getmodule(parent_class)
    original = getattr(module, PARENT_SHUFFLE_FUNCTION)
    setattr(module, PARENT_SHUFFLE_FUNCTION, shuffle_whole_blocks)
    try:
        yield
    finally:
        setattr(module, PARENT_SHUFFLE_FUNCTION, original)
