"""The forecast (``forecast``) as a verdict: fits or not on a GPU, what to change, the step time from FLOPs, the
printed table of ``papo-nb preflight``, the refusal ``papo-nb train`` and ``papo-nb run`` give before any weight
loads, and docs/recipe.md's forecast table (``python -m papo_nb.workbook.recipe.forecast_report --table``)."""

from __future__ import annotations

import os
from dataclasses import asdict

from papo_nb.workbook.recipe import levers
from papo_nb.workbook.recipe.forecast import GIB, PARTS, Forecast, trainable_parameters

GPU_MEMORY_ENV = "PAPO_NB_GPU_MEMORY_GIB"  # simulates the GPU's memory (GiB) where none is, or overrides it
USABLE = 0.92  # of a GPU's memory the forecast may fill: CUDA context, NCCL buffers and fragmentation take the rest
DENSE_BF16_FLOPS = 989e12  # H100 and H200 SXM, bf16 dense tensor-core peak
UTILISATION = 0.35  # of that peak a training step reaches (model FLOPs utilisation; stated, not measured)
BANDWIDTH = {"H100 80GB": 3.35e12, "H200 141GB": 4.8e12}  # HBM bytes per second
DECODE_EFFICIENCY = 0.5  # of the bandwidth one HF generate decode step reaches (stated, not measured)


def gpu_name(gpu_memory: float) -> str:
    return "H200 141GB" if gpu_memory > 100 * GIB else "H100 80GB"


def advice(fc: Forecast, part: str) -> str:
    """The change that shrinks ``part``."""
    s = fc.setting
    if part == "activations":
        if not s.checkpointing:
            return "set gradient_checkpointing: true"
        return "lower per_device_train_batch_size (raise gradient_accumulation_steps to keep the batch)"
    if part == "generation":
        if s.use_vllm:
            sleep = "" if s.vllm_sleep or s.vllm_mode != "colocate" else "set vllm_enable_sleep_mode: true, "
            return f"{sleep}lower vllm_gpu_memory_utilization, or vllm_mode: server (vLLM on GPUs of its own)"
        return (
            "set use_vllm: true (colocated vLLM holds the cache in a fixed share), or lower steps_per_generation "
            "(TRL generates the round's rows in one model.generate)"
        )
    if part in ("weights", "gradients", "optimizer", "reference"):
        if s.lora:
            return "use more processes with configs/accelerate/fsdp.yaml (FSDP2 shards the base weights)"
        more = s.processes * 2
        offload = "" if s.offload or not s.fsdp else "accelerate_config: configs/accelerate/fsdp_offload.yaml, or "
        bf16 = "reference_precision: bf16, " if part == "reference" and s.reference_bytes == 4 else ""
        return (
            f"{bf16}{offload}shard over more GPUs (num_processes: {more} with configs/accelerate/fsdp.yaml), or "
            "finetuning: lora" + (", or beta: 0 (no reference model)" if part == "reference" else "")
        )
    if part in ("logprob_forward", "masked_forward"):
        return "lower per_device_train_batch_size or max_completion_length"
    if part == "round_tensors":
        return "lower steps_per_generation or max_pixels"
    return "set require_gpu_contract_probe: false (the probe runs on the CPU recipe)"


def largest_part(fc: Forecast) -> str:
    """The part to shrink first: the largest of the persistent parts and the phase at the peak."""
    from papo_nb.workbook.recipe.forecast import PHASES, persistent_parts

    members = [*persistent_parts(fc.setting), *PHASES[fc.peak_phase]]
    return max(members, key=lambda p: fc.parts[p])


def verdict(fc: Forecast) -> dict:
    """Fits or not on ``fc.gpu_memory``, and where not, the largest part, its size and the change that fixes it."""
    if not fc.gpu_memory:
        return {"fits": None}
    usable = USABLE * fc.gpu_memory
    if fc.total <= usable:
        return {"fits": True, "usable_gib": usable / GIB}
    part = largest_part(fc)
    return {"fits": False, "usable_gib": usable / GIB, "part": part, "part_gib": fc.parts[part] / GIB,
            "change": advice(fc, part)}  # fmt: skip


def step_seconds(fc: Forecast, gpu_memory: float | None) -> dict:
    """Seconds per optimizer step per GPU: training, reference and masked forwards from FLOPs at ``UTILISATION`` of
    ``DENSE_BF16_FLOPS`` (6 x params x tokens for a training pass, 8 with checkpointing, 4 and 6 for LoRA, whose
    frozen weights get no weight gradient; 2 x params x tokens for a forward; attention 4 x layers x tokens^2 x
    query width per row and pass); generation (HF generate) from the bytes each decode step reads at
    ``DECODE_EFFICIENCY`` of the HBM bandwidth, and its prefill from FLOPs; vLLM's generation is not estimated;
    CPU offload's copies over PCIe and its CPU optimizer step (``levers.offload_seconds``)."""
    s, w = fc.setting, fc.widths
    rows = s.micro_batch * s.accumulation
    tokens = rows * s.tokens
    attention = 4 * w.layers * s.tokens**2 * w.heads * w.head_dim * rows
    passes = (4 if s.lora else 6) + (2 if s.checkpointing else 0)
    train = passes * w.parameters * tokens + 3 * attention
    forwards = (1 if s.beta > 0 else 0) + (1 if s.masked_branch else 0) + (1 if s.old_logps else 0)
    inference = forwards * (2 * w.parameters * tokens + attention)
    flops = DENSE_BF16_FLOPS * UTILISATION
    out = {"train_s": train / flops, "extra_forwards_s": inference / flops,
           "offload_s": levers.offload_seconds(s, w, trainable_parameters(s, w))}  # fmt: skip
    if s.use_vllm:
        out["generation_s"] = None
    else:
        name = gpu_name(gpu_memory or 80 * GIB)
        kv_row = w.layers * 2 * w.kv_heads * w.head_dim * 2 * (s.prompt_tokens + s.completion_tokens / 2)
        read_per_step = w.parameters * s.weight_bytes / (s.processes if s.fsdp else 1) + s.round_rows * kv_row
        decode = s.completion_tokens * read_per_step / (BANDWIDTH[name] * DECODE_EFFICIENCY)
        prefill = (2 * w.parameters * s.round_rows * s.prompt_tokens) / flops
        out["generation_s"] = (decode + prefill) / s.optimizer_steps_per_round
    out["total_s"] = sum(v for v in out.values() if v is not None)
    return out


def as_dict(fc: Forecast) -> dict:
    return {
        "model": fc.model,
        "setting": asdict(fc.setting),
        "parts_gib": {p: fc.parts[p] / GIB for p in PARTS},
        "total_gib": fc.total / GIB,
        "peak_phase": fc.peak_phase,
        "gpu_memory_gib": fc.gpu_memory / GIB if fc.gpu_memory else None,
        "verdict": verdict(fc),
        "step": step_seconds(fc, fc.gpu_memory),
        "assumptions": {"usable_fraction": USABLE, "bf16_flops": DENSE_BF16_FLOPS, "utilisation": UTILISATION,
                        "decode_bandwidth_efficiency": DECODE_EFFICIENCY},
    }  # fmt: skip


def describe(fc: Forecast) -> str:
    """The table ``papo-nb preflight`` prints."""
    s, d = fc.setting, as_dict(fc)
    engine = "HF model.generate (TRL, no vLLM)"
    if s.use_vllm:
        engine = f"vLLM colocate ({s.vllm_share:.0%} of the GPU)" if s.vllm_mode == "colocate" else "vLLM server"
    lines = [
        f"model {fc.model}: {fc.widths.parameters / 1e9:.2f}B parameters, {fc.widths.layers} layers",
        f"parallelism: {s.processes} process(es), {'FSDP2 sharded' if s.fsdp else 'replicated (DDP or one GPU)'}",
        f"precision: {'bf16' if s.weight_bytes == 2 else 'fp32'} weights, bf16 autocast; "
        f"checkpointing {'on' if s.checkpointing else 'off'}; {'LoRA r ' + str(s.lora_r) if s.lora else 'full'}",
        f"generation: {engine}; micro-batch {s.micro_batch} rows, round {s.round_rows} rows per GPU",
        f"lengths: prompt {s.prompt_tokens} (image {s.patches_per_row} patches), completion {s.completion_tokens}",
        f"memory levers: {', '.join(levers.levers_used(s)) or 'none'}"
        + (f"; CPU memory for offload {fc.host / GIB:.0f} GiB per node" if s.offload else ""),
        "",
        f"{'part (per GPU)':<18}{'GiB':>10}",
    ]
    lines += [f"{p:<18}{d['parts_gib'][p]:>10.2f}" for p in PARTS]
    lines.append(f"{'peak':<18}{d['total_gib']:>10.2f}  (persistent parts + the {fc.peak_phase} phase)")
    v, step = d["verdict"], d["step"]
    if v["fits"] is not None:
        gpu = f"{d['gpu_memory_gib']:.0f} GiB GPU ({USABLE:.0%} usable)"
        lines.append(f"fits on a {gpu}" if v["fits"] else f"does NOT fit on a {gpu}: {refusal_text(fc)}")
    gen = "n/a (vLLM)" if step["generation_s"] is None else f"{step['generation_s']:.0f} s"
    lines.append(
        f"step time: {step['total_s']:.0f} s per optimizer step (training {step['train_s']:.0f} s, extra forwards "
        f"{step['extra_forwards_s']:.0f} s, offload {step['offload_s']:.0f} s over PCIe at "
        f"{levers.PCIE_BYTES_PER_S / 1e9:.0f} GB/s and CPU AdamW, generation {gen})"
        f" at {UTILISATION:.0%} of {DENSE_BF16_FLOPS / 1e12:.0f} "
        "TFLOP/s bf16"
    )
    return "\n".join(lines)


def refusal_text(fc: Forecast) -> str:
    v = verdict(fc)
    return (
        f"the {v['part']} part needs {v['part_gib']:.1f} GiB and the peak {fc.total / GIB:.1f} GiB per GPU, over "
        f"{v['usable_gib']:.1f} GiB usable of the GPU's {fc.gpu_memory / GIB:.1f} GiB; {v['change']}"
    )


def gpu_memory_here() -> float | None:
    """Bytes of the smallest visible GPU: ``PAPO_NB_GPU_MEMORY_GIB`` when set, else torch's, else None."""
    if os.environ.get(GPU_MEMORY_ENV):
        return float(os.environ[GPU_MEMORY_ENV]) * GIB
    import torch

    if torch.cuda.is_available():
        return float(min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))
    return None
