"""vLLM rollouts without a GPU (docs/vllm.md): the parameters reach TRL's config under its own names, every GPU
recipe generates with a colocated vLLM, each generation setting handed to vLLM is a field of ``SamplingParams`` in
every vLLM release the supported TRL releases accept (the fact file), and ``use_vllm`` where vLLM is not installed
stops ``papo-nb train`` before work with the install command."""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import inspect
import json
import types
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

from papo_nb.papo.token_suppression import suppress_in_head, suppressed_token_ids
from papo_nb.papo.vllm_rollouts import (
    RolloutFidelityError,
    RolloutFidelityGuard,
    SingleExpansion,
    collapse_image_runs,
    vllm_expands_placeholders,
)
from papo_nb.testbed.models import build_tiny_processor, vision_special_token_ids
from papo_nb.train.runner import train_command
from papo_nb.workbook.config.params import ParamsError, load_params
from papo_nb.workbook.config.vllm_params import install_command, vllm_problems, vllm_sampling_fields
from papo_nb.workbook.training.builder import papo_config

ROOT = Path(__file__).resolve().parents[1]
GPU_PARAMS = [*(ROOT / "params" / "recipes" / f"{n}.yaml" for n in ("papo_g_3b", "grpo_3b", "papo_g_7b", "grpo_7b",
              "vppo_7b")), ROOT / "params" / "gpu.yaml"]  # fmt: skip


@pytest.fixture(scope="module")
def processor():
    return build_tiny_processor("qwen2_vl")


def gpu_config(path: Path, processor, *overrides: str):
    """The config a GPU params file builds (device set to cpu: only the device check needs CUDA)."""
    return papo_config(load_params(path, ["device=cpu", *overrides]), "unused", processor)


def test_the_fact_file_covers_every_vllm_release_the_installed_trl_accepts():
    facts = vllm_sampling_fields()
    assert facts["command"] == ".venv/bin/python scripts/vllm_sampling_fields.py"
    assert (ROOT / "scripts" / "vllm_sampling_fields.py").is_file() and "SamplingParams" in facts["source"]
    (extra,) = [r for r in importlib.metadata.requires("trl") if r.startswith("vllm") and "extra ==" in r]
    accepted = SpecifierSet(extra.split(";")[0].removeprefix("vllm"))
    lowest, highest = facts["trl_vllm_ranges"][importlib.metadata.version("trl")]
    assert lowest in accepted and highest in accepted and lowest in facts["releases"] and highest in facts["releases"]
    for fields in facts["releases"].values():
        assert {"n", "temperature", "top_p", "max_tokens", "logprobs", "logit_bias", "bad_words"} <= set(fields)
        assert "suppress_tokens" not in fields  # what HF generate takes and vLLM does not


@pytest.mark.parametrize("path", GPU_PARAMS, ids=lambda p: p.stem)
def test_every_gpu_recipe_generates_with_vllm_and_hands_it_only_sampling_params_fields(path, processor):
    args = gpu_config(path, processor)
    assert (args.use_vllm, args.vllm_mode) == (True, "colocate")
    assert args.vllm_importance_sampling_correction  # TRL's default: the masked branch and the probe see the ratio
    suppressed = vision_special_token_ids(processor)
    for mode in ("colocate", "server"):
        settings = gpu_config(path, processor, f"vllm_mode={mode}").generation_kwargs
        for version, fields in vllm_sampling_fields()["releases"].items():
            assert set(settings) <= set(fields), (mode, version, sorted(set(settings) - set(fields)))
        if mode == "colocate":  # the same ids HF generate suppresses, each at -inf
            assert settings == {"logit_bias": {token_id: float("-inf") for token_id in suppressed}}
        else:  # the server's request is JSON: strings survive it, integer dict keys would not
            assert json.loads(json.dumps(settings)) == settings
            assert settings["bad_words"] == processor.tokenizer.convert_ids_to_tokens(suppressed)


def test_bad_words_tokenize_to_the_suppressed_ids_as_vllm_tokenizes_them(processor):
    """vLLM's ``SamplingParams.update_from_tokenizer`` bans each bad word's ``encode(word, add_special_tokens=False)``
    sequence; one token each here, so each is banned wherever it would be generated."""
    tokenizer = processor.tokenizer
    words = tokenizer.convert_ids_to_tokens(vision_special_token_ids(processor))
    assert [tokenizer.encode(word, add_special_tokens=False) for word in words] == [
        [i] for i in vision_special_token_ids(processor)
    ]


def test_without_vllm_hf_generate_keeps_suppress_tokens_and_the_vllm_fields_pass_by_their_trl_names(processor):
    args = gpu_config(GPU_PARAMS[0], processor, "use_vllm=false")
    assert args.generation_kwargs == {"suppress_tokens": vision_special_token_ids(processor)} and not args.use_vllm
    server = gpu_config(GPU_PARAMS[0], processor, "vllm_mode=server", "vllm_server_base_url=http://10.0.0.2:8000",
                        "vllm_gpu_memory_utilization=0.5", "vllm_tensor_parallel_size=2")  # fmt: skip
    assert (server.vllm_mode, server.vllm_server_base_url) == ("server", "http://10.0.0.2:8000")
    assert (server.vllm_gpu_memory_utilization, server.vllm_tensor_parallel_size) == (0.5, 2)
    assert gpu_config(GPU_PARAMS[0], processor).vllm_server_base_url is None  # empty: TRL's host and port
    with pytest.raises(ParamsError, match=r"'vllm_mode' = 'remote'.*'colocate' or 'server'"):
        load_params(None, ["vllm_mode=remote"])
    with pytest.raises(ParamsError, match=r"'vllm_gpu_memory_utilization' = 0"):
        load_params(None, ["vllm_gpu_memory_utilization=0"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed: tests/test_vllm_rollouts.py")
def test_papo_nb_train_with_use_vllm_and_no_vllm_stops_before_work_with_both_fixes(tmp_path, capsys):
    out = tmp_path / "run"
    code = train_command(str(ROOT / "params" / "smoke_fast.yaml"), ["use_vllm=true"], str(out), report_to="none")
    error = capsys.readouterr().err
    assert code == 2 and not out.exists()  # stopped before the run folder, the data and the model
    assert "parameter 'use_vllm' = True with device 'cpu': vLLM is not installed in this environment" in error
    assert "set use_vllm: false" in error and "bash scripts/vllm_cpu_env.sh" in error  # both fixes
    (extra,) = [r for r in importlib.metadata.requires("trl") if r.startswith("vllm") and "extra ==" in r]
    command = f'pip install "trl[vllm]=={importlib.metadata.version("trl")}" (vLLM {extra.split(";")[0][4:]})'
    assert install_command() == command
    cuda = load_params(None, ["use_vllm=true", "device=cuda"])
    assert vllm_problems(cuda) == [f"parameter 'use_vllm' = True: vLLM is not installed here; install it: {command}"]


def test_docs_vllm_states_the_fact_files_releases_and_ranges():
    text = (ROOT / "docs" / "vllm.md").read_text()
    releases = list(vllm_sampling_fields()["releases"])
    assert f"each of the {len(releases)} vLLM releases\nfrom {releases[0]} to {releases[-1]}" in text
    for trl_version, (lowest, highest) in vllm_sampling_fields()["trl_vllm_ranges"].items():
        assert f"{trl_version}: vLLM {lowest} to {highest}" in text or f"{trl_version}:\n{lowest} to {highest}" in text


# ---- the adapter's vLLM pieces that need no engine (papo_nb/papo/vllm_rollouts.py, token_suppression.py); the
# engine runs them in tests/test_vllm_rollouts.py (the vLLM venv) ----


def test_each_run_of_image_placeholders_reaches_vllm_as_the_one_token_the_chat_template_writes(processor):
    image = processor.image_token_id
    expanded = [201, 205, image, image, image, 206, 207, image, image, 208]
    assert collapse_image_runs(expanded, image) == [201, 205, image, 206, 207, image, 208]
    assert collapse_image_runs([image] * 16, image) == [image] and collapse_image_runs([203], image) == [203]
    sent = []

    class Generation:  # what SingleExpansion wraps: VLLMGeneration.generate's keywords, its returned prompt ids
        def generate(self, prompts, images, num_generations, profiler=None):
            sent.append(prompts)
            expand = [
                [t for x in p for t in ([x] * 16 if x == image and im else [x])] for p, im in zip(prompts, images)
            ]
            return expand, None, None, None

    wrapper = SingleExpansion(Generation(), image, collapse=True)
    wrapper(prompts=[[201, image, image, 202], [201, image, 202]], images=[["img"], None], num_generations=1)
    assert sent == [[[201, image, 202], [201, image, 202]]]  # only rows with images are collapsed
    assert wrapper.last == (
        [[201, image, image, 202], [201, image, 202]],
        [[201, *[image] * 16, 202], [201, image, 202]],
    )


def test_the_guard_names_rows_counts_and_cause_and_checks_the_first_round_then_every_n(processor):
    image = processor.image_token_id
    metrics = collections.defaultdict(list)
    guard = RolloutFidelityGuard(every=2, tolerance=0.05, metrics=metrics)
    expansion = SingleExpansion(types.SimpleNamespace(generate=None), image, collapse=True)
    batch = {
        "sampling_per_token_logps": torch.tensor([[-1.0, -2.0, -9.0]]),
        "completion_mask": torch.tensor([[1, 1, 0]]),
    }
    batch["old_per_token_logps"] = torch.tensor([[-1.01, -2.01, 0.0]])
    expansion.last = ([[201, image, image, 202]], [[201, image, image, image, 202]])
    with pytest.raises(RolloutFidelityError) as error:
        guard.check(batch, expansion)
    assert str(error.value).startswith(
        "rollout-fidelity guard, vLLM round 0: 1 row(s) generated from a different prompt: row 0: vLLM 5 tokens "
        "(3 image tokens), trainer 4 (2). Likely cause: vLLM expanded image placeholders"
    )
    assert metrics["papo/vllm_prompt_mismatch_rows"] == [1.0] and metrics["papo/vllm_logprob_gap"] == [
        pytest.approx(0.01, abs=1e-6)
    ]  # the masked token (log-prob 9 apart) is not counted
    guard.check(batch, expansion)  # round 1: not checked (every 2)
    expansion.last = ([[201, image, 202]], [[201, image, 202]])
    batch["old_per_token_logps"] = torch.tensor([[-1.2, -2.0, 0.0]])
    with pytest.raises(RolloutFidelityError, match=r"round 2: mean \|vLLM sampling log-prob - trainer log-prob\| = "
                       r"0\.1 over completion tokens, above vllm_fidelity_logprob_tolerance = 0\.05"):  # fmt: skip
        guard.check(batch, expansion)
    assert len(metrics["papo/vllm_prompt_mismatch_rows"]) == 2


def test_the_trainer_side_suppression_is_the_renormalised_distribution_generation_samples_from(processor):
    """log_softmax with the head's -1e4 bias on the banned ids equals the log-probs renormalised over the allowed
    tokens (what vLLM's logit_bias -inf and HF's suppress_tokens sample from); nothing lands in the state dict."""
    banned = vision_special_token_ids(processor)
    tokenizer = processor.tokenizer
    spellings = [{"suppress_tokens": banned}, {"logit_bias": {t: float("-inf") for t in banned}},
                 {"bad_words": tokenizer.convert_ids_to_tokens(banned)}]  # fmt: skip
    assert all(suppressed_token_ids(kwargs, tokenizer) == banned for kwargs in spellings)
    torch.manual_seed(0)
    head = torch.nn.Linear(8, len(tokenizer), bias=False)
    model = types.SimpleNamespace(get_output_embeddings=lambda: head)
    hidden = torch.randn(3, 8)
    logits = head(hidden)
    allowed = torch.ones(len(tokenizer), dtype=torch.bool)
    allowed[banned] = False
    renormalised = logits[:, allowed].log_softmax(-1)
    suppress_in_head(model, banned)
    suppressed = head(hidden).log_softmax(-1)
    torch.testing.assert_close(suppressed[:, allowed], renormalised, rtol=0, atol=1e-6)
    assert (suppressed[:, ~allowed] < -9000).all() and list(head.state_dict()) == ["weight"]
    assert [name for name, _ in head.named_parameters()] == ["weight"]  # not trained, not sent to vLLM


def test_the_single_expansion_fits_this_trls_vllm_generation_in_both_modes():
    """The wrapper calls TRL's ``VLLMGeneration.generate`` by its keywords (1.9.1 and 1.16.0 spell them alike), and
    collapses where this TRL's mode hands vLLM raw images beside expanded ids: colocate, and 1.9.1's server."""
    from trl.generation.vllm_generation import VLLMGeneration

    assert list(inspect.signature(VLLMGeneration.generate).parameters) == [
        "self", "prompts", "images", "num_generations", "profiler"
    ]  # fmt: skip
    newest = importlib.metadata.version("trl") == "1.16.0"
    assert hasattr(VLLMGeneration, "_place_features") == newest
    for mode, expands in (("colocate", True), ("server", not newest)):
        generation = VLLMGeneration.__new__(VLLMGeneration)
        generation.mode = mode
        assert vllm_expands_placeholders(generation) == expands, mode
