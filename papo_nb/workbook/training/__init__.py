"""Notebook 03 and ``papo-nb train``: the one trainer builder, the one training path, checkpoints, figures."""
