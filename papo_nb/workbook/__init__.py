"""The library behind the notebooks, one subpackage per notebook it serves.

| notebook | subpackage |
| --- | --- |
| every notebook | ``config`` (the parameter schema, batch arithmetic, model paths and devices) |
| 01 contract verification, 02 probe calibration | ``verification`` (provenance, rollout batches, calibration) |
| 03 training run | ``training`` (the one trainer builder, checkpoints, review, figures) |
| 04 method study | ``study`` (arms, the collapse detector, statistics, claims, tables, plots) |
| 05 evaluation | ``evaluation`` (held-out reliance, the official benchmarks protocol) |
| 03 and 05 on the paper's recipe | ``recipe`` (official data, presets, preflight, reward) |
"""
