"""The library behind the notebooks: parameters, the one trainer builder, batches, provenance, calibration, evaluation, figures."""
