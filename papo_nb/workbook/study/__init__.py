"""Notebook 04: GRPO against PAPO-G on a policy that reads its images (arms, statistics, plots)."""
