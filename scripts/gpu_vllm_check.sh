#!/usr/bin/env bash
# The GPU check of the vLLM path (docs/vllm.md), on one CUDA GPU with pip access: installs TRL's vLLM extra, trains
# two steps of PAPO-G with rollouts from a colocated vLLM engine, and checks what the CPU tests cannot: vLLM accepts
# the generation settings (SamplingParams(**generation_kwargs)), the masked branch and the loss run on what TRL
# hands over after a vLLM round, TRL's importance-sampling correction ran (its ratio is logged), and the adapter's
# rollout-fidelity guard passed its first round (vLLM's prompt ids are the trainer's; it stops the run otherwise).
# Usage: bash scripts/gpu_vllm_check.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-tiny:qwen2_5_vl}"
trl_version="$(.venv/bin/python -c 'import trl; print(trl.__version__)')"
.venv/bin/python -m pip install "trl[vllm]==${trl_version}"
out="$(mktemp -d)"
.venv/bin/papo-nb train --params params/smoke_fast.yaml --output-dir "$out/run" \
  -p model_name_or_path="$model" -p device=cuda -p use_vllm=true -p vllm_mode=colocate \
  -p vllm_gpu_memory_utilization=0.2 -p max_steps=2 -p save_steps=2 -p require_gpu_contract_probe=false
.venv/bin/python - "$out/run" <<'PY'
import json
import sys
from pathlib import Path

logs = json.loads((Path(sys.argv[1]) / "train_summary.json").read_text())["log_history"]
steps = [entry for entry in logs if "reward" in entry]
assert len(steps) == 2, logs
assert all("sampling/importance_sampling_ratio/mean" in entry for entry in steps), steps[0].keys()
assert steps[0]["papo/vllm_prompt_mismatch_rows"] == 0, steps[0]  # the guard checked the first round
print("vLLM path: 2 steps, importance-sampling ratio", [round(e["sampling/importance_sampling_ratio/mean"], 4) for e in steps],
      "step-1 mean |vLLM - trainer| log-prob", steps[0].get("papo/vllm_logprob_gap"))
PY
