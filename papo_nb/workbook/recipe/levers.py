"""The memory levers a run pulls, as the forecast reads them from the params, and what each moves and costs.

- vLLM sleep mode (``vllm_enable_sleep_mode``, TRL's field): the colocated engine sleeps at level 2 after each
  round's generation (trl/generation/vllm_generation.py:702, weights and KV cache released) and wakes for the next
  (emptying torch's cache first, :453), so its share of the GPU is a phase, not held through training. The weights
  it reloads on waking are the sync TRL makes every round anyway: no time term.
- The reference model in bf16 (``reference_precision``): TRL builds it from ``model_init_kwargs``, fp32 without a
  dtype; none with beta 0 or LoRA. The official ref worker is bf16 (config_grpo_papo.yaml:98). No time term.
- FSDP2 CPU offload (``accelerate_config`` whose ``fsdp_offload_params`` is true, ``configs/accelerate/
  fsdp_offload.yaml``): each process's shard of the parameters, gradients and AdamW states lives in CPU memory,
  and so does the reference model's (TRL prepares it with the same policy). On the GPU stay the root module's
  parameters (embeddings, lm_head: gathered for the whole micro-step) and two decoder blocks (the one computing and
  the one prefetched), bf16, with their bf16 gradients. The official actor offloads both (config_grpo_papo.yaml:
  79-80) and its reference too (:100). Time: what crosses PCIe per optimizer step (``offload_seconds``) and the
  optimizer's step on the CPU.

Not offered as parameters, so none silently does nothing: the round's pixel_values held once per prompt group or
kept off the GPU until their micro-batch (TRL 1.9.1 buffers G copies on the GPU: the forecast's round_tensors), and
a chunked log-prob head on TRL 1.9.1 (TRL 1.15+ fuses it by itself; the forecast counts 1.9.1's full logits).
"""

from __future__ import annotations

from pathlib import Path

PCIE_BYTES_PER_S = 32e9  # per GPU and direction: PCIe 5.0 x16 (64 GB/s) at half its peak (stated, not measured)
CPU_ADAM_BYTES_PER_S = 20e9  # memory traffic one process's CPU AdamW step reaches (stated, not measured)
ADAM_BYTES_PER_PARAMETER = 28  # fp32 weight read and written, gradient read, two states read and written
MASTER_BYTES_PER_PARAMETER = 16  # fp32 master weight, gradient and two AdamW states


def accelerate_fsdp(params, root: Path | None = None) -> tuple[bool, bool]:
    """(sharded by FSDP, parameters offloaded to the CPU) from the params' accelerate config file (looked up as
    the launcher does, relative to the cwd, then to ``root``: the project folder, where the caller names one); with
    no file, FSDP when its name says so."""
    import yaml

    name = params.accelerate_config
    sharded = params.num_processes > 1
    for path in (Path(name), *([Path(root) / name] if root else [])) if name else ():
        if path.is_file():
            config = yaml.safe_load(path.read_text()) or {}
            fsdp = config.get("distributed_type") == "FSDP"
            offload = str((config.get("fsdp_config") or {}).get("fsdp_offload_params", False)).lower() == "true"
            return fsdp and sharded, fsdp and offload
    return "fsdp" in name.lower() and sharded, False


def resident_parameters(w) -> int:
    """Parameters an offloaded FSDP2 model holds on the GPU at once: the root module's (the embeddings and an
    untied lm_head) and two decoder blocks (the one computing, the one prefetched)."""
    return w.embedding_parameters + 2 * w.layer_parameters


def host_bytes(s, w, trainable: int) -> float:
    """CPU memory of one node that offload takes: every process's shard together is one model's fp32 master
    weights, gradients and AdamW states, the frozen weights, and the reference model."""
    if not s.offload:
        return 0.0
    reference = s.reference_bytes * w.parameters if s.beta > 0 and not s.lora else 0
    return trainable * MASTER_BYTES_PER_PARAMETER + (w.parameters - trainable) * s.weight_bytes + reference


def offload_seconds(s, w, trainable: int) -> float:
    """Seconds per optimizer step one GPU spends on offload, not overlapped with compute (an upper bound): every
    micro-step copies its fp32 parameter shard in for the forward and again for the backward and its gradient shard
    out; each no-grad forward of the round (reference, old log-probs, masked branch) copies a shard in per
    micro-batch; the round's vLLM weight sync copies one in; AdamW steps the shard on the CPU."""
    if not s.offload:
        return 0.0
    shard = 4 * w.parameters / s.processes
    reference = s.reference_bytes * w.parameters / s.processes if s.beta > 0 and not s.lora else 0.0
    forwards = (shard if s.old_logps else 0.0) + (shard if s.masked_branch else 0.0) + reference
    moved = s.accumulation * (3 * shard + forwards) + (shard / s.optimizer_steps_per_round if s.use_vllm else 0.0)
    adam = trainable / s.processes * ADAM_BYTES_PER_PARAMETER / CPU_ADAM_BYTES_PER_S
    return moved / PCIE_BYTES_PER_S + adam


def levers_used(s) -> list[str]:
    """The levers a setting pulls, as the forecast table names them."""
    used = []
    if s.use_vllm and s.vllm_mode == "colocate" and s.vllm_sleep:
        used.append("vLLM sleep")
    if s.beta > 0 and not s.lora and s.reference_bytes == 2:
        used.append("bf16 reference")
    if s.offload:
        used.append("CPU offload")
    return used
