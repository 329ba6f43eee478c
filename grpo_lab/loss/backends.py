"""The loss backend names, the default, their help text and `resolve_backend`: the one check of a backend name.

A name is checked once, where it enters (a config's `__post_init__`, `set_loss_backend`, `logprob_backend`); the
code below takes the resolved name and never checks it again, so a training step checks nothing.

- `grpo_lab` (the default): this project's chunked head, the Triton kernel on CUDA and the chunked torch path
  elsewhere (`heads.grpo_lab`).
- `trl`: TRL 1.16's built-in fused LM head (`trl.kernels.ChunkedLogProbFunction`).
- `naive`: the full `[N, V]` logits materialised in fp32 (the pre-fused baseline).
- `liger`: Liger-Kernel's `LigerFusedLinearGRPOLoss`. It fuses the loss too, so it has no log-prob head: the trainer
  switch swaps TRL's `_compute_loss` for it instead (`liger`).
"""

from __future__ import annotations

__all__ = ["BACKEND_HELP", "DEFAULT_LOSS_BACKEND", "LOGPROB_BACKENDS", "LOSS_BACKENDS", "resolve_backend"]

LOSS_BACKENDS = ("trl", "grpo_lab", "naive", "liger")
LOGPROB_BACKENDS = ("trl", "grpo_lab", "naive")  # the backends with a log-prob head (all but liger)
DEFAULT_LOSS_BACKEND = "grpo_lab"

BACKEND_HELP = (
    "How the GRPO log-probs / loss are computed: 'grpo_lab' (this project's chunked kernel: Triton on CUDA, chunked "
    "torch elsewhere), 'trl' (TRL's built-in fused LM head), 'naive' (full logits materialised, the pre-fused "
    "baseline) or 'liger' (Liger-Kernel's LigerFusedLinearGRPOLoss, GRPOTrainer only; needs the `liger` extra)."
)


def resolve_backend(name: str, *, logprob_head: bool = False) -> str:
    """`name` if it is a loss backend (with `logprob_head`: one that has a log-prob head), else a `ValueError`."""
    if not isinstance(name, str) or name not in LOSS_BACKENDS:
        raise ValueError(f"Unknown loss_backend {name!r}; expected one of {', '.join(LOSS_BACKENDS)}.")
    if logprob_head and name not in LOGPROB_BACKENDS:
        raise ValueError(f"loss_backend {name!r} fuses the whole GRPO loss (LigerFusedLinearGRPOLoss), not only the "
                         "log-probs: it has no log-prob head. Use it through the trainer switch (set_loss_backend) "
                         f"or grpo_lab.loss.liger; the log-prob backends are {', '.join(LOGPROB_BACKENDS)}.")
    return name
