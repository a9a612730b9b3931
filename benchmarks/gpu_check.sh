#!/usr/bin/env bash
# GPU check of PAPO-G's step overhead, of the gamma-zero probe in real bf16 and of the paper-like shapes (issue 14),
# sized for ONE device call of at most 600 s with room for a retry: the whole script stops within 480 s (8 min).
#
#   usage: [WHEELS=DIR] [PYTHON=...] [PAPER_SHAPES=0] [IN_LOOP=0] [FLEX=0] [TOTAL_S=480] benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]
#
# Each part has its own time budget, enforced by `timeout` and never past the script's deadline (TOTAL_S):
#   1. install, only with WHEELS set: a venv from carried wheels, offline    <= 120 s
#      (WHEELS: a folder filled beforehand, where there is network, by `pip download -d WHEELS .`)
#   2. main check (gpu_check.py --time-budget 170: timed rounds adapt to it) <= 190 s -> OUT_DIR/gpu_check.json
#   3. in-loop (issue 22: python -m papo_nb.bench.in_loop --device cuda)    <= 120 s -> OUT_DIR/gpu_in_loop.json
#      GRPO, PAPO-G rollout and update, and (issue 34) papo_nb GRPO at gamma 0 and PAPO-G with prefix sharing,
#      inside trainer.train() in bf16 with SDPA, G 5/8 x 3/1 steps per round (3 first); the JSON is rewritten
#      after each layout, so a timeout keeps what was measured (IN_LOOP=0 skips it)
#   4. paper shapes (gpu_check.py --paper-shapes-only --prefix-repeats 3)   <= 110 s -> OUT_DIR/gpu_paper_shapes.json
#      (PAPER_SHAPES=0 skips it; it gets what is left of the deadline if that is less)
#   5. flex (issue 55 item 5: benchmarks/flex_check.py)                      <=  60 s -> OUT_DIR/gpu_flex.json
#      prefix sharing's grouped attention, FlexAttention's block mask against the batched SDPA calls: fp32 outputs
#      and q/k/v gradients compared (the CPU has no flex backward), bf16 forward + backward timed (FLEX=0 skips it)
# Without WHEELS it installs nothing and runs $PYTHON (default: .venv/bin/python of this repository if present, else
# `python` on PATH), which must already have the pinned stack (papo_nb is put on sys.path from this repository).
# No network is used: no hub, no package index. Logs: OUT_DIR/gpu_check.log, OUT_DIR/gpu_paper_shapes.log.
# Check the script without a GPU: benchmarks/gpu_check.sh OUT_DIR --cpu-dry-run (tiny sizes, same code path).
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

DEADLINE=$((SECONDS + ${TOTAL_S:-480}))
budget() {  # budget SECONDS: that many, or what is left before the deadline if less (at least 1)
  local left=$((DEADLINE - SECONDS))
  if ((left < $1)); then echo $((left > 1 ? left : 1)); else echo "$1"; fi
}

if [[ -n "${WHEELS:-}" ]]; then
  VENV=${VENV:-/tmp/papo_gpu_venv}
  timeout "$(budget 120)" bash -c "python3 -m venv '$VENV' && '$VENV/bin/pip' install -q --no-index \
    --find-links '$WHEELS' -e '$ROOT'" 2>&1 | tee "$OUT_DIR/gpu_check.log"
  PYTHON="$VENV/bin/python"
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
  2>&1 | tee -a "$OUT_DIR/gpu_check.log"
# The main check budgets its timed rounds to --time-budget (170 s); the timeout is the hard stop 20 s above it.
# A part that fails or runs out of time is reported and the next part still runs; the exit status is the worst.
STATUS=0
timeout "$(budget 190)" "$PYTHON" "$HERE/gpu_check.py" --out-dir "$OUT_DIR" --time-budget 170 "$@" 2>&1 \
  | tee -a "$OUT_DIR/gpu_check.log" || { STATUS=$?; echo "gpu_check.sh: main check exited $STATUS (124: timeout)"; }
# Issue 22: the masked branch once per generation round against in every loss call, inside real training loops.
if [[ "${IN_LOOP:-1}" != 0 ]]; then
  IN_LOOP_ARGS=(--device cuda --bf16 --image-px 448 --completion 64 --prompts 4 --repeats 2 --steps 3
    --layouts G5_k3,G8_k3,G5_k1,G8_k1)
  for a in "$@"; do [[ "$a" == --cpu-dry-run ]] && IN_LOOP_ARGS=(--device cpu --layouts G5_k3 --repeats 1 --warmup 0 \
    --no-memory --image-px 56 --completion 4 --prompts 1 --steps 3); done
  (cd "$ROOT" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" timeout "$(budget 120)" "$PYTHON" -m papo_nb.bench.in_loop \
    "${IN_LOOP_ARGS[@]}" --out "$OUT_DIR/gpu_in_loop.json" --markdown "$OUT_DIR/gpu_in_loop.md") 2>&1 \
    | tee "$OUT_DIR/gpu_in_loop.log" || { rc=$?; STATUS=$((rc > STATUS ? rc : STATUS))
    echo "gpu_check.sh: in-loop exited $rc (124: timeout)"; }
fi
# Issue 14: GRPO vs PAPO-G with the full masked forward vs the shared prompt prefix, G = 8, prompt >= 4x completion.
if [[ "${PAPER_SHAPES:-1}" != 0 ]]; then
  timeout "$(budget 110)" "$PYTHON" "$HERE/gpu_check.py" --out-dir "$OUT_DIR" --paper-shapes-only --prefix-repeats 3 \
    "$@" 2>&1 | tee "$OUT_DIR/gpu_paper_shapes.log" || { rc=$?; STATUS=$((rc > STATUS ? rc : STATUS))
    echo "gpu_check.sh: paper shapes exited $rc (124: timeout)"; }
fi
# Issue 55 item 5: the grouped attention's FlexAttention kernel against its SDPA calls.
if [[ "${FLEX:-1}" != 0 ]]; then
  FLEX_ARGS=()
  for a in "$@"; do [[ "$a" == --cpu-dry-run ]] && FLEX_ARGS=(--cpu-dry-run); done
  timeout "$(budget 60)" "$PYTHON" "$HERE/flex_check.py" --out "$OUT_DIR/gpu_flex.json" "${FLEX_ARGS[@]}" 2>&1 \
    | tee "$OUT_DIR/gpu_flex.log" || { rc=$?; STATUS=$((rc > STATUS ? rc : STATUS))
    echo "gpu_check.sh: flex exited $rc (124: timeout)"; }
fi
# Issue 53: the memory forecast against the run at full depth (K = the model's 36 layers). The forecast for this GPU
# first (papo-nb preflight, no weights), then the rehearsal of gpu.yaml at full depth. The rehearsal measures on the
# CPU (papo_nb/bench/rehearsal.py: trainer.train() with use_cpu): on this machine's 128 GB it holds the full-depth
# model; measuring it on CUDA itself is not built yet. REHEARSAL=0 skips it.
if [[ "${REHEARSAL:-1}" != 0 ]]; then
  (cd "$ROOT" && "$PYTHON" -m papo_nb.cli preflight params/gpu.yaml --json > "$OUT_DIR/forecast_gpu_yaml.json"
   OMP_NUM_THREADS=8 timeout "$(budget 240)" "$PYTHON" -m papo_nb.cli rehearse params/gpu.yaml --layers 36 \
     --json "$OUT_DIR/rehearsal_gpu_yaml_36.json") 2>&1 | tee "$OUT_DIR/rehearsal.log" || { rc=$?
    STATUS=$((rc > STATUS ? rc : STATUS)); echo "gpu_check.sh: rehearsal exited $rc (124: timeout)"; }
fi
echo "gpu_check.sh: done in ${SECONDS}s (deadline ${TOTAL_S:-480}s)"
exit "$STATUS"
