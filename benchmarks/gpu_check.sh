#!/usr/bin/env bash
# GPU check of PAPO-G's step overhead and of the gamma-zero probe in real bf16 (one H200, under 8 minutes).
#
#   usage: benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options, e.g. --text-layers 18]
#
# Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.log. Installs nothing and needs no network: it runs with
# $PYTHON (default: .venv/bin/python of this repository if present, else `python` on PATH), which must already
# have the pinned stack and papo_nb (or papo_nb importable from this repository, which the script ensures).
# On a machine without network, build that environment from carried wheels first:
#   python -m venv /tmp/venv
#   /tmp/venv/bin/pip install --no-index --find-links WHEELS -e .      # WHEELS: `pip download -d WHEELS .` done
#                                                                        # beforehand where there is network
#   PYTHON=/tmp/venv/bin/python benchmarks/gpu_check.sh OUT_DIR
# Check the script without a GPU: python benchmarks/gpu_check.py --cpu-dry-run --out-dir /tmp/gpu_dry
set -euo pipefail

OUT_DIR=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]}
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
mkdir -p "$OUT_DIR"

# Offline by construction: no hub, no package index.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
  2>&1 | tee "$OUT_DIR/gpu_check.log"
# 470 s hard stop (the script budgets itself to 420 s): the whole check stays under 8 minutes.
timeout 470 "$PYTHON" "$HERE/gpu_check.py" --out-dir "$OUT_DIR" "$@" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
# Issue 14: GRPO vs PAPO-G with the full masked forward vs the shared prompt prefix, G = 8, prompt >= 4x completion
# (OUT_DIR/gpu_paper_shapes.json). PAPER_SHAPES=0 skips it.
if [[ "${PAPER_SHAPES:-1}" != 0 ]]; then
  timeout 300 "$PYTHON" "$HERE/gpu_check.py" --out-dir "$OUT_DIR" --paper-shapes-only "$@" 2>&1 \
    | tee "$OUT_DIR/gpu_paper_shapes.log"
fi
