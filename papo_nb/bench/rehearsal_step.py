"""The rehearsal's training step, phase by phase, as TRL 1.9.1 runs it for one GPU process, each phase measured
(``rehearsal_measure``): the round generated in one ``model.generate``, TRL's reference model (fp32, full fine-tuning
with beta > 0) and its no-grad forward, the masked branch's no-grad forward, and per micro-batch the loss forward
under bf16 autocast (the logits converted to fp32 as accelerate's ``convert_outputs_to_fp32`` does, divided by the
temperature, TRL's ``selective_log_softmax``), its backward and an AdamW step (TRL's default optimizer), twice.
LoRA comes from the builder's ``lora_config`` (peft keeps the adapters in fp32), checkpointing as the params set it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from papo_nb.bench.rehearsal_measure import Measurements, nested_tensors, storage_bytes


def policy(params, folder: Path, lora: bool, checkpointing: bool):
    from peft import get_peft_model

    from papo_nb.testbed.models import load_vlm
    from papo_nb.workbook.training.builder import lora_config

    model, processor = load_vlm(folder, dtype="bfloat16")
    # On this CPU (torch 2.14) a bf16 linear whose weight is frozen and whose 3-D input is a slice (transformers'
    # logits_to_keep) takes about 90 times longer than on the same input made contiguous: minutes at Qwen's
    # vocabulary. Contiguous input to the lm_head: the same numbers, a copy of the kept positions' hidden states.
    model.get_output_embeddings().register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    if lora:
        model = get_peft_model(model, lora_config(params, model))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model.enable_input_require_grads()
    return model.train(), processor


def round_inputs(params, processor, rows: int):
    """The round's prompts: the params' format, one image per row at ``max_pixels``."""
    from PIL import Image

    side = int(params.max_pixels**0.5)
    image = Image.new("RGB", (side, side), (120, 60, 200))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes are there?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return processor(text=[text] * rows, images=[image] * rows, return_tensors="pt", padding=True)


def generate_round(model, inputs, completion: int, m: Measurements):
    from papo_nb.bench.memory import allocation_peak

    out = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), m.timed("generation"):
        peak = allocation_peak(
            lambda: out.setdefault(
                "ids", model.generate(**inputs, max_new_tokens=completion, min_new_tokens=completion, do_sample=True)
            )
        )
    m.peak("generation", peak["peak_bytes"])
    return out["ids"]


def logps(model, batch: dict, completion: int, temperature: float, seen: dict | None = None):
    """TRL 1.9.1's ``_get_per_token_logps_and_entropies`` on one micro-batch, under accelerate's autocast wrapper;
    ``seen`` collects the bytes of the bf16 logits, their fp32 copy and (after backward) their gradients."""
    from trl.trainer.utils import selective_log_softmax

    with torch.autocast("cpu", dtype=torch.bfloat16):
        source = model(**batch, logits_to_keep=completion + 1).logits
    logits = source.float()  # accelerate's convert_outputs_to_fp32
    if seen is not None:
        seen.update(source=storage_bytes([source]), copy=storage_bytes([logits]))
        if logits.requires_grad:
            logits.register_hook(lambda g: seen.__setitem__("grad", storage_bytes([g])))
            source.register_hook(lambda g: seen.__setitem__("source_grad", storage_bytes([g])))
    logits = logits[:, :-1, :]  # TRL drops the last position
    logits.div_(temperature)
    return selective_log_softmax(logits, batch["input_ids"][:, -completion:])


def micro_batches(inputs, ids, rows: int):
    """The round's rows split into micro-batches of ``rows`` (prompt and completion ids, pixels by image)."""
    patches = inputs["image_grid_thw"].prod(-1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), patches.cumsum(0)])
    for first in range(0, ids.shape[0], rows):
        last = min(first + rows, ids.shape[0])
        yield {
            "input_ids": ids[first:last],
            "attention_mask": torch.ones_like(ids[first:last]),
            "pixel_values": inputs["pixel_values"][starts[first] : starts[last]],
            "image_grid_thw": inputs["image_grid_thw"][first:last],
        }


def masked(batch: dict, ratio: float, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(batch["pixel_values"].shape[0], 1, generator=generator) >= ratio
    return {**batch, "pixel_values": batch["pixel_values"] * keep}


def rehearse_step(params, folder: Path, lora: bool, checkpointing: bool, m: Measurements) -> dict:
    """Two optimizer steps of ``params`` (already shortened) on the model in ``folder``; returns the lengths."""
    model, processor = policy(params, folder, lora, checkpointing)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=params.learning_rate)
    exclude = m.parameter_storages(model)
    rows, completion = params.per_device_train_batch_size, params.max_completion_length
    per_round = rows * (params.steps_per_generation or params.gradient_accumulation_steps)
    inputs = round_inputs(params, processor, per_round)
    ids = generate_round(model, inputs, completion, m)
    m.peak("round_tensors", storage_bytes([ids, torch.ones_like(ids), *nested_tensors(dict(inputs))]))
    if params.beta > 0 and not lora:
        from papo_nb.testbed.models import load_vlm

        reference, _ = load_vlm(folder, dtype="float32")  # TRL: create_model_from_path, float32 by default
        m.peak("reference", storage_bytes(reference.parameters()))
        with torch.no_grad(), m.timed("reference_forward"):
            for batch in micro_batches(inputs, ids, rows):
                logps(reference, batch, completion, params.temperature)
        del reference
    batches = list(micro_batches(inputs, ids, rows))
    if params.perception_loss_weight > 0:
        for batch in batches:
            seen = {}
            with torch.no_grad(), m.timed("masked_forward"):
                logps(model, masked(batch, params.mask_ratio, params.seed), completion, params.temperature, seen)
            m.peak("masked_forward", seen["source"] + seen["copy"])
    for step in range(2):
        batch, seen = batches[step % len(batches)], {}
        with m.timed("loss_forward"), m.saved_activations(exclude) as saved_vocab:
            loss = -logps(model, batch, completion, params.temperature, seen).mean()
        with m.timed("backward"):
            loss.backward()
        # at the backward's start: what the forward saved, the fp32 gradient and its bf16 cast
        m.peak("logprob_forward", sum(saved_vocab.values()) + seen["grad"] + seen["source_grad"])
        m.peak("gradients", storage_bytes(p.grad for p in trainable if p.grad is not None))
        with m.timed("optimizer_step"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    m.peak("optimizer", storage_bytes(nested_tensors(list(optimizer.state.values()))))
    m.peak("weights", storage_bytes(model.parameters()))
    patches = int(inputs["image_grid_thw"].prod(-1).max())
    return {"prompt_tokens": int(inputs["input_ids"].shape[1]), "patches_per_row": patches}
