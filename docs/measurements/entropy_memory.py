"""Peak memory of one PAPO-G step (loss + backward) with each entropy estimator, same batch, interleaved rounds.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/entropy_memory.py [tiny|wide]``. eta1 = eta2 = 0.05 (the
official 7B weights), masked branch no-grad (official); a plain GRPO step and PAPO-G with eta = 0 are the references.
Reports torch's CPU allocation peak above the pre-step level (profiler) and the full-vocabulary tensors alive at the
peak (``papo_nb.bench.memory.VocabTensorTracker``), in units of one (B, T, V) fp32 tensor.
"""

import statistics
import sys

import torch
from trl import GRPOTrainer

from papo_nb.bench.harness import build_setup
from papo_nb.bench.memory import VocabTensorTracker, allocation_peak

torch.set_num_threads(1)
size = sys.argv[1] if len(sys.argv) > 1 else "tiny"
s = build_setup(size, n_prompts=4)


eta = dict(original_entropy_weight=0.05, masked_entropy_weight=0.05)
trainers = {
    "grpo (parent alone)": s.trainer("g", GRPOTrainer),
    "papo eta=0": s.trainer("e0", original_entropy_weight=0.0, masked_entropy_weight=0.0),
    "papo eta=0.05 sampled": s.trainer("s", entropy_estimator="sampled", **eta),
    "papo eta=0.05 full": s.trainer("f", entropy_estimator="full", **eta),
}
vocab = s.model.get_output_embeddings().weight.shape[0]
rows = s.batch["completion_ids"].numel()


def step(t):
    def run():
        t._compute_loss(s.model, s.batch).backward()
        for p in s.params:
            p.grad = None

    return run


peaks = {name: [] for name in trainers}
for _ in range(3):  # interleaved rounds
    for name, t in trainers.items():
        if hasattr(t, "mask_generator"):
            t.mask_generator.manual_seed(0)
        peaks[name].append(allocation_peak(step(t))["peak_bytes"])
vocab_tensors = {}
for name, t in trainers.items():
    tracker = VocabTensorTracker(vocab, rows)
    with tracker:
        step(t)()
    vocab_tensors[name] = (tracker.peak_full, tracker.peak_bytes)
one = rows * vocab * 4
print(
    f"model {size}: {s.n_params / 1e6:.1f}M parameters, vocab {vocab}, "
    f"completions {tuple(s.batch['completion_ids'].shape)}"
)
print(
    "| step | torch CPU allocation peak, MiB (median of 3; min-max) | whole-batch vocab tensors "
    "| vocab bytes / (B,T,V) |"
)
print("| --- | --- | --- | --- |")
for name, v in peaks.items():
    count, total = vocab_tensors[name]
    median, low, high = statistics.median(v) / 2**20, min(v) / 2**20, max(v) / 2**20
    print(f"| {name} | {median:.2f} ({low:.2f}-{high:.2f}) | {count} | {total / one:.2f} |")
