"""The step-overhead benchmark: PAPO-G against GRPO, side by side on one batch (harness, timing, memory, report,
main)."""
