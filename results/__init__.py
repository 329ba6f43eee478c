"""Committed reproduction results (installed as `grpo_lab.reference_results`), read by the notebooks by default."""
