"""vLLM rollouts without a GPU (docs/vllm.md): the parameters reach TRL's config under its own names, every GPU
recipe generates with a colocated vLLM, each generation setting handed to vLLM is a field of ``SamplingParams`` in
every vLLM release the supported TRL releases accept (the fact file), and ``use_vllm`` where vLLM is not installed
stops ``papo-nb train`` before work with the install command."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

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
