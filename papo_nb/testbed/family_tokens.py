"""The tokens of every tiny family (``papo_nb.testbed.families``): each family's image placeholder and structure
tokens, a ChatML template that places the placeholder, and a byte-level BPE trained on the shapes task with them.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tok_models
from transformers import PreTrainedTokenizerFast

from papo_nb.testbed.shapes import task_corpus

VOCAB_SIZE = 448
CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Every family's image placeholder and structure tokens: only the processor may place them (a sampled one breaks
# the next forward), so generation suppresses them (models.vision_special_token_ids).
IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
GEMMA3_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
GEMMA4_NAMED = {  # Gemma4Processor reads all six off the tokenizer (audio ones too: validate_inputs needs them)
    "boi_token": "<|image>",
    "image_token": "<|image|>",
    "eoi_token": "<image|>",
    "boa_token": "<|audio>",
    "audio_token": "<|audio|>",
    "eoa_token": "<audio|>",
}
GEMMA4_TOKENS = [*GEMMA4_NAMED.values(), "<|video|>"]  # the processor registers <|video|> itself
LFM2_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{i}_col_{j}|>" for i in range(1, 11) for j in range(1, 11)
]
LLAVA_TOKENS = ["<image>"]
ONEVISION_TOKENS = ["<image>", "<video>"]
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
FAMILY_VISION_TOKENS = sorted(
    set(
        IDEFICS_TOKENS
        + GEMMA3_TOKENS
        + GEMMA4_TOKENS
        + LFM2_TOKENS
        + ONEVISION_TOKENS
        + PIXTRAL_TOKENS
        + QWEN_VISION_TOKENS
    )
)


def chat_template(image_placeholder: str) -> str:
    """ChatML without a system prompt; an image part becomes the family's placeholder (its processor expands it)."""
    return (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
        "{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}{{- '" + image_placeholder + "' -}}"
        "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
    )


def family_tokenizer(vision_tokens: list[str], named: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the task's strings, with ChatML tokens and the family's vision tokens."""
    specials = CHAT_TOKENS + [t for t in vision_tokens if t not in CHAT_TOKENS]
    backend = Tokenizer(tok_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE + len(specials),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(task_corpus() + ["user", "assistant", "\n"], trainer)
    extra = named or [t for t in specials if t not in ("<|endoftext|>", "<|im_end|>")]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        extra_special_tokens=extra,
        padding_side="left",
    )
    if named:  # named tokens become attributes (boi_token, ...); the rest must still be special
        tokenizer.add_special_tokens({"additional_special_tokens": specials[3:]})
    return tokenizer


def chatml_token_ids(tokenizer) -> dict[str, int]:
    """The ChatML bos/eos/pad ids every family's config carries, wired to ``tokenizer``."""
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|im_start|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def qwen_vision_token_ids(tokenizer) -> dict[str, int]:
    """The Qwen-VL configs' vision token fields (image, video, vision start/end), wired to ``tokenizer``."""
    fields = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in fields.items()}
