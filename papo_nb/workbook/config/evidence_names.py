"""The artifact names of the evidence the notebooks log (``evidence/...``), one place for the notebooks, the results
page and the tests that read them back. ``tracking.log_evidence(name, ...)`` names its own files
``evidence/<name>.json``; these are the tables and texts the notebooks log with ``mlflow.log_table`` / ``log_text``.
"""

from __future__ import annotations

# 01: contract verification (the probe's record, PROBE, is logged by 03 and by the training runs too)
DRIFT_TABLE = "evidence/drift_table.json"
PROBE = "evidence/probe.json"
# 02: probe calibration
CALIBRATION_POINTS_TABLE = "evidence/calibration_points_table.json"
CALIBRATION_PHASE_TABLE = "evidence/calibration_phase_table.json"
EMULATED_GPU_BLOCKS_TABLE = "evidence/emulated_gpu_blocks_table.json"
# 04: the method study
COLLAPSE_SWEEP = "evidence/collapse_sweep.json"
DOSE_RESPONSE = "evidence/dose_response.json"
DOSE_RESPONSE_MD = "evidence/dose_response.md"
DOSE_CONTRASTS = "evidence/dose_contrasts.json"
STUDY_POWER = "evidence/study_power.json"
STUDY_HEADLINE = "evidence/study_headline.json"
STUDY_SUMMARY_ROWS = "evidence/study_summary_rows.json"
STUDY_TABLE = "evidence/study_table.json"
STUDY_TABLE_MD = "evidence/study_table.md"
STUDY_COLLAPSE = "evidence/study_collapse.json"
PAPER_CLAIMS = "evidence/paper_claims.json"
PAPER_CLAIMS_MD = "evidence/paper_claims.md"
DRIFT_AND_ARM_VERDICTS_MD = "evidence/drift_and_arm_verdicts.md"
ARM_COLLAPSE = "evidence/collapse.json"  # each arm run's collapse verdict
