"""Log-prob backends behind the one `loss_backend` switch.

- `trl`: TRL 1.16's built-in fused LM head (`trl.kernels.ChunkedLogProbFunction`).
- `grpo_lab`: this project's chunked kernel: Triton on CUDA (`grpo_lab.kernels`), the chunked torch path elsewhere;
  a head that needs no gradient (LoRA) takes its two-GEMM frozen path (`head_mode`; `expect_entropy_grad` tells it an
  entropy bonus is coming).
- `naive`: the full `[N, V]` logits materialised in fp32 (the pre-fused baseline).
- `liger`: Liger-Kernel's `LigerFusedLinearGRPOLoss`. It fuses the loss too, so it is not a log-prob backend: the
  trainer glue swaps TRL's `_compute_loss` for it instead (`grpo_lab.backends.liger`).
"""

from __future__ import annotations

from collections.abc import Callable

from .base import expect_entropy_grad, head_mode

__all__ = ["LOSS_BACKENDS", "LOGPROB_BACKENDS", "check_backend_name", "expect_entropy_grad", "get_logprob_backend",
           "head_mode"]

LOSS_BACKENDS = ("trl", "grpo_lab", "naive", "liger")
LOGPROB_BACKENDS = ("trl", "grpo_lab", "naive")


def check_backend_name(name: str) -> str:
    if not isinstance(name, str) or name not in LOSS_BACKENDS:
        raise ValueError(f"Unknown loss_backend {name!r}; expected one of {', '.join(LOSS_BACKENDS)}.")
    return name


def get_logprob_backend(name: str) -> Callable:
    """The callable of backend `name`, with TRL's `ChunkedLogProbFunction.apply` signature."""
    check_backend_name(name)
    if name == "trl":
        from .trl_head import trl_logprobs

        return trl_logprobs
    if name == "naive":
        from .naive import naive_logprobs

        return naive_logprobs
    if name == "grpo_lab":
        from .dispatch import grpo_lab_logprobs

        return grpo_lab_logprobs
    raise ValueError("loss_backend 'liger' fuses the whole GRPO loss (LigerFusedLinearGRPOLoss), not only the "
                     "log-probs: it has no log-prob function. Use it through the trainer switch or "
                     "grpo_lab.backends.liger.")
