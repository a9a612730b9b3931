"""Tiny offline Qwen-VL models for CPU tests and the real-checkpoint loader (LoRA and trainer configs: the builder).

`build_tiny_vlm` makes a Qwen2-VL / Qwen2.5-VL of a few hundred thousand parameters with a BPE
tokenizer trained on the shapes task, entirely offline, and caches it on disk. `load_vlm` is the one
code path for both that folder and a real hub checkpoint, so notebooks switch models by name only.
`write_family_vlm` saves a tiny model of the other families from its processor and config (``families.py``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tok_models
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from papo_nb.testbed import families, family_tokens
from papo_nb.testbed.shapes import task_corpus

# Bump when the tiny model's recipe changes, so old caches are not reused.
BUILDER_VERSION = 1
COMPLETE_MARKER = ".papo_nb_build_complete"

FAMILIES = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor),
}

QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Tokens that only the processor may place: a sampled <|image_pad|> breaks the next forward.
VISION_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

TOKENIZER_VOCAB_SIZE = 384
IMAGE_PIXELS = 112 * 112  # a 112x112 image stays 8x8 patches of 14 px = 16 merged image tokens

# Qwen-style ChatML without the default system prompt (it would cost tokens on every CPU step).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- endif -%}"
)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not supported; allowed values: {list(TINY_FAMILIES)}")


# Every name `build_tiny_vlm` accepts: the Qwen2 families here, the others in testbed/families.py.
TINY_FAMILIES = (*FAMILIES, *families.FAMILIES)


def default_cache_root() -> Path:
    return Path(os.environ.get("PAPO_NB_CACHE") or Path.home() / ".cache" / "papo_nb").expanduser()


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the task's own strings; every byte stays encodable."""
    corpus = task_corpus() + ["user", "assistant", "system", "\n"]
    backend = Tokenizer(tok_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_processor(family: str = "qwen2_vl") -> Qwen2VLProcessor:
    _check_family(family)
    pixel_bounds = {"shortest_edge": 56 * 56, "longest_edge": IMAGE_PIXELS}
    image_processor = Qwen2VLImageProcessor(size=pixel_bounds)
    video_processor = Qwen2VLVideoProcessor(size=pixel_bounds)  # the processor refuses None
    processor_cls = FAMILIES[family][2]
    return processor_cls(
        image_processor=image_processor,
        tokenizer=build_tiny_tokenizer(),
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


# Model sizes `build_tiny_vlm` can make. "tiny" (the default, a few hundred thousand parameters) is the test
# model; "vllm" the same with heads vLLM's CPU backend runs; "wide" (about 30 million) is for CPU benchmarks where
# the transformer's compute dominates the step.
SIZES = {
    "tiny": dict(
        hidden=64,
        intermediate=128,
        layers=2,
        heads=4,
        kv_heads=2,
        mrope=[2, 3, 3],
        vision_depth=2,
        vision_width=32,
        vision_heads=2,
        vision_mlp_ratio=2,
    ),
    "wide": dict(
        hidden=512,
        intermediate=1536,
        layers=8,
        heads=8,
        kv_heads=4,
        mrope=[8, 12, 12],
        vision_depth=4,
        vision_width=256,
        vision_heads=4,
        vision_mlp_ratio=4,
    ),
}
# "vllm": "tiny" with 2 attention heads of 32 (mrope over 16 frequencies): vLLM's CPU attention takes head sizes 32 to
# 512 only (the vLLM tier, tests/test_vllm_rollouts.py).
SIZES["vllm"] = {**SIZES["tiny"], "heads": 2, "kv_heads": 1, "mrope": [4, 6, 6]}


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not a tiny-model size; allowed values: {sorted(SIZES)}")


def tiny_config(family: str, tokenizer: PreTrainedTokenizerFast, size: str = "tiny"):
    """A config of a few hundred thousand parameters (``size="wide"``: about 30 million), with special ids
    wired to `tokenizer`."""
    _check_family(family)
    _check_size(size)
    dims = SIZES[size]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": dims["hidden"],
        "intermediate_size": dims["intermediate"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(dims["mrope"])},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    width, depth, heads = dims["vision_width"], dims["vision_depth"], dims["vision_heads"]
    if family == "qwen2_vl":
        # Qwen2-VL: `hidden_size` of the vision config is the merger's output = text hidden size.
        vision_config = {
            "depth": depth,
            "embed_dim": width,
            "hidden_size": dims["hidden"],
            "num_heads": heads,
            "mlp_ratio": dims["vision_mlp_ratio"],
        }
    else:
        # Qwen2.5-VL: `hidden_size` is the vision width; `out_hidden_size` feeds the text model.
        vision_config = {
            "depth": depth,
            "hidden_size": width,
            "intermediate_size": width * dims["vision_mlp_ratio"],
            "num_heads": heads,
            "out_hidden_size": dims["hidden"],
            "window_size": 112,
            "fullatt_block_indexes": [depth - 1],
        }
    config_cls = FAMILIES[family][0]
    return config_cls(
        text_config=text_config,
        vision_config=vision_config,
        **family_tokens.qwen_vision_token_ids(tokenizer),
    )


def _write_tiny_vlm(family: str, seed: int, folder: Path, size: str = "tiny") -> None:
    processor = build_tiny_processor(family)
    config = tiny_config(family, processor.tokenizer, size=size)
    model_cls = FAMILIES[family][1]
    # fork_rng keeps the caller's global RNG untouched while making init depend on `seed` only.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.generation_config.bos_token_id = config.text_config.bos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)


def write_family_vlm(family: str, seed: int, folder: Path, size: str = "tiny") -> None:
    """Save a tiny ``family`` model (init seeded by ``seed``, global RNG untouched) and its processor to ``folder``;
    ``size="vllm"``: with heads vLLM's CPU backend runs (``families.vllm_sized``)."""
    spec = families.FAMILIES[family]
    processor, config = spec.build()
    if size == "vllm":
        families.vllm_sized(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.model_cls(config)
        # Gemma3 zero-initialises its image projection (modeling_gemma3.py, _init_weights), so a fresh model's
        # logits ignore the image: a build that cannot see is broken. Any all-zero matrix gets a small random init.
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1 and not parameter.any():
                    parameter.normal_(0.0, 0.02)
    ids = family_tokens.chatml_token_ids(processor.tokenizer)
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.generation_config.bos_token_id = ids["bos_token_id"]
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)


def build_tiny_vlm(
    family: str = "qwen2_vl", seed: int = 0, cache_dir: str | Path | None = None, size: str = "tiny"
) -> Path:
    """Build (or reuse) a tiny offline VLM and return its folder, loadable with `load_vlm`.

    ``family`` is any of ``TINY_FAMILIES``: Qwen2-VL / Qwen2.5-VL here, the other families (Qwen3-VL, Idefics3,
    SmolVLM, Gemma3, LFM2-VL and their tiled variants) from ``testbed/families.py``.

    ``size`` is ``"tiny"`` (default: the test model) or ``"wide"`` (about 30M parameters, for CPU benchmarks);
    each size has its own cache folder (``tiny-...`` / ``wide-...``). The folder is written under a temporary name
    and renamed once complete, with a marker file written last; a folder without the marker is treated as
    half-written and rebuilt.
    """
    _check_size(size)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    if family in families.FAMILIES:  # the other families (testbed/families.py): tiny, and vllm for VLLM_SIZED
        allowed = ("tiny", "vllm") if family in families.VLLM_SIZED else ("tiny",)
        if size not in allowed:
            raise ValueError(f"size={size!r} is not available for family={family!r}; allowed: {allowed}")
        folder = root / f"{size}-{family}-seed{seed}-v{families.BUILDER_VERSION}"
        return build_cached(
            folder,
            lambda staging: write_family_vlm(family, seed, staging, size=size),
            f"family={family} seed={seed} size={size} version={families.BUILDER_VERSION}",
        )
    _check_family(family)
    folder = root / f"{size}-{family}-seed{seed}-v{BUILDER_VERSION}"
    return build_cached(
        folder,
        lambda staging: _write_tiny_vlm(family, seed, staging, size=size),
        f"family={family} seed={seed} size={size} version={BUILDER_VERSION}",
    )


def build_cached(folder: Path, write: Callable[[Path], None], marker_text: str) -> Path:
    """Return ``folder`` if complete, else ``write`` it under a temporary name and rename it into place.

    The marker file is written last; a folder without it is half-written (an interrupted build) and rebuilt.
    """
    if (folder / COMPLETE_MARKER).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.building-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        write(staging)
        (staging / COMPLETE_MARKER).write_text(marker_text + "\n")
        if folder.exists() and not (folder / COMPLETE_MARKER).exists():
            shutil.rmtree(folder)  # a half-written folder from an interrupted build
        try:
            staging.rename(folder)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not (folder / COMPLETE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _resolve_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name; use e.g. 'float32', 'bfloat16' or 'auto'")
    return resolved


def load_vlm(name_or_path: str | Path, dtype: str | torch.dtype = "float32", device_map=None):
    """Load `(model, processor)` from a hub id or a local folder (e.g. one from `build_tiny_vlm`).

    The model class comes from the config: Qwen2-VL / Qwen2.5-VL get their own classes, anything else
    goes through `AutoModelForImageTextToText`.
    """
    name = str(name_or_path)
    path = Path(name).expanduser()
    # Hub ids are "name" or "org/name"; anything else is a local path and must exist.
    looks_local = (
        isinstance(name_or_path, Path) or name.startswith(("/", ".", "~")) or name.count("/") > 1 or path.exists()
    )
    if looks_local:
        if not path.is_dir():
            raise FileNotFoundError(f"name_or_path={name!r} is not an existing local folder")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"name_or_path={name!r} has no config.json; is it a saved model folder?")
        name = str(path)

    config = AutoConfig.from_pretrained(name)
    model_cls = FAMILIES[config.model_type][1] if config.model_type in FAMILIES else AutoModelForImageTextToText
    model = model_cls.from_pretrained(name, dtype=_resolve_dtype(dtype), device_map=device_map)
    processor = AutoProcessor.from_pretrained(name)
    return model, processor


def vision_special_token_ids(processor_or_tokenizer) -> list[int]:
    """Ids of the vision placeholder tokens, for `generation_kwargs={"suppress_tokens": ...}`."""
    tokenizer = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
    vocab = tokenizer.get_vocab()
    names = set(VISION_SPECIAL_TOKENS) | set(family_tokens.FAMILY_VISION_TOKENS)
    return sorted(vocab[t] for t in names if t in vocab)
