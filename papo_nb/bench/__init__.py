"""The step-overhead benchmark: PAPO-G against GRPO, side by side on one batch."""
