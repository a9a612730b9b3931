"""``papo-nb rehearse``: the GPU run of a params file rehearsed on the CPU at true widths, and its forecast held
against the measurement part by part.

A random-weight model is built from the published configuration (``architectures``) with K decoder layers and K
vision blocks, saved with an offline processor (the testbed's tokenizer, the model's real patch and merge sizes), and
trained for two optimizer steps through the params file's own training path: ``prepare_training`` (the builder's
data loading, reward check, ``load_policy``, ``papo_config`` and ``build_trainer``: the PAPOGTrainer with its LoRA
or full fine-tuning, checkpointing, masked branch, prefix sharing and probe as the params set them) and
``trainer.train()``, on rows of the params' schema whose images are exactly ``max_pixels``. Three things differ from
the GPU run, none of them in what the trainer computes: the config asks for bf16 autocast on the CPU
(``use_cpu``), the weights are cast to bf16 after loading (``load_policy`` loads fp32 off CUDA), and the lm_head of
the policy and of TRL's reference model gets its input contiguous (``contiguous_head_input``: on this CPU the
trainer otherwise stalls there). ``rehearsal_measure`` attaches the measurements from outside.
The micro-batch is kept; the completions, the accumulation steps and the round's rows are shortened to fit the CPU,
generation is TRL's ``model.generate`` (no vLLM) (``shortened`` says how). The forecast is computed at the
shortened settings and the rehearsal's model (one process, no FSDP) and set beside the measurement.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from papo_nb.bench.rehearsal_measure import Measurements, TrainerInstruments
from papo_nb.workbook.recipe.architectures import published_config, widths, with_depth
from papo_nb.workbook.recipe.forecast import PARTS, memory_parts, setting

TOLERANCE = 0.15  # the forecast within 15% of the measurement, per part
REHEARSAL_COMPLETION = 16  # generated tokens per completion on the CPU
FORECAST_ONLY = ("recompute",)  # checkpointing's own saved-tensor hooks hide the recomputed layer from the rehearsal's
COMPARED_BELOW = 1024**2  # parts under 1 MiB in both are not held to the tolerance (noise of a few tensors)


def rehearsal_folder(params, layers: int, folder: Path) -> Path:
    """A random-weight bf16 model of ``params``' architecture at ``layers`` depth, and its offline processor."""
    model, processor = rehearsal_model(
        params.model_name_or_path, layers, seed=params.seed, min_pixels=params.min_pixels, max_pixels=params.max_pixels
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def rehearsal_model(model_name_or_path: str, layers: int, *, seed: int, min_pixels: int, max_pixels: int):
    """``(model, processor)``: a random-weight bf16 model of the published configuration of ``model_name_or_path``
    with ``layers`` decoder layers and vision blocks, and the testbed's offline processor with the model's own patch
    and merge sizes, its images bounded by ``min_pixels`` and ``max_pixels``."""
    from transformers import AutoModelForImageTextToText

    from papo_nb.testbed.family_tokens import qwen_vision_token_ids
    from papo_nb.testbed.models import build_tiny_processor

    config = with_depth(published_config(model_name_or_path), layers)
    if config.model_type != "qwen2_5_vl":
        raise ValueError(
            f"parameter 'model_name_or_path' = {model_name_or_path!r}: the rehearsal builds Qwen2.5-VL "
            f"models (its offline processor); allowed: Qwen/Qwen2.5-VL-3B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct"
        )
    processor = build_tiny_processor("qwen2_5_vl")
    tokenizer = processor.tokenizer
    for name, value in qwen_vision_token_ids(tokenizer).items():
        setattr(config, name, value)
    text = config.get_text_config()
    text.bos_token_id = text.pad_token_id = tokenizer.pad_token_id
    text.eos_token_id = tokenizer.eos_token_id
    w = widths(config)
    image = processor.image_processor
    image.patch_size, image.merge_size, image.temporal_patch_size = w.patch, w.merge, w.temporal_patch
    image.size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image.min_pixels, image.max_pixels = min_pixels, max_pixels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, processor


def shortened(params, completion: int) -> tuple[object, dict]:
    """``params`` cut to the CPU: short completions, one micro-batch per optimizer step, as many optimizer steps
    per round as the file has (at most 2), two optimizer steps; the micro-batch kept. Returns (params, what)."""
    per_round = params.steps_per_generation or params.gradient_accumulation_steps
    steps_per_round = min(2, max(1, per_round // params.gradient_accumulation_steps))
    update = {
        "max_completion_length": min(completion, params.max_completion_length),
        "gradient_accumulation_steps": 1,
        "steps_per_generation": steps_per_round,
        "max_steps": 2,
        "num_processes": 1,
        "accelerate_config": "",
        "device": "cpu",
        "use_vllm": False,  # TRL's model.generate: no vLLM on the CPU
        # The forecast is the plain forward's: the memory a run falls back to when "auto" turns sharing off (its
        # first-batch check, a batch it cannot pack); sharing only lowers it (docs/performance.md).
        "prefix_sharing": False,
    }
    changed = {k: {"file": getattr(params, k), "rehearsal": v} for k, v in update.items() if getattr(params, k) != v}
    return params.model_copy(update=update), changed


def rehearsal_rows(params, folder: Path, rows: int = 8) -> dict:
    """A folder of ``rows`` rows in the params' schema (official or own), each with one image of exactly
    ``max_pixels`` (whole 28 x 28 merged patches), and the params' fields that point the data at it."""
    import datasets
    from PIL import Image

    merged = params.max_pixels // 784
    short_side = max(d for d in range(1, int(merged**0.5) + 1) if merged % d == 0)
    size = (28 * (merged // short_side), 28 * short_side)
    # distinct prompts (as a real round's): the masked branch's shared prefix groups rows by prompt and image
    images = [Image.new("RGB", size, (30 * i, 60, 200)) for i in range(rows)]
    questions = [f"<image>How many shapes are there in picture {i}?" for i in range(rows)]
    answers = ["3"] * rows
    if params.dataset_schema == "official":
        table = datasets.Dataset.from_dict({"problem": questions, "answer": answers, "images": [[i] for i in images]})
        table.save_to_disk(str(folder))
        return {"dataset": str(folder), "validation_dataset": str(folder)}
    table = datasets.Dataset.from_dict({"prompt": questions, "image": images, "answer": answers})
    datasets.DatasetDict({params.train_split: table, params.eval_split: table}).save_to_disk(str(folder))
    return {"dataset": str(folder)}


def as_loaded_on_cuda(model) -> None:
    """The weights in the dtype ``load_policy`` gives them on CUDA (bf16; on the CPU it loads fp32): every
    parameter but peft's fp32 adapters, before the optimizer exists."""
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)


def contiguous_head_input(model) -> None:
    """On this CPU (torch 2.14) a bf16 linear whose weight is frozen and whose 3-D input is a slice (transformers'
    ``logits_to_keep``) takes about 90 times longer than on the same input made contiguous: minutes at Qwen's
    vocabulary. The lm_head gets its input contiguous: the same numbers, a copy of the kept positions' states."""
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))


def run_rehearsal(params, layers: int, completion: int = REHEARSAL_COMPLETION) -> dict:
    """Two optimizer steps of ``params`` at ``layers`` depth on the CPU through ``trainer.train()``; the measured
    parts, the forecast at the rehearsal's settings, the phase times and what was shortened."""
    from papo_nb.workbook.training.builder import prepare_training

    short, changed = shortened(params, completion)
    with tempfile.TemporaryDirectory(prefix="papo_nb_rehearsal_") as tmp:
        folder = rehearsal_folder(short, layers, Path(tmp) / "model")
        data = rehearsal_rows(short, Path(tmp) / "rows")
        short = short.model_copy(
            update={"model_name_or_path": str(folder), "n_train_prompts": 8, "n_eval_prompts": 2, **data}
        )
        config = published_config(str(folder))
        s = setting(params, widths(config))
        trainer, _, _ = prepare_training(short, Path(tmp) / "run", bf16=True, use_cpu=True)
        as_loaded_on_cuda(trainer.model)
        for model in (trainer.model, trainer.ref_model):
            if model is not None:
                contiguous_head_input(model)
        measurements = Measurements(config.get_text_config().vocab_size)
        TrainerInstruments(trainer, measurements).attach()
        with measurements.timed("two_optimizer_steps"):
            trainer.train()
    return compare(params, short, s, config, measurements, changed, layers, measurements.lengths)


def compare(params, short, s_file, config, measurements: Measurements, changed: dict, layers: int, lengths) -> dict:
    """The forecast at the rehearsal's settings beside the measurement, part by part."""
    w = widths(config)
    s = replace(
        setting(short, w), checkpointing=s_file.checkpointing, use_vllm=False, **lengths,
    )  # fmt: skip
    forecast_parts = memory_parts(s, w)
    table = {}
    for part in PARTS:
        measured, forecast = measurements.parts.get(part, 0.0), forecast_parts[part]
        small = max(measured, forecast) < COMPARED_BELOW or part in FORECAST_ONLY
        ratio = forecast / measured if measured else (1.0 if not forecast else float("inf"))
        table[part] = {"forecast_bytes": forecast, "measured_bytes": measured, "ratio": ratio,
                       "held": small or abs(ratio - 1) <= TOLERANCE}  # fmt: skip
    return {
        "model": params.model_name_or_path, "layers": layers, "shortened": changed, "lengths": lengths,
        "checkpointing": s.checkpointing, "lora": s.lora, "parts": table,
        "all_held": all(row["held"] for row in table.values()), "seconds": dict(measurements.seconds),
    }  # fmt: skip


def describe(result: dict) -> str:
    lines = [
        f"rehearsal of {result['model']} at {result['layers']} layer(s) ({'LoRA' if result['lora'] else 'full'}, "
        f"checkpointing {'on' if result['checkpointing'] else 'off'}); lengths {result['lengths']}",
        "shortened: " + ", ".join(f"{k} {v['file']} -> {v['rehearsal']}" for k, v in result["shortened"].items()),
        f"{'part':<18}{'forecast MiB':>14}{'measured MiB':>14}{'ratio':>8}  held",
    ]
    for part, row in result["parts"].items():
        lines.append(
            f"{part:<18}{row['forecast_bytes'] / 2**20:>14.1f}{row['measured_bytes'] / 2**20:>14.1f}"
            f"{row['ratio']:>8.2f}  {'yes' if row['held'] else 'NO'}"
        )
    lines.append("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result["seconds"].items()))
    return "\n".join(lines)


def rehearse_command(params_file: str, overrides: list[str], layers: list[int], json_file: str | None) -> int:
    from papo_nb.workbook.config.params import ParamsError, load_params

    try:
        params = load_params(params_file, overrides)
        results = [run_rehearsal(params, k) for k in layers]
    except (ParamsError, ValueError) as exc:
        print(f"papo-nb rehearse: error: {exc}", flush=True)
        return 2
    for result in results:
        print(describe(result), flush=True)
    if json_file:
        Path(json_file).write_text(json.dumps(results, indent=1))
    return 0 if all(r["all_held"] for r in results) else 1
