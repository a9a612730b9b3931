"""vLLM rollouts: the parameters (TRL's GRPOConfig field names, passed to the config as they are), the machine check
that refuses ``use_vllm`` where vLLM is not installed (with the install command), and the field list of vLLM's
``SamplingParams`` (vllm_sampling_fields.json), which every generation setting handed to vLLM must be one of.

TRL builds ``SamplingParams(**generation_kwargs)`` in colocate mode and in ``trl vllm-serve``; the builder's
``generation_kwargs`` therefore uses ``logit_bias`` (colocate) or ``bad_words`` (server, where the request travels as
JSON and integer keys would turn into strings) for the image-token suppression that HF generation gets from
``suppress_tokens``. docs/vllm.md says what is checked here and what the GPU check runs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SAMPLING_FIELDS_FILE = Path(__file__).with_name("vllm_sampling_fields.json")


class VLLMParams(BaseModel):
    """The vLLM fields of the workbook parameters, by GRPOConfig's names and with its defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    use_vllm: bool = Field(
        False,
        description="generate rollouts with vLLM (TRL's use_vllm; CUDA: pip install 'trl[vllm]'; CPU: the venv of "
        "scripts/vllm_cpu_env.sh)",
    )
    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="'colocate': a vLLM engine inside each training process (the official runs'); 'server': a "
        "separate `trl vllm-serve` process at vllm_server_base_url",
    )
    vllm_server_base_url: str = Field(
        "", description="server mode: the server's address, e.g. http://10.0.0.2:8000; empty: TRL's 0.0.0.0:8000"
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="colocate mode: fraction of each GPU's memory vLLM reserves (TRL's default 0.3)"
    )
    vllm_tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="colocate mode: GPUs one vLLM engine spans (TRL's default 1)"
    )
    vllm_enable_sleep_mode: bool = Field(
        False,
        description="colocate mode: release the engine's weights and KV cache after each round's generation "
        "(vLLM sleep level 2) and wake it for the next, so training does not share the GPU with it (TRL's field, "
        "default off)",
    )


VLLM_FIELDS = tuple(VLLMParams.model_fields)


def vllm_config_fields(params) -> dict:
    """The GRPOConfig fields of the vLLM parameters (an empty server address is TRL's None)."""
    fields = {name: getattr(params, name) for name in VLLM_FIELDS}
    fields["vllm_server_base_url"] = fields["vllm_server_base_url"] or None
    return fields


def install_command() -> str:
    """The pip command installing vLLM in the range the installed TRL accepts (its ``vllm`` extra)."""
    trl_version = importlib.metadata.version("trl")
    extra = [r for r in importlib.metadata.requires("trl") or [] if re.match(r"vllm\b", r) and "extra ==" in r]
    accepted = f" (vLLM {extra[0].split(';')[0].removeprefix('vllm')})" if extra else ""
    return f'pip install "trl[vllm]=={trl_version}"{accepted}'


def vllm_problems(params) -> list[str]:
    """With ``use_vllm``: vLLM importable here (checked before any model loads). On the CPU, vLLM's CPU backend runs
    in the virtualenv scripts/vllm_cpu_env.sh builds (docs/vllm.md)."""
    if not params.use_vllm:
        return []
    if importlib.util.find_spec("vllm") is not None:
        return [tiny_head_problem(params.model_name_or_path)] if params.device != "cuda" and is_tiny(params) else []
    if params.device == "cuda":
        return [f"parameter 'use_vllm' = True: vLLM is not installed here; install it: {install_command()}"]
    return [
        f"parameter 'use_vllm' = True with device {params.device!r}: vLLM is not installed in this environment. "
        "Either set use_vllm: false (rollouts from HF generate), or build the environment with vLLM's CPU backend "
        "(bash scripts/vllm_cpu_env.sh) and run there (.venv-vllm/bin/papo-nb)"
    ]


def is_tiny(params) -> bool:
    return params.model_name_or_path.startswith("tiny:")


def tiny_head_problem(name: str) -> str:
    family = name.removeprefix("tiny:")
    return (
        f"parameter 'model_name_or_path' = {name!r} with use_vllm on the CPU: vLLM's CPU attention takes head sizes "
        "32 to 512 and the tiny testbeds have 16; pass the folder of the vLLM-sized build instead: python -c "
        f'\'from papo_nb.testbed.models import build_tiny_vlm; print(build_tiny_vlm("{family}", size="vllm"))\''
    )


@functools.lru_cache(maxsize=1)
def vllm_sampling_fields() -> dict:
    """The fact file: ``releases`` (vLLM version -> SamplingParams fields), ``in_every_release``, its source and the
    command that regenerated it (scripts/vllm_sampling_fields.py)."""
    return json.loads(SAMPLING_FIELDS_FILE.read_text())
