"""Leak-detection power of the gamma-zero probe on the smoke workbook's batches.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python docs/measurements/probe_power.py``. Rebuilds what notebooks 01 and 02 do
with ``params/smoke.yaml`` (each notebook gets only the keys its parameters cell declares, the rest default, as the
papermill runner passes them): notebook 01's probe batch (fp32 and bf16 autocast) and notebook 02's calibration points
(phase 1: fresh adapter; phase 2: after ``phase2_train_steps`` of training), and prints one row per batch.
``gamma x power`` is the power for a leak of the gamma-weighted perception term instead of the unweighted one.
"""

import tempfile
from pathlib import Path

import papermill
import torch

from papo_nb.papo.probe import probe_batch
from papo_nb.train.runner import run_training
from papo_nb.workbook.config.params import load_params, validate_params
from papo_nb.workbook.training.run import prepare_training
from papo_nb.workbook.verification.batches import rollout_batch
from papo_nb.workbook.verification.calibration import calibrate_phase, weakest_power

ROOT = Path(__file__).resolve().parents[2]
smoke = load_params(ROOT / "params" / "smoke.yaml").model_dump()


def notebook_params(name: str):
    declared = papermill.inspect_notebook(str(ROOT / "notebooks" / name))
    return validate_params({k: v for k, v in smoke.items() if k in declared})


params = notebook_params("01_contract_verification.ipynb")
work = Path(tempfile.mkdtemp())
rows = []
trainer, _, _ = prepare_training(params, work / "probe", save_strategy="no")
gamma = trainer.current_gamma()
batch = rollout_batch(trainer, trainer.train_dataset, n_prompts=2, seed=params.seed)
for precision in ("fp32", "bf16"):
    dtype = torch.bfloat16 if precision == "bf16" else None
    ev = probe_batch(trainer, batch, autocast_dtype=dtype, raise_on_failure=False)
    rows.append(
        ("nb01 probe batch", precision, ev.status, ev.leak_detection_power, ev.perception_grad_norm, ev.tolerance)
    )
del trainer
params = notebook_params("02_probe_calibration.ipynb")
trainer, _, _ = prepare_training(params, work / "phase1", save_strategy="no")
calibration = dict(leak_scale=params.injected_leak_scale)
points = calibrate_phase(
    trainer,
    trainer.train_dataset,
    "phase1",
    params.calibration_precisions,
    params.calibration_batches,
    seed=params.seed,
    **calibration,
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
    **calibration,
)
for p in points:
    rows.append(
        (
            f"nb02 {p.phase} batch {p.batch}",
            p.precision,
            "",
            p.leak_detection_power,
            p.perception_grad_norm,
            p.tolerance,
        )
    )
print(
    "| batch | precision | probe status | leak_detection_power | grad perception | tolerance "
    f"| gamma x power ({gamma}) |"
)
print("| --- | --- | --- | --- | --- | --- | --- |")
for source, precision, status, power, grad, tol in rows:
    print(f"| {source} | {precision} | {status} | {power:.3g} | {grad:.3e} | {tol:.3e} | {gamma * power:.3g} |")
print(weakest_power(points)["statement"])
