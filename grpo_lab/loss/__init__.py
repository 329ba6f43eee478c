"""The loss stack of grpo-lab: the GRPO loss, the log-prob heads behind one backend name, the Triton kernel, and the
switch that puts them under TRL's trainers.

The modules are listed in docs/architecture.md. The names below are imported on first use, so `import grpo_lab.loss`
imports neither TRL nor Triton (nor torch).
"""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "GRPOLossConfig": "config",
    "grpo_loss": "reference",
    "GRPOLossOutput": "reference",
    "DEFAULT_LOSS_BACKEND": "backends",
    "LOSS_BACKENDS": "backends",
    "resolve_backend": "backends",
    "logprob_head": "heads",
    "expect_entropy_grad": "frozen",
    "fused_linear_logprobs": "kernel",
    "GRPOLabFusedLinearGRPOLoss": "fused_module",
    "GRPOLabConfig": "trl_switch",
    "GRPOLabTrainer": "trl_switch",
    "set_loss_backend": "trl_switch",
    "logprob_backend": "trl_switch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
