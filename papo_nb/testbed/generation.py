"""Answers from a VLM for chat prompts with images: greedy, or k samples per prompt for avg@k."""

from __future__ import annotations

from papo_nb.testbed.models import vision_special_token_ids


def generate_answers(
    model,
    processor,
    prompts,
    images,
    *,
    max_new_tokens: int = 16,
    batch_size: int = 8,
    samples: int = 1,
    temperature: float | None = None,
    top_p: float = 1.0,
) -> list[str]:
    """Completions for chat prompts, each with one image or a list of images (left-padded batches).

    Greedy by default; with ``temperature`` set, ``samples`` sampled completions per prompt, returned prompt-major
    (prompt 0's samples first), as the avg@k protocol needs them."""
    if temperature is None and samples != 1:
        raise ValueError(f"samples={samples} needs a sampling temperature; greedy decoding gives one completion")
    decoding = (
        {"do_sample": False}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_p": top_p, "num_return_sequences": samples}
    )
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(model.parameters()).device
    outputs = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [
                processor.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                for p in prompts[start : start + batch_size]
            ]
            batch = processor(
                text=texts,
                images=[img if isinstance(img, list) else [img] for img in images[start : start + batch_size]],
                return_tensors="pt",
                padding=True,
            ).to(device)
            generated = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                **decoding,
                suppress_tokens=vision_special_token_ids(processor),
                pad_token_id=tokenizer.pad_token_id,
            )
            outputs += tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return outputs
