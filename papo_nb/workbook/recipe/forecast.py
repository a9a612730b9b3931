"""The memory of one GPU at the peak of a training step, part by part, from the params and the model's configuration
alone (``architectures``): no weight, no hub, no GPU. ``forecast_report`` adds the step time, the table and the
refusal; ``rehearsal`` measures the same parts on a random-weight model at true widths.

What each part counts, per GPU (P parameters, N processes, B the micro-batch, T = prompt + completion tokens):
- weights: bf16 on CUDA (``load_policy``); full fine-tuning under FSDP2 with bf16 mixed precision: accelerate
  upcasts the trainable weights to an fp32 master copy (``fsdp2_prepare_model``) sharded over N; LoRA: the frozen
  bf16 base (sharded under FSDP) plus the fp32 adapter (peft's ``autocast_adapter_dtype``).
- gradients and optimizer: one gradient and two AdamW states per trainable parameter, in its dtype.
- reference: TRL 1.9.1 builds a second model only for full fine-tuning with beta > 0 (``create_model_from_path``,
  fp32 when ``model_init_kwargs`` is unset, bf16 with ``reference_precision: bf16``; sharded by ``prepare_fsdp``);
  LoRA disables its adapters instead.
- with FSDP2 CPU offload (``levers``): weights, gradients and optimizer are the blocks resident on the GPU
  (``levers.resident_parameters``, bf16, with their bf16 gradients); the optimizer and the reference live on the
  CPU (``Forecast.host``).
- activations: the tensors autograd saves in the loss forward of one micro-batch, per token per decoder layer
  (``layer_bytes``; with checkpointing each layer's bf16 input) and per patch per vision block, plus the final norm's;
  recompute: with checkpointing, one layer's tensors again during the backward.
- logprob_forward: the micro-batch's completion logits as TRL 1.9.1 makes them under accelerate's autocast
  (bf16 from the lm_head, converted to fp32 by ``convert_outputs_to_fp32``, kept for the backward, plus its fp32
  gradient): 10 bytes per logit.
- masked_forward: the masked branch's no-grad forward (bf16 and fp32 logits): of one micro-batch at C + 1
  positions, or with the shared prompt prefix (``papo.prefill``, ``masked_forward`` auto) of one chunk of
  whole prompts at C - 1 positions (``masked_logits``; the prefill's last-token logits, one row per prompt, apart).
- generation: TRL 1.9.1 without vLLM generates the round's rows (B x steps_per_generation) in one
  ``model.generate``: their bf16 KV cache at full length, the next-token logits and probabilities and the prefill's
  one-layer transient; with
  vLLM colocated, its ``vllm_gpu_memory_utilization`` share of the GPU, held through training too (persistent
  unless ``vllm_enable_sleep_mode``: then a phase); a vLLM server's GPUs are not this one's.
- round_tensors: the round's buffered inputs: fp32 pixel_values of every row, ids and masks (int64), and three
  fp32 per-token log-prob vectors (old, reference, masked).
- probe: the gamma-zero probe's float64 vectors of every trainable parameter (``PROBE_VECTORS``; sharded).
The peak is the persistent parts plus the largest of the phases: the training micro-step (activations and
logprob_forward), generation, the masked forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from papo_nb.papo import prefill
from papo_nb.prefix_sharing import trl_seams
from papo_nb.workbook.recipe import levers
from papo_nb.workbook.recipe.architectures import Widths, published_config, widths

GIB = 1024**3
PARTS = (
    "weights",
    "gradients",
    "optimizer",
    "reference",
    "activations",
    "recompute",
    "logprob_forward",
    "masked_forward",
    "generation",
    "round_tensors",
    "probe",
)
PERSISTENT = ("weights", "gradients", "optimizer", "reference", "round_tensors", "probe")
PHASES = {
    "train": ("activations", "recompute", "logprob_forward"),
    "generate": ("generation",),
    "masked": ("masked_forward",),
}
PROBE_VECTORS = 12  # the probe's float64 vectors of the trainable parameters (12 to 24 by the loss set: the fewest)
LOGPROB_BYTES = 10  # per completion logit: fp32 copy kept for the backward (4), its bf16 source (2), fp32 grad (4)
MASKED_BYTES = 6  # per completion logit, no grad: bf16 logits and their fp32 copy
GENERATION_VOCAB_BYTES = 10  # per row: the next token's bf16 logits, their fp32 copy and fp32 probabilities
# TRL's defaults for parameters other branches add to the params (read with getattr so either merge works).
TRL_DEFAULTS = {
    "gradient_checkpointing": True,
    "use_vllm": False,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_mode": "colocate",
    "vllm_enable_sleep_mode": False,
}


def layer_bytes(w: Widths, lora: bool) -> int:
    """Bytes autograd saves per token in one decoder layer, bf16 autocast, no checkpointing. Counted from the
    tensors saved by a Qwen2/Qwen3 layer (fp32 RMSNorm inputs 4h each, the q/k/v/attention outputs, the SDPA
    log-sum-exp, the MLP's gate, SiLU and up outputs; full fine-tuning adds the linears' inputs and the norms'
    bf16 inputs; Qwen3's per-head q/k norms their fp32 inputs); held to the rehearsal's measurement."""
    q, kv = w.heads * w.head_dim, w.kv_heads * w.head_dim
    if lora:
        per = 6 * w.intermediate + 14 * w.hidden + 4 * q + 4 * kv + 4 * w.heads
        return per + (4 * (q + kv) if w.qk_norm else 0)
    per = 8 * w.intermediate + 14 * w.hidden + 6 * q + 4 * kv + 4 * w.heads
    return per + (6 * (q + kv) if w.qk_norm else 0)


def vision_block_bytes(w: Widths) -> int:
    """Bytes a trainable vision block saves per patch (bf16 autocast, no checkpointing): Qwen2.5-VL's RMSNorm/SiLU
    block with fp32 rotary q/k, Qwen3-VL's LayerNorm/GELU block; held to the rehearsal's measurement."""
    h, i = w.vision_hidden, w.vision_intermediate
    if w.vision_norm == "layernorm":
        return 4 * i + 22 * h + 4 * w.vision_heads
    return 8 * i + 26 * h + 4 * w.vision_heads


@dataclass
class Setting:
    """What the forecast reads of the params, with TRL's defaults for what they do not have."""

    lora: bool
    processes: int
    fsdp: bool
    weight_bytes: int
    micro_batch: int
    accumulation: int  # micro-batches per optimizer step
    round_rows: int  # rows one GPU generates per round: micro_batch x steps_per_generation
    old_logps: bool  # TRL recomputes the old policy's log-probs (a round spans several optimizer steps)
    prompt_tokens: int
    completion_tokens: int
    patches_per_row: int
    checkpointing: bool
    use_vllm: bool
    vllm_share: float
    vllm_mode: str  # colocate: the engine shares this GPU; server: it runs on other GPUs
    vllm_sleep: bool  # colocate with sleep mode: the engine's memory is released during training
    beta: float
    masked_branch: bool
    probe: bool
    freeze_vision: bool
    lora_r: int
    offload: bool = False  # FSDP2 CPU offload of parameters, gradients, optimizer states and the reference
    reference_bytes: int = 4  # the reference model's dtype: fp32 (TRL's default) or bf16 (reference_precision)
    masked_shared: bool = False  # the masked branch runs through the shared prompt prefix (prefill.py)
    masked_chunk_rows: int = 0  # rows of one shared-prefix completion forward

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def optimizer_steps_per_round(self) -> float:
        return self.round_rows / (self.micro_batch * self.accumulation)


def setting(params, w: Widths, root: Path | None = None) -> Setting:
    """What the forecast reads from ``params``; ``root``: the project folder its accelerate config is looked up in."""
    accumulation = params.gradient_accumulation_steps
    per_round = params.steps_per_generation or accumulation
    patches = params.max_pixels // (w.patch * w.patch)
    fsdp, offload = levers.accelerate_fsdp(params, root)
    return Setting(
        lora=params.finetuning == "lora",
        processes=params.num_processes,
        fsdp=fsdp,
        weight_bytes=2 if params.precision == "bf16" else 4,
        micro_batch=params.per_device_train_batch_size,
        accumulation=accumulation,
        round_rows=params.per_device_train_batch_size * per_round,
        old_logps=accumulation % per_round != 0,  # TRL 1.9.1: gradient_accumulation_steps % generate_every
        prompt_tokens=params.max_prompt_length,
        completion_tokens=params.max_completion_length,
        patches_per_row=patches,
        checkpointing=bool(getattr(params, "gradient_checkpointing", TRL_DEFAULTS["gradient_checkpointing"])),
        use_vllm=bool(getattr(params, "use_vllm", TRL_DEFAULTS["use_vllm"])),
        vllm_share=float(getattr(params, "vllm_gpu_memory_utilization", TRL_DEFAULTS["vllm_gpu_memory_utilization"])),
        vllm_mode=str(getattr(params, "vllm_mode", TRL_DEFAULTS["vllm_mode"])),
        vllm_sleep=bool(getattr(params, "vllm_enable_sleep_mode", TRL_DEFAULTS["vllm_enable_sleep_mode"])),
        beta=params.beta,
        masked_branch=params.perception_loss_weight > 0 or params.masked_entropy_weight > 0,
        probe=params.require_gpu_contract_probe,
        freeze_vision=params.freeze_vision_tower,
        lora_r=params.lora_r,
        offload=offload,
        reference_bytes=2 if params.reference_precision == "bf16" else 4,
        **masked_form(params),
    )


def masked_form(params) -> dict:
    """Whether the masked branch takes the shared prompt prefix (the trainer's own choice from the config and the
    installed TRL, ``papo.prefill.plan``; every Qwen-VL family the forecast knows supports it) and how many
    completion rows one of its forwards holds (``papo.masked_branch``): once per round
    (``masked_branch='rollout'``: chunks of whole prompts of at most max(B, G) rows on one process, B rows under
    several) or per micro-batch (one prompt's rows, B under several; per-completion masks on one process leave no
    prompt with two rows: the full forward)."""
    rows, group, processes = params.per_device_train_batch_size, params.num_generations, params.num_processes
    rollout = params.masked_branch == "rollout"
    single_rows = not rollout and processes == 1 and params.mask_sharing != "prompt"
    if group < 2 or single_rows or trl_seams.prefill_reason() or prefill.config_reason(params):
        return {"masked_shared": False, "masked_chunk_rows": 0}
    if processes > 1:
        chunk = rows
    else:
        chunk = max(rows, group) // group * group if rollout else min(rows, group)
    return {"masked_shared": True, "masked_chunk_rows": chunk}


def trainable_parameters(s: Setting, w: Widths) -> int:
    if s.lora:
        return w.lora_parameters(s.lora_r)
    return w.parameters - (w.vision_parameters if s.freeze_vision else 0)


def state_parts(s: Setting, w: Widths) -> dict[str, float]:
    """Weights, gradients, optimizer states and the reference model, per GPU."""
    if s.offload:  # the shards live on the CPU; the resident blocks are gathered in bf16, with bf16 gradients
        resident = levers.resident_parameters(w)
        return {"weights": resident * 2, "gradients": resident * 2, "optimizer": 0.0, "reference": 0.0}
    shards = s.processes if s.fsdp else 1
    trainable = trainable_parameters(s, w)
    # Under FSDP2 with mixed precision the trainable weights become fp32 master weights; otherwise they keep the
    # dtype they were loaded in (bf16 on CUDA), and so do their gradients and AdamW states. LoRA adapters are fp32.
    train_bytes = 4 if (s.lora or s.fsdp) else s.weight_bytes
    frozen = w.parameters - trainable if not s.lora else w.parameters
    reference = s.reference_bytes * w.parameters / shards if (s.beta > 0 and not s.lora) else 0.0
    return {
        "weights": (frozen * s.weight_bytes + trainable * train_bytes) / shards,
        "gradients": trainable * train_bytes / shards,
        "optimizer": 2 * trainable * train_bytes / shards,
        "reference": reference,
    }


def head_bytes(w: Widths, lora: bool) -> int:
    """Per token, saved outside the decoder layers: the final RMSNorm's fp32 input (full fine-tuning: also its bf16
    input, which the lm_head's input shares)."""
    return 4 * w.hidden if lora else 6 * w.hidden


def vision_bytes(s: Setting, w: Widths) -> float:
    """Per row, the vision tower's saved tensors: when it trains, or when checkpointing makes the inputs require
    grad (TRL calls ``enable_input_require_grads`` for LoRA under checkpointing): each block's bf16 input plus the
    patch and merger tensors (6 x width per patch; training, 12 x width and the bf16 pixels the patch embedding
    saves) under checkpointing, every block's tensors without."""
    trains = not s.lora and not s.freeze_vision
    if not trains and not (s.lora and s.checkpointing):
        return 0.0
    if s.checkpointing:
        fixed = 12 * w.vision_hidden + 2 * 3 * w.temporal_patch * w.patch**2 if trains else 6 * w.vision_hidden
        return s.patches_per_row * (w.vision_depth * 2 * w.vision_hidden + fixed)
    return s.patches_per_row * (w.vision_depth * vision_block_bytes(w) + 14 * w.vision_hidden)


def activation_bytes(s: Setting, w: Widths) -> float:
    """Saved tensors of one micro-batch's loss forward (kept until its backward): the decoder layers (with
    checkpointing only their bf16 inputs), the final norm and the vision tower; full-vocabulary ones excluded."""
    per_layer = 2 * w.hidden if s.checkpointing else layer_bytes(w, s.lora)
    text = s.micro_batch * s.tokens * (w.layers * per_layer + head_bytes(w, s.lora))
    return text + s.micro_batch * vision_bytes(s, w)


def recompute_bytes(s: Setting, w: Widths) -> float:
    """With checkpointing, the backward runs each layer's forward again: one layer's (and vision block's) saved
    tensors live at once on top of the activations. Forecast only: checkpointing's own hooks hide them."""
    if not s.checkpointing:
        return 0.0
    vision = s.patches_per_row * vision_block_bytes(w) if (not s.lora and not s.freeze_vision) else 0
    return s.micro_batch * (s.tokens * layer_bytes(w, s.lora) + vision)


def generation_bytes(s: Setting, w: Widths, gpu_memory: float | None) -> float:
    if s.use_vllm:  # a vLLM server generates on GPUs of its own
        return s.vllm_share * gpu_memory if gpu_memory and s.vllm_mode == "colocate" else 0.0
    kv_per_token = w.layers * 2 * w.kv_heads * w.head_dim * 2  # keys and values, bf16
    # The prefill's transient peak, one layer (block) at a time: the MLP's gate, up and activation outputs (bf16) and
    # the norm's fp32 input, for the round's prompt tokens, or for all its images' patches in the vision tower first.
    text = s.round_rows * s.prompt_tokens * (6 * w.intermediate + 4 * w.hidden)
    vision = s.round_rows * s.patches_per_row * vision_prefill_bytes(w)
    return s.round_rows * (s.tokens * kv_per_token + w.vocab * GENERATION_VOCAB_BYTES) + max(text, vision)


def masked_logits(s: Setting, w: Widths) -> int:
    """Vocabulary logits one masked-branch forward holds: the micro-batch at C + 1 positions (TRL's
    ``logits_to_keep + 1``), or a shared-prefix chunk at C - 1 (the first token is scored from the prefill's last
    logit, the completion forward sees tokens 0 .. C - 2)."""
    if s.masked_shared:
        return s.masked_chunk_rows * max(s.completion_tokens - 1, 0) * w.vocab
    return s.micro_batch * (s.completion_tokens + 1) * w.vocab


def vision_prefill_bytes(w: Widths) -> int:
    """Per patch, the vision tower's transient peak in a no-grad forward of every image at once (bf16 autocast):
    in the attention, where the rotary embedding runs in fp32 (``apply_rotary_pos_emb_vision``), the block's
    input and normed input, the qkv output (6h), q and k in fp32 (8h), q's rotated copy (4h) and k's three fp32
    temporaries (12h), cos and sin (fp32, head width each); or in the MLP, the gated (SiLU) MLP's three or the GELU
    MLP's two intermediate outputs. The attention itself keeps no scores (the CPU's SDPA and flash attention both
    work in blocks). Measured on Qwen2.5-VL's block at 1,024 and 5,120 patches per image: 44,178 B per patch,
    this formula 44,160."""
    h, i, head = w.vision_hidden, w.vision_intermediate, w.vision_hidden // w.vision_heads
    normed = 4 * h if w.vision_norm == "layernorm" else 2 * h  # autocast runs LayerNorm in fp32; RMSNorm casts back
    attention = 2 * h + normed + 30 * h + 8 * head
    mlp = 2 * h + normed + (4 * i if w.vision_norm == "layernorm" else 6 * i)
    return max(attention, mlp)


def round_tensor_bytes(s: Setting, w: Widths) -> float:
    pixel_row = s.patches_per_row * 3 * w.temporal_patch * w.patch * w.patch * 4  # fp32 pixel_values
    ids_row = s.tokens * 8 * 2  # ids and attention mask, int64
    logps_row = s.completion_tokens * 4 * 3  # old, reference and masked per-token log-probs, fp32
    return s.round_rows * (pixel_row + ids_row + logps_row)


def memory_parts(s: Setting, w: Widths, gpu_memory: float | None = None) -> dict[str, float]:
    """Bytes per GPU of every part (``PARTS``)."""
    logits = s.micro_batch * (s.completion_tokens + 1) * w.vocab
    shards = s.processes if s.fsdp else 1
    parts = state_parts(s, w)
    parts.update(
        activations=activation_bytes(s, w),
        recompute=recompute_bytes(s, w),
        logprob_forward=logits * LOGPROB_BYTES,
        masked_forward=masked_logits(s, w) * MASKED_BYTES if s.masked_branch else 0.0,
        generation=generation_bytes(s, w, gpu_memory),
        round_tensors=round_tensor_bytes(s, w),
        probe=PROBE_VECTORS * trainable_parameters(s, w) * 8 / shards if s.probe else 0.0,
    )
    return {name: float(parts[name]) for name in PARTS}


def persistent_parts(s: Setting) -> tuple[str, ...]:
    """The parts held for the whole step: a colocated vLLM engine keeps its share of the GPU through training too
    (TRL 1.9.1 frees it only with ``vllm_enable_sleep_mode``, off by default)."""
    return PERSISTENT + (("generation",) if s.use_vllm and s.vllm_mode == "colocate" and not s.vllm_sleep else ())


def peak(parts: dict[str, float], persistent: tuple[str, ...] = PERSISTENT) -> tuple[float, str]:
    """(peak bytes, the phase at the peak): the ``persistent`` parts plus the largest phase."""
    held = sum(parts[p] for p in persistent)
    phases = {name: sum(parts[p] for p in members if p not in persistent) for name, members in PHASES.items()}
    phase = max(phases, key=phases.get)
    return held + phases[phase], phase


@dataclass
class Forecast:
    model: str
    setting: Setting
    widths: Widths
    parts: dict[str, float]
    total: float
    peak_phase: str
    gpu_memory: float | None
    host: float = 0.0  # CPU memory of one node that offload takes
    notes: list[str] = field(default_factory=list)
    root: Path | None = None  # the project folder its accelerate config was looked up in (``setting``)


def forecast(params, gpu_memory: float | None = None, w: Widths | None = None, root: Path | None = None) -> Forecast:
    """The forecast of ``params`` on GPUs of ``gpu_memory`` bytes (None: unknown; vLLM's share is then 0); ``root``:
    the project folder a relative ``accelerate_config`` is looked up in after the cwd."""
    w = w or widths(published_config(params.model_name_or_path))
    s = setting(params, w, root)
    parts = memory_parts(s, w, gpu_memory)
    total, phase = peak(parts, persistent_parts(s))
    host = levers.host_bytes(s, w, trainable_parameters(s, w))
    return Forecast(params.model_name_or_path, s, w, parts, total, phase, gpu_memory, host, root=root)
