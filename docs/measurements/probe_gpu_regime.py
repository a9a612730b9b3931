"""The gamma-zero probe in the emulated GPU regime (``papo_nb.workbook.verification.gpu_regime``): false alarms,
power per term at gamma 0.02, and the block test, on the testbed policy (phase 1 and 2) and the wide tiny model.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/probe_gpu_regime.py [params/calibration_testbed.yaml]``.
Real gradients are measured once per batch on the CPU (fp32 and bf16 autocast); every emulated evaluation adds fresh
synthetic roundoff to each of its passes (2e-3 relative in bf16, 1e-5 in fp32) and runs the probe's own decision
code. Prints markdown tables: false alarms per regime, power per term, the weakest block, the wide model's 1% block.
"""

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from papo_nb.papo.probe.projection import BLOCK_SHARE
from papo_nb.testbed.models import build_tiny_vlm
from papo_nb.train.runner import run_training
from papo_nb.workbook.config.params import WorkbookParams, load_params
from papo_nb.workbook.rollouts import rollout_batch
from papo_nb.workbook.training.builder import prepare_training
from papo_nb.workbook.verification.gpu_regime import (
    NOISE_SHARES,
    REGIMES,
    STRONG_SHARES,
    PassNoise,
    block_shares,
    cache_batch,
    confined_leak,
    evaluate,
    false_alarm_table,
)

ROOT = Path(__file__).resolve().parents[2]
BATCHES, EVALUATIONS = 5, 110  # per phase and precision: 550 clean evaluations
TERMS = ("perception_kl", "original_entropy")
source = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "params" / "calibration_testbed.yaml"
everything = load_params(source).model_dump()
params = WorkbookParams(**{k: v for k, v in everything.items() if k in WorkbookParams.model_fields})
work = Path(tempfile.mkdtemp())
generator = torch.Generator().manual_seed(32)


def cache_phase(trainer, phase: str, seed: int):
    dataset = trainer.train_dataset
    batches = [
        rollout_batch(trainer, dataset, 2, start=(2 * b) % (len(dataset) - 1), seed=seed + b) for b in range(BATCHES)
    ]
    return [cache_batch(trainer, b, p, f"{phase}/{p}") for b in batches for p in ("fp32", "bf16")]


def header(columns) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def row(cells) -> str:
    return "| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |"


trainer, _, _ = prepare_training(params, work / "phase1", save_strategy="no")
cached = cache_phase(trainer, "phase1", 400)
steps = params.phase2_train_steps  # phase 2 as notebook 02 makes it: a short PAPO-G run, its last checkpoint
short = params.model_copy(update=dict(max_steps=steps, save_steps=steps, require_gpu_contract_probe=False))
checkpoint = str(run_training(short, work / "phase2_training", report_to="none").last_checkpoint)
trainer, _, _ = prepare_training(
    params.model_copy(update={"init_adapter": checkpoint}), work / "phase2", save_strategy="no"
)
cached += cache_phase(trainer, "phase2", 1400)

print("\n## False alarms (clean adapter)\n")
header(
    [
        "correlation",
        "regime",
        "evaluations",
        "alarms",
        "largest statistic / threshold",
        "powered",
        "8-repeat evaluations",
        "old rule (6 floors, 2 repeats) alarms",
    ]
)
clean = {}
for name, shares in (("issue-matched", NOISE_SHARES), ("strong", STRONG_SHARES)):
    evaluations = [
        evaluate(c, PassNoise(c, REGIMES[c.precision], generator, shares)) for c in cached for _ in range(EVALUATIONS)
    ]
    clean[name] = evaluations
    for r in false_alarm_table(evaluations):
        print(
            row(
                [
                    name,
                    r["regime"],
                    r["evaluations"],
                    r["alarms"],
                    r["max_statistic_over_threshold"],
                    r["powered"],
                    r["eight_sample_evaluations"],
                    r["old_rule_alarms"],
                ]
            )
        )

print("\n## Power at gamma 0.02 (issue-matched correlation; the real injected leak through the zero-gamma pass)\n")
header(
    [
        "regime",
        "term",
        "leaky evaluations",
        "caught",
        "passed while powered",
        "median injected leak / floor (clean)",
        "median detectable coefficient (clean)",
    ]
)
for label in sorted({c.label for c in cached}):
    mine = [c for c in cached if c.label == label]
    sel = [e for e in clean["issue-matched"] if e["label"] == label]
    for term in TERMS:
        leaky = [
            evaluate(c, PassNoise(c, REGIMES[c.precision], generator), leak=c.gradients.injected[term])
            for c in mine
            for _ in range(10)
        ]
        floors = [e["injected_leak_over_floor"][term] for e in sel if term in e["injected_leak_over_floor"]]
        detect = [e["detectable"][term] for e in sel if term in e["detectable"]]
        passed = sum(not e["failed"] and e["powered"] for e in leaky)
        print(
            row(
                [
                    label,
                    term,
                    len(leaky),
                    sum(e["failed"] for e in leaky),
                    passed,
                    statistics.median(floors),
                    statistics.median(detect),
                ]
            )
        )

print("\n## Blocks on the testbed (issue-matched, median over clean evaluations)\n")
header(
    [
        "regime",
        "block",
        "term",
        "share",
        "detectable coefficient",
    ]
)
for label in sorted({c.label for c in cached}):
    sel = [e for e in clean["issue-matched"] if e["label"] == label]
    for block in sel[0]["blocks"]:
        for term in TERMS:
            entries = [e["blocks"][block][term] for e in sel if e["blocks"][block].get(term, {}).get("testable")]
            if entries:
                print(
                    row(
                        [
                            label,
                            block,
                            term,
                            statistics.median(x["share"] for x in entries),
                            statistics.median(x["detectable_coefficient"] for x in entries),
                        ]
                    )
                )

print("\n## The wide tiny model (16 LoRA blocks): a 0.02 leak confined to one block\n")
path = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=work / "cache", size="wide")
wide = WorkbookParams(
    **{**params.model_dump(), "model_name_or_path": str(path), "dataset": "synthetic", "init_adapter": ""}
)
trainer, _, _ = prepare_training(wide, work / "wide", save_strategy="no")
batch = rollout_batch(trainer, trainer.train_dataset, 2, start=0, seed=300)
header(
    [
        "regime",
        "term",
        "block",
        "share",
        "clean alarms",
        "leak caught",
        "block detectable",
        "weakest block >= 1% detectable",
    ]
)
for precision in ("fp32", "bf16"):
    c = cache_batch(trainer, batch, precision, f"wide/{precision}")
    noise = PassNoise(c, REGIMES[precision], generator)
    base = [evaluate(c, noise) for _ in range(10)]
    large = [
        statistics.median(e["blocks"][b][t]["detectable_coefficient"] for e in base)
        for b in base[0]["blocks"]
        for t in TERMS
        if base[0]["blocks"][b].get(t, {}).get("testable") and base[0]["blocks"][b][t]["share"] >= BLOCK_SHARE
    ]
    weakest = max(large)
    for term in TERMS:
        shares = block_shares(c, term)
        for block in sorted((b for b, s in shares.items() if s >= BLOCK_SHARE), key=shares.get)[:3]:
            leaky = [evaluate(c, noise, leak=confined_leak(c, term, block)) for _ in range(4)]
            detect = statistics.median(e["blocks"][block][term]["detectable_coefficient"] for e in base)
            print(
                row(
                    [
                        f"wide/{precision}",
                        term,
                        block,
                        shares[block],
                        sum(e["failed"] for e in base),
                        f"{sum(f'{term} in {block}' in e['seen'] for e in leaky)}/4",
                        detect,
                        weakest,
                    ]
                )
            )
