"""Tiny offline VLMs of the other families TRL 1.9.1 trains: Qwen3-VL, Idefics3, SmolVLM, Gemma3, Gemma4, LFM2-VL,
LLaVA, Mistral3, LLaVA-NeXT, LLaVA-OneVision.

As for Qwen2-VL (``models.py``), everything is made locally: a byte-level BPE trained on the shapes task with the
family's own special tokens, a ChatML-style template that places the family's image token, the family's own image
processor with small sizes, and a config of a few hundred thousand parameters. ``*_tiled`` variants split images into
tiles (Idefics3/SmolVLM image splitting, LFM2-VL tiling with a thumbnail), so batches carry padded tiles.

Each family produces the image layout named in ``papo_nb/papo/layouts.py``. Here each family is its processor and
config (``FAMILIES``); ``models.write_family_vlm`` initialises and saves one.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import (
    CLIPImageProcessor,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessor,
    Idefics3Processor,
    Lfm2VlConfig,
    Lfm2VlForConditionalGeneration,
    Lfm2VlImageProcessor,
    Lfm2VlProcessor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    LlavaProcessor,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralImageProcessor,
    PixtralProcessor,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessor,
    SmolVLMProcessor,
    SmolVLMVideoProcessor,
)

from papo_nb.testbed.family_tokens import (
    GEMMA3_TOKENS,
    GEMMA4_NAMED,
    GEMMA4_TOKENS,
    IDEFICS_TOKENS,
    LFM2_TOKENS,
    LLAVA_TOKENS,
    ONEVISION_TOKENS,
    PIXTRAL_TOKENS,
    QWEN_VISION_TOKENS,
    chat_template,
    chatml_token_ids,
    family_tokenizer,
    qwen_vision_token_ids,
)

BUILDER_VERSION = 2  # 2: Gemma3 without the vision attention-pooling head, as the hub checkpoint
TEXT = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
VISION = dict(width=32, depth=2, heads=2, intermediate=64)


def _llama_text(tokenizer, **extra) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT["hidden"],
        "intermediate_size": TEXT["intermediate"],
        "num_hidden_layers": TEXT["layers"],
        "num_attention_heads": TEXT["heads"],
        "num_key_value_heads": TEXT["kv_heads"],
        "max_position_embeddings": 2048,
        **chatml_token_ids(tokenizer),
        **extra,
    }


def _siglip(image_size: int | None, patch_size: int, **extra) -> dict:
    """A small vision tower's fields; ``image_size=None`` for a tower without a fixed size (Gemma4)."""
    return {
        "hidden_size": VISION["width"],
        "intermediate_size": VISION["intermediate"],
        "num_hidden_layers": VISION["depth"],
        "num_attention_heads": VISION["heads"],
        **({} if image_size is None else {"image_size": image_size}),
        "patch_size": patch_size,
        **extra,
    }


def vllm_sized(config) -> None:
    """``config``'s text attention with 2 heads of 32 (mrope over 16 frequencies): vLLM's CPU attention takes head
    sizes 32 to 512 (``build_tiny_vlm(family, size="vllm")``, the vLLM tier); families in ``VLLM_SIZED`` only."""
    text = config.text_config
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 2, 1, 32
    text.rope_parameters["mrope_section"] = [4, 6, 6]


# ---- one builder per family: () -> (processor, config) ----
def _qwen3_vl():
    tokenizer = family_tokenizer(QWEN_VISION_TOKENS)
    bounds = {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}  # 112 px -> 7x7 patches of 16 -> 128 px: 8x8
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            patch_size=16, merge_size=2, size=bounds, image_mean=[0.5] * 3, image_std=[0.5] * 3
        ),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(size=bounds),
        chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
    text = _llama_text(tokenizer, head_dim=16)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text["mrope_interleaved"] = True
    vision = {
        "depth": VISION["depth"],
        "hidden_size": VISION["width"],
        "intermediate_size": VISION["intermediate"],
        "num_heads": VISION["heads"],
        "out_hidden_size": TEXT["hidden"],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    }
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        **qwen_vision_token_ids(tokenizer),
        tie_word_embeddings=False,
    )
    return processor, config


def _idefics(smol: bool, tiled: bool):
    tile, patch, scale = 64, 16, 2  # a 64-px tile is 4x4 patches, 4 image tokens after the 2x pixel shuffle
    tokenizer = family_tokenizer(IDEFICS_TOKENS)
    sizes = dict(
        do_image_splitting=tiled,
        size={"longest_edge": 2 * tile if tiled else tile},
        max_image_size={"longest_edge": tile},
    )
    seq_len = (tile // patch) ** 2 // scale**2
    template = chat_template("<image>")
    if smol:
        processor = SmolVLMProcessor(
            image_processor=SmolVLMImageProcessor(**sizes),
            tokenizer=tokenizer,
            video_processor=SmolVLMVideoProcessor(),
            image_seq_len=seq_len,
            chat_template=template,
        )
    else:
        processor = Idefics3Processor(
            image_processor=Idefics3ImageProcessor(**sizes),
            tokenizer=tokenizer,
            image_seq_len=seq_len,
            chat_template=template,
        )
    config_cls = SmolVLMConfig if smol else Idefics3Config
    config = config_cls(
        text_config={"model_type": "llama", **_llama_text(tokenizer)},
        vision_config=_siglip(tile, patch),
        scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
        **chatml_token_ids(tokenizer),
    )
    return processor, config


def _gemma3():
    image, patch, tokens = 56, 14, 4  # 4x4 patches pooled 2x2 into 4 soft tokens
    named = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = family_tokenizer(GEMMA3_TOKENS, named=named)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": image, "width": image}),
        tokenizer=tokenizer,
        image_seq_length=tokens,
        chat_template=chat_template("<start_of_image>"),
    )
    text = _llama_text(tokenizer, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
    config = Gemma3Config(
        text_config=text,
        vision_config=_siglip(image, patch, vision_use_head=False),  # as gemma-3: no attention-pooling head
        mm_tokens_per_image=tokens,
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        tie_word_embeddings=False,
    )
    return processor, config


def _gemma4():
    # As gemma-4-E2B (the checkpoint TRL's tiny Gemma4 copies): 16-px patches pooled 3x3 by position into soft
    # tokens, clipped vision linears, no standardisation, per-layer inputs, causal attention over image tokens. The
    # smallest soft-token budget (70) still pads each image to 630 patch rows: 576 real for a square image.
    patch, pooling, budget = 16, 3, 70
    tokenizer = family_tokenizer(GEMMA4_TOKENS, named=GEMMA4_NAMED)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),  # required, like the video processor; neither is used
        image_processor=Gemma4ImageProcessor(patch_size=patch, max_soft_tokens=budget, pooling_kernel_size=pooling),
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(),
        image_seq_length=budget,
        chat_template=chat_template("<|image|>"),
    )
    text = _llama_text(tokenizer, head_dim=16, global_head_dim=16, sliding_window=64, final_logit_softcapping=30.0)
    text |= {"layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 16}
    text["vocab_size_per_layer_input"] = len(tokenizer)
    vision = _siglip(None, patch, head_dim=VISION["width"] // VISION["heads"], num_key_value_heads=VISION["heads"])
    vision |= {"pooling_kernel_size": pooling, "use_clipped_linears": True, "standardize": False}
    vision["position_embedding_size"] = budget * pooling**2  # an x or y index per possible patch row
    token_fields = {
        "image_token_id": "<|image|>",
        "boi_token_id": "<|image>",
        "eoi_token_id": "<image|>",
        "video_token_id": "<|video|>",
        "audio_token_id": "<|audio|>",
        "boa_token_id": "<|audio>",
        "eoa_token_index": "<audio|>",
    }
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        tie_word_embeddings=False,
        **{field: tokenizer.convert_tokens_to_ids(token) for field, token in token_fields.items()},
    )
    return processor, config


def _lfm2_vl(tiled: bool):
    patch = 16
    tokenizer = family_tokenizer(LFM2_TOKENS)
    image_processor = Lfm2VlImageProcessor(
        do_image_splitting=tiled,
        tile_size=64,
        encoder_patch_size=patch,
        downsample_factor=2,
        min_image_tokens=4,
        max_image_tokens=9 if tiled else 16,  # a 112-px image: 16 tokens without tiling; 2x2 tiles + thumbnail
        max_pixels_tolerance=1.0,
        min_tiles=2,
        max_tiles=4,
        use_thumbnail=True,
    )
    processor = Lfm2VlProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template("<image>")
    )
    text = _llama_text(tokenizer, layer_types=["full_attention", "conv"], conv_L_cache=3)
    config = Lfm2VlConfig(
        text_config={"model_type": "lfm2", **text},
        vision_config={"model_type": "siglip2_vision_model", **_siglip(64, patch, num_patches=64)},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        downsample_factor=2,
        projector_hidden_size=64,
        tie_word_embeddings=False,
    )
    return processor, config


def _clip_llava(processor_cls, image_processor, config_cls, **config_fields):
    """LLaVA and LLaVA-NeXT: a 56-px CLIP (4x4 patches of 14 + a CLS that "default" drops: 16 image tokens)."""
    image, patch = 56, 14
    tokenizer = family_tokenizer(LLAVA_TOKENS)
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=chat_template("<image>"),
    )
    vision = {"model_type": "clip_vision_model", **_siglip(image, patch, projection_dim=TEXT["hidden"])}
    config = config_cls(
        text_config={"model_type": "llama", **_llama_text(tokenizer)},
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        **config_fields,
    )
    return processor, config


def _llava():
    image_processor = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    return _clip_llava(LlavaProcessor, image_processor, LlavaConfig, vision_feature_layer=-1)


# Any-resolution grids: a 56-px crop (4x4 CLIP/SigLIP patches of 14) and crop grids up to 2x2, so the square image
# gets a base view + 4 crops and the wide one a base view + 2 crops (with letterbox): a padded crop list.
ANYRES_CROP, ANYRES_PINPOINTS = 56, [[56, 112], [112, 56], [112, 112]]


def _llava_next():
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": ANYRES_CROP},
        crop_size={"height": ANYRES_CROP, "width": ANYRES_CROP},
        image_grid_pinpoints=ANYRES_PINPOINTS,
    )
    # as llava-v1.6: features from layer -2, so the last CLIP layer and post_layernorm get no gradient
    return _clip_llava(
        LlavaNextProcessor,
        image_processor,
        LlavaNextConfig,
        image_grid_pinpoints=ANYRES_PINPOINTS,
        vision_feature_layer=-2,
    )


def _llava_onevision():
    image, patch = ANYRES_CROP, 14  # SigLIP without a CLS, "full" features, as llava-onevision is configured
    tokenizer = family_tokenizer(ONEVISION_TOKENS)
    image_processor = LlavaOnevisionImageProcessor(
        size={"height": image, "width": image}, image_grid_pinpoints=ANYRES_PINPOINTS
    )
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": image, "width": image}),
        num_image_tokens=(image // patch) ** 2,
        vision_feature_select_strategy="full",
        chat_template=chat_template("<image>"),
    )
    # the hub checkpoint takes the vision tower's last hidden state without its attention-pooling head
    vision = {"model_type": "siglip_vision_model", **_siglip(image, patch, vision_use_head=False)}
    config = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **_llama_text(tokenizer)},
        vision_config=vision,
        image_grid_pinpoints=ANYRES_PINPOINTS,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    return processor, config


def _mistral3():
    patch, merge = 16, 2  # a 64-px image: 4x4 patches, 2x2 tokens after the merge; smaller images are padded
    tokenizer = family_tokenizer(PIXTRAL_TOKENS)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 64}, patch_size=patch),
        tokenizer=tokenizer,
        patch_size=patch,
        spatial_merge_size=merge,
        chat_template=chat_template("[IMG]"),
    )
    vision = {"model_type": "pixtral", **_siglip(64, patch, head_dim=VISION["width"] // VISION["heads"])}
    config = Mistral3Config(
        text_config={"model_type": "mistral", **_llama_text(tokenizer, head_dim=16)},
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=merge,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    return processor, config


@dataclass(frozen=True)
class Family:
    build: object  # () -> (processor, config)
    model_cls: type
    layout: str  # masking layout its batches carry


VLLM_SIZED = ("qwen3_vl",)  # families whose size "vllm" the tier runs (the Qwen2 ones: models.SIZES)
FAMILIES = {
    "qwen3_vl": Family(_qwen3_vl, Qwen3VLForConditionalGeneration, "grid_rows"),
    "idefics3": Family(lambda: _idefics(False, False), Idefics3ForConditionalGeneration, "tiles"),
    "idefics3_tiled": Family(lambda: _idefics(False, True), Idefics3ForConditionalGeneration, "tiles"),
    "smolvlm": Family(lambda: _idefics(True, False), SmolVLMForConditionalGeneration, "tiles"),
    "smolvlm_tiled": Family(lambda: _idefics(True, True), SmolVLMForConditionalGeneration, "tiles"),
    "gemma3": Family(_gemma3, Gemma3ForConditionalGeneration, "images"),
    "gemma4": Family(_gemma4, Gemma4ForConditionalGeneration, "position_rows"),
    "lfm2_vl": Family(lambda: _lfm2_vl(False), Lfm2VlForConditionalGeneration, "tile_rows"),
    "lfm2_vl_tiled": Family(lambda: _lfm2_vl(True), Lfm2VlForConditionalGeneration, "tile_rows"),
    "llava": Family(_llava, LlavaForConditionalGeneration, "images"),
    "mistral3": Family(_mistral3, Mistral3ForConditionalGeneration, "sized_images"),
    "llava_next": Family(_llava_next, LlavaNextForConditionalGeneration, "crops"),
    "llava_onevision": Family(_llava_onevision, LlavaOnevisionForConditionalGeneration, "crops"),
}
