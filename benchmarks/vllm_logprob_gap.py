"""The step-1 sampling log-prob gap of vLLM rollouts on the CPU (issue 65, docs/vllm.md): TRL's
``sampling/sampling_logp_difference/mean`` (mean |vLLM sampling log-prob - trainer log-prob| over completion
tokens, same weights, fp32) on the tiny vLLM-sized Qwen2.5-VL, with images and with the same prompts without them,
before and after each fix. Runs in the vLLM venv (scripts/vllm_cpu_env.sh), one subprocess per variant (one colocated
engine per process), about 30 s each:

    .venv-vllm/bin/python benchmarks/vllm_logprob_gap.py            # the table, every variant
    .venv-vllm/bin/python benchmarks/vllm_logprob_gap.py --variant images,fixed,suppressed   # one variant, as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# (images, single expansion, trainer-side suppression): the "before" (1f60324) is images,doubled,unsuppressed
VARIANTS = (
    "images,doubled,unsuppressed",
    "images,fixed,unsuppressed",
    "images,fixed,suppressed",
    "text,fixed,unsuppressed",
    "text,fixed,suppressed",
)
GAP = "sampling/sampling_logp_difference/mean"


def without_images(row: dict) -> dict:
    prompt = [{**m, "content": [p for p in m["content"] if p["type"] != "image"]} for m in row["prompt"]]
    return {"prompt": prompt}


def measure(variant: str) -> dict:
    """One training step with ``variant``; TRL's step-1 sampling metrics."""
    from papo_nb.papo import vllm_rollouts
    from papo_nb.testbed.models import build_tiny_vlm
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.training.builder import prepare_training

    images, expansion, suppression = variant.split(",")
    if expansion == "doubled":  # the fix reverted: vLLM gets the processor-expanded prompt (1f60324's behaviour)
        vllm_rollouts.collapse_image_runs = lambda ids, image_token_id: list(ids)
    model = build_tiny_vlm("qwen2_5_vl", size="vllm")
    overrides = [f"model_name_or_path={model}", "use_vllm=true", "max_steps=1", "save_steps=1",
                 "require_gpu_contract_probe=false", "perception_loss_weight=0.0", "measure_perception_kl=false",
                 f"trainer_token_suppression={'true' if suppression == 'suppressed' else 'false'}",
                 "vllm_fidelity_logprob_tolerance=100.0"]  # fmt: skip
    params = load_params("params/smoke_fast.yaml", overrides)
    with tempfile.TemporaryDirectory() as out:
        trainer, _, _ = prepare_training(params, out)
        seen = spy_on_prompts()  # after the constructor, whose contract check reads TRL's source
        image_token_id = trainer.processing_class.image_token_id
        if images == "text":
            trainer.train_dataset = trainer.train_dataset.map(without_images, remove_columns=["image"])
        try:
            trainer.train()
            metrics = trainer.state.log_history[0]
        except vllm_rollouts.RolloutFidelityError as error:  # the guard stops a doubled round: its metrics stand
            metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items() if v} | {"guard": str(error)}
    keys = (GAP, "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean", "guard")
    counts = {f"{side}_image_tokens": [row.count(image_token_id) for row in seen[side]] for side in seen}
    return (
        {"variant": variant, "global_step": trainer.state.global_step}
        | counts
        | {k: metrics[k] for k in keys if k in metrics}
    )


def spy_on_prompts() -> dict:
    """Records, on the first round, the prompt ids vLLM generated from (``RequestOutput.prompt_token_ids``, read from
    vLLM's own ``LLM.generate``) and the trainer's (TRL's batch, unpadded), independently of the adapter."""
    from trl import GRPOTrainer
    from vllm import LLM

    seen = {"vllm": [], "trainer": []}
    llm_generate, trl_round = LLM.generate, GRPOTrainer._generate_and_score_completions

    def generate(self, *args, **kwargs):
        outputs = llm_generate(self, *args, **kwargs)
        seen["vllm"] = seen["vllm"] or [list(output.prompt_token_ids) for output in outputs]
        return outputs

    def round_(self, inputs):
        batch = trl_round(self, inputs)
        rows = zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist())
        seen["trainer"] = seen["trainer"] or [[t for t, m in zip(ids, mask) if m] for ids, mask in rows]
        return batch

    LLM.generate, GRPOTrainer._generate_and_score_completions = generate, round_
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", help="one variant in this process (JSON on the last line): images|text, "
                        "fixed|doubled, suppressed|unsuppressed, comma-separated")  # fmt: skip
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant)))
        return 0
    print("| variant (prompt, expansion, trainer suppression) | step-1 mean gap | max gap | IS ratio mean |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        run = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        row = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"| {variant} | {row[GAP]:.2e} | {row['sampling/sampling_logp_difference/max']:.2e} | "
              f"{row['sampling/importance_sampling_ratio/mean']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
