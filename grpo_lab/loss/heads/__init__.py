"""The log-prob heads, one module each, behind `logprob_head(name)`.

Each head answers TRL's `ChunkedLogProbFunction.apply` call (`contract`): `chunked` (grpo-lab's chunked torch path),
`grpo_lab` (the Triton kernel where it runs, else `chunked`), `naive` (full logits, the baseline) and `trl` (TRL's
own). A head module is imported on first use, so asking for `naive` never imports TRL or Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..backends import resolve_backend

__all__ = ["logprob_head"]

# backend name -> (module of this package, function)
_HEADS = {
    "grpo_lab": ("grpo_lab", "grpo_lab_logprobs"),
    "naive": ("naive", "naive_logprobs"),
    "trl": ("trl", "trl_logprobs"),
}


def logprob_head(name: str) -> Callable:
    """The log-prob function of backend `name`, with TRL's `ChunkedLogProbFunction.apply` signature. An unknown name
    and `liger` (which has no log-prob head) raise `backends.resolve_backend`'s `ValueError`."""
    if not isinstance(name, str) or name not in _HEADS:
        resolve_backend(name, logprob_head=True)  # raises: the one place that words a bad name's error
    module, function = _HEADS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)
