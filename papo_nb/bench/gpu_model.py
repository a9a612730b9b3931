"""The GPU check's model: a randomly initialised Qwen2.5-VL-3B-shaped model (or its --cpu-dry-run miniature) with
LoRA, its processor, and the benchmark trainers and batch around it (``benchmarks/gpu_check.py``).

Offline: the config is written out here (the 3B text and vision shapes, depth a parameter), the tokenizer is the
testbed's; nothing is downloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from papo_nb.bench import harness

# Qwen2.5-VL-3B shapes (text and vision); depth is a parameter.
TEXT_3B = dict(
    hidden_size=2048,
    intermediate_size=11008,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)
VISION_3B = dict(
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=2048,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    in_channels=3,
    hidden_act="silu",
)
# --cpu-dry-run: the same code path at test-model sizes.
TEXT_TINY = dict(
    TEXT_3B,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    vocab_size=1024,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
VISION_TINY = dict(VISION_3B, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def model_config(processor, *, tiny: bool, text_layers: int, vision_depth: int):
    from transformers import Qwen2_5_VLConfig

    from papo_nb.testbed.family_tokens import qwen_vision_token_ids

    tokenizer = processor.tokenizer
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    text = dict(
        TEXT_TINY if tiny else TEXT_3B,
        num_hidden_layers=text_layers,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        VISION_TINY if tiny else VISION_3B,
        depth=vision_depth,
        fullatt_block_indexes=[i for i in range(vision_depth) if i % 8 == 7] or [vision_depth - 1],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        **qwen_vision_token_ids(tokenizer),
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def build_processor(image_size: int):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from papo_nb.testbed.models import CHAT_TEMPLATE, build_tiny_tokenizer

    bounds = {"shortest_edge": 56 * 56, "longest_edge": image_size * image_size}
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=bounds),
        tokenizer=build_tiny_tokenizer(),
        video_processor=Qwen2VLVideoProcessor(size=bounds),
        chat_template=CHAT_TEMPLATE,
    )


def check_batch(processor, args, vocab_size: int, device: torch.device, *, seed: int) -> dict:
    """The check's ``_compute_loss`` batch: ``--sequences`` shapes-task prompts with ``--image-size`` px images and
    ``--completion-tokens`` random completion tokens, drawn with ``seed``."""
    return harness.synthetic_batch(
        processor,
        args.sequences,
        args.completion_tokens,
        vocab_size=vocab_size,
        image_size=args.image_size,
        seed=seed,
        device=device,
    )


def random_model(args, device: torch.device, dtype: torch.dtype, processor):
    """The randomly initialised Qwen2.5-VL model of the check's shapes, on ``device`` in ``dtype`` (no LoRA yet)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = model_config(
        processor, tiny=args.cpu_dry_run, text_layers=args.text_layers, vision_depth=args.vision_depth
    )
    torch.manual_seed(args.seed)
    with torch.device(device):  # initialise on the device: a CPU init of billions of parameters takes minutes
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.to(dtype)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    return model


def build_gpu_setup(
    args, device: torch.device, dtype: torch.dtype, work_dir: Path, log: Callable[[str], None]
) -> harness.BenchSetup:
    """The check's model with LoRA, a GRPO and two PAPO-G trainers on it, and the check's batch."""
    from peft import get_peft_model
    from trl import GRPOTrainer

    from papo_nb.testbed.shapes import make_shapes_dataset
    from papo_nb.workbook.training.builder import lora_config

    started = time.perf_counter()
    processor = build_processor(args.image_size)
    model = random_model(args, device, dtype, processor)
    n_params = sum(p.numel() for p in model.parameters())
    # the benchmark's trainer settings, with this check's LoRA rank; batch, length and precision are set below
    settings = harness.bench_params(args.seed, lora_r=args.lora_r, lora_alpha=2 * args.lora_r)
    model = get_peft_model(model, lora_config(settings))
    model.to(device)
    log(
        f"model: {n_params / 1e6:.1f}M parameters ({args.text_layers} text layers, vision depth {args.vision_depth}), "
        f"{dtype}, on {device}"
    )
    dataset = make_shapes_dataset(8, seed=args.seed)
    setup = harness.BenchSetup(
        "gpu", "qwen2_5_vl", args.seed, model, processor, dataset, settings, work_dir, n_params, started
    )
    overrides = dict(
        per_device_train_batch_size=args.sequences,
        num_generations=4,
        max_completion_length=args.completion_tokens,
        bf16=dtype == torch.bfloat16 and device.type == "cuda",
        use_cpu=device.type == "cpu",
    )
    setup.trainers = {
        "grpo": setup.trainer("grpo", GRPOTrainer, **overrides),
        "papo": setup.trainer("papo", masked_branch="update", **overrides),
        "papo_grad": setup.trainer("papo_grad", masked_branch="update", masked_branch_grad=True, **overrides),
    }
    vocab = model.config.text_config.vocab_size
    return setup.ready(check_batch(processor, args, vocab, device, seed=args.seed), lr=1e-5)
