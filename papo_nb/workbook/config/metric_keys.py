"""The metric names every notebook, the study runs and ``papo-nb train`` share, so one runs-table column or one
chart compares any two runs.

- Held-out accuracy: ``HELDOUT_ACCURACY``, greedy decoding on the original images over the run's whole held-out set
  (03: its held-out split; 05: the mean over the benchmarks, as the paper averages them; a study arm: its held-out
  set). Each notebook keeps its finer keys (splits, avg@k, masked) beside it.
- Training curves: TRL's own per-step names (``reward``, ``perception_kl``, ``entropy``, ...), unprefixed, as TRL's
  MLflow callback logs them in 03 and ``papo-nb train``; the study's arms log the same names.
"""

from __future__ import annotations

HELDOUT_ACCURACY = "eval/accuracy_original"
