"""Notebook 05 and held-out checks: accuracy with original and masked images, the official avg@k protocol."""
