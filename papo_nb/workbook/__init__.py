"""The library behind the notebooks: parameters and preflight, the one trainer builder, rollout batches,
provenance, calibration, evaluation, figures."""
