"""The tiny offline VLM: deterministic, cached, small, and loadable through the real-checkpoint path."""

import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from trl.data_utils import prepare_multimodal_messages

from papo_nb.testbed.models import (
    COMPLETE_MARKER,
    VISION_SPECIAL_TOKENS,
    build_tiny_vlm,
    load_vlm,
    vision_special_token_ids,
)


def weights(folder):
    return load_file(folder / "model.safetensors")


def processed_example(processor, example):
    messages = prepare_multimodal_messages(example["prompt"], images=[example["image"]])
    return processor.apply_chat_template(
        [messages], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


@pytest.mark.model
def test_same_seed_gives_bit_identical_weights(tmp_path, tiny_vlm_path):
    rebuilt = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=tmp_path)
    assert rebuilt != tiny_vlm_path
    a, b = weights(tiny_vlm_path), weights(rebuilt)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (rebuilt / "tokenizer.json").read_bytes() == (tiny_vlm_path / "tokenizer.json").read_bytes()


@pytest.mark.model
def test_different_seed_gives_different_weights(tmp_path, tiny_vlm_path):
    a, b = weights(tiny_vlm_path), weights(build_tiny_vlm("qwen2_vl", seed=1, cache_dir=tmp_path))
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.model
def test_build_leaves_global_rng_untouched(tmp_path):
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    build_tiny_vlm("qwen2_vl", seed=7, cache_dir=tmp_path)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.model
def test_second_call_reuses_the_cache(tmp_path):
    start = time.perf_counter()
    first = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=tmp_path)
    cold_s = time.perf_counter() - start
    marker_mtime = (first / COMPLETE_MARKER).stat().st_mtime_ns
    hits = []
    for _ in range(5):
        start = time.perf_counter()
        assert build_tiny_vlm("qwen2_vl", seed=0, cache_dir=tmp_path) == first
        hits.append(time.perf_counter() - start)
    # A hit is a stat call; a rebuild trains a tokenizer and writes weights (tens of ms at least).
    assert min(hits) < min(0.01, cold_s / 5), (hits, cold_s)
    assert (first / COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging leftovers


@pytest.mark.model
def test_half_written_folder_is_rebuilt(tmp_path):
    folder = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=tmp_path)
    (folder / COMPLETE_MARKER).unlink()
    (folder / "model.safetensors").write_bytes(b"truncated")
    rebuilt = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=tmp_path)
    assert rebuilt == folder and (rebuilt / COMPLETE_MARKER).exists()
    assert weights(rebuilt)  # a valid safetensors file again


@pytest.mark.model
def test_cache_root_comes_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPO_NB_CACHE", str(tmp_path / "env_cache"))
    folder = build_tiny_vlm("qwen2_vl", seed=3)
    assert folder.parent == tmp_path / "env_cache"


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"family='no_such_family' is not supported; allowed values: .*qwen2_vl"):
        build_tiny_vlm("no_such_family", cache_dir=tmp_path)


@pytest.mark.model
def test_parameter_count_is_a_few_hundred_thousand(tiny_vlm_path):
    model, _ = load_vlm(tiny_vlm_path)
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n_params <= 1_000_000, n_params


@pytest.mark.model
def test_processor_keeps_112px_images_at_16_tokens(tiny_vlm_path, shapes_dataset):
    _, processor = load_vlm(tiny_vlm_path)
    inputs = processed_example(processor, shapes_dataset[0])
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (inputs["input_ids"] == image_pad).sum().item() == 16


@pytest.mark.model
def test_tokenizer_and_chat_template(tiny_vlm_path):
    _, processor = load_vlm(tiny_vlm_path)
    tokenizer = processor.tokenizer
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert 256 < len(tokenizer) < 1000
    text = "<answer>red</answer>"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi?<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without_prompt.endswith("assistant\n")


@pytest.mark.model
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_family_builds_loads_and_forwards(family, tmp_path, shapes_dataset):
    model, processor = load_vlm(build_tiny_vlm(family, seed=0, cache_dir=tmp_path))
    assert model.config.model_type == family
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs = processed_example(processor, shapes_dataset[1])
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.model
def test_load_vlm_dtype_and_missing_path(tiny_vlm_path, tmp_path):
    model, _ = load_vlm(str(tiny_vlm_path), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"name_or_path=.*nope"):
        load_vlm(str(missing))
    with pytest.raises(ValueError, match="dtype="):
        load_vlm(tiny_vlm_path, dtype="float99")


@pytest.mark.model
def test_vision_special_token_ids(tiny_vlm_path):
    _, processor = load_vlm(tiny_vlm_path)
    ids = vision_special_token_ids(processor)
    assert ids == vision_special_token_ids(processor.tokenizer)
    assert sorted(processor.tokenizer.convert_ids_to_tokens(ids)) == sorted(VISION_SPECIAL_TOKENS)


@pytest.mark.model
def test_suppressed_generation_never_samples_vision_tokens(tiny_vlm_path, shapes_dataset):
    model, processor = load_vlm(tiny_vlm_path)
    inputs = processed_example(processor, shapes_dataset[2])
    suppressed = vision_special_token_ids(processor)

    def sample(**kwargs):
        torch.manual_seed(0)
        out = model.generate(**inputs, max_new_tokens=64, do_sample=True, top_k=0, num_return_sequences=8, **kwargs)
        return torch.isin(out[:, inputs["input_ids"].shape[1] :], torch.tensor(suppressed)).any().item()

    assert sample(), "control: a random policy does sample vision tokens when nothing suppresses them"
    assert not sample(suppress_tokens=suppressed)


@pytest.mark.model
def test_the_builder_lora_and_config_fit_the_tiny_model(tiny_vlm_path, tmp_path):
    from peft import get_peft_model

    from papo_nb.workbook.config.params import WorkbookParams
    from papo_nb.workbook.training.builder import lora_config, papo_config

    params = WorkbookParams(max_steps=2)
    model, processor = load_vlm(tiny_vlm_path)
    peft_model = get_peft_model(model, lora_config(params))
    lora_names = [n for n, _ in peft_model.named_parameters() if "lora_" in n]
    assert lora_names and all("language_model" in n for n in lora_names)

    args = papo_config(params, tmp_path, processor)
    # TRL's default that a CPU run cannot take is undone (bf16); activation checkpointing stays on, as TRL's
    assert args.bf16 is False and args.activation_checkpointing is True
    assert args.num_generations == 4 and args.max_completion_length == 16 and args.report_to == []
    assert args.generation_kwargs == {"suppress_tokens": vision_special_token_ids(processor)}
    assert args.max_steps == 2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_wide_size_is_tens_of_millions_and_tiny_is_unchanged(family):
    from papo_nb.testbed.models import FAMILIES, build_tiny_tokenizer, tiny_config

    tokenizer = build_tiny_tokenizer()
    counts = {}
    for size in ("tiny", "wide"):
        with torch.device("meta"):  # shapes only: no memory, no init cost
            model = FAMILIES[family][1](tiny_config(family, tokenizer, size=size))
        counts[size] = sum(p.numel() for p in model.parameters())
    assert 100_000 <= counts["tiny"] <= 1_000_000
    assert 10_000_000 <= counts["wide"] <= 100_000_000, counts
    assert tiny_config(family, tokenizer).to_dict() == tiny_config(family, tokenizer, size="tiny").to_dict()


def test_unknown_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"size='huge'.*tiny.*wide"):
        build_tiny_vlm("qwen2_vl", cache_dir=tmp_path, size="huge")
    assert not any(tmp_path.iterdir())


@pytest.mark.model
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_vllm_size_has_the_head_size_vllms_cpu_attention_takes(family, tmp_path):
    """vLLM's CPU attention takes head sizes 32 to 512 (the tier, tests/test_vllm_rollouts.py); tiny has 16."""
    folder = build_tiny_vlm(family, cache_dir=tmp_path, size="vllm")
    text = AutoConfig.from_pretrained(folder).text_config
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    assert head == 32 and sum(text.rope_parameters["mrope_section"]) == head // 2
    assert folder.name.startswith("vllm-")


def test_the_vllm_size_is_refused_for_a_family_the_tier_does_not_run(tmp_path):
    with pytest.raises(ValueError, match=r"size='vllm' is not available for family='gemma3'; allowed: \('tiny',\)"):
        build_tiny_vlm("gemma3", cache_dir=tmp_path, size="vllm")
