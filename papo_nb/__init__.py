"""papo_nb: a notebook workbook for PAPO-G on TRL 1.9.1's GRPOTrainer."""

__version__ = "0.1.0"
