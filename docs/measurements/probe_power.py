"""Power of the gamma-zero probe's two tests, per phase and precision, as notebook 02 measures it.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/probe_power.py [params/calibration_testbed.yaml]``.
Rebuilds what notebook 02 does with the given parameters (each notebook gets only the keys its parameters cell
declares, the rest default, as the papermill runner passes them): phase 1 (fresh adapter) and phase 2 (after
``phase2_train_steps`` of training), ``calibration_batches`` rollout batches each, fp32 and bf16 autocast, the probe
in its calibration mode (real roundoff: the batch split another way). Prints the per-phase table (medians over
powered batches), the false-alarm count and the verdict.
"""

import sys
import tempfile
from pathlib import Path

import papermill

from papo_nb.train.runner import run_training
from papo_nb.workbook.config.params import load_params, validate_params
from papo_nb.workbook.training.builder import prepare_training
from papo_nb.workbook.verification.calibration import calibrate_phase, false_alarms, phase_table, separation_margins

ROOT = Path(__file__).resolve().parents[2]
source = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "params" / "calibration_testbed.yaml"
everything = load_params(source).model_dump()
declared = papermill.inspect_notebook(str(ROOT / "notebooks" / "02_probe_calibration.ipynb"))
params = validate_params({k: v for k, v in everything.items() if k in declared})
work = Path(tempfile.mkdtemp())
measure = dict(leak_scale=params.injected_leak_scale)
trainer, _, _ = prepare_training(params, work / "phase1", save_strategy="no")
points = calibrate_phase(
    trainer,
    trainer.train_dataset,
    "phase1",
    params.calibration_precisions,
    params.calibration_batches,
    seed=params.seed,
    **measure,
)
del trainer
short = params.model_copy(
    update={
        "max_steps": params.phase2_train_steps,
        "save_steps": params.phase2_train_steps,
        "require_gpu_contract_probe": False,
    }
)
checkpoint = str(run_training(short, work / "phase2_training", report_to="none").last_checkpoint)
trainer, _, _ = prepare_training(params.model_copy(update={"init_adapter": checkpoint}), work / "phase2")
points += calibrate_phase(
    trainer,
    trainer.train_dataset,
    "phase2",
    params.calibration_precisions,
    params.calibration_batches,
    seed=params.seed + 1000,
    **measure,
)
columns = (
    "phase",
    "precision",
    "batches",
    "powered",
    "parent_grad_norm",
    "roundoff_relative",
    "norm_rule_detectable_coefficient",
    "projection_detectable_coefficient",
    "weakest_margin_at_recipe_gamma",
)
print("| " + " | ".join(columns) + " |")
print("|" + "---|" * len(columns))
for row in phase_table(points):
    print("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns) + " |")
print(false_alarms(points))
print(separation_margins(points)["verdict"])
