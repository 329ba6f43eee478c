"""The log-prob heads, one module each, behind `logprob_head(name)`.

Each head answers TRL's `ChunkedLogProbFunction.apply` call (`contract`); its module is imported on first use, so
asking for `naive` never imports TRL or Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..backends import resolve_backend

__all__ = ["logprob_head"]


def logprob_head(name: str) -> Callable:
    """The log-prob function of backend `name`, with TRL's `ChunkedLogProbFunction.apply` signature. An unknown name
    and `liger` (which has no log-prob head) raise `backends.resolve_backend`'s `ValueError`."""
    name = resolve_backend(name, logprob_head=True)  # the one place that words a bad name's error
    # each head is the module of this package named after its backend, its function `<name>_logprobs`
    return getattr(importlib.import_module(f"{__name__}.{name}"), f"{name}_logprobs")
