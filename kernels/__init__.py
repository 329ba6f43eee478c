"""Triton kernels of grpo-lab, installed as `grpo_lab.kernels` (never as a top-level `kernels` module)."""

import importlib.util

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
