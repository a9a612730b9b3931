"""Notebooks 01 and 02: the pinned source and contract, fixed rollout batches, the probe's calibration."""
