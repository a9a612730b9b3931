#!/usr/bin/env bash
# Issue 55's in-loop grid: shared PAPO-G against plain PAPO-G and TRL's GRPO inside trainer.train(), on the tiny
# Qwen2.5-VL and Qwen3-VL, G 5 and 8, R 256 and 1024, TRL's default gradient checkpointing, one thread, one release
# after the other (never both at once: they would share the core). Each (release, family, R) writes one JSON under
# docs/in_loop/; `python -m papo_nb.bench.in_loop_grid --write` renders docs/performance.md's table from them.
#   usage: [REPEATS=16] [CORE=0] bash benchmarks/in_loop_grid.sh PYTHON [PYTHON ...]
set -euo pipefail
out="${OUT:-docs/in_loop}"
mkdir -p "$out"
for python in "$@"; do
  release=$("$python" -c "import trl; print(trl.__version__)")
  for family in qwen2_5_vl qwen3_vl; do
    for completion in 256 1024; do
      OMP_NUM_THREADS=1 taskset -c "${CORE:-0}" "$python" -m papo_nb.bench.in_loop --family "$family" --size tiny \
        --layouts G5_k1,G8_k1 --variants grpo,papo_rollout,papo_shared --steps 1 --warmup 1 \
        --repeats "${REPEATS:-16}" --memory-repeats 3 --image-px 392 --completion "$completion" \
        --out "$out/trl${release}-${family}-R${completion}.json"
    done
  done
done
