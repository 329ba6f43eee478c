"""The loss backend names, the default, their help text, how results show them (order, references, colours) and
`resolve_backend`: the one check of a backend name. Every other module imports the names from here.

A name is checked once, where it enters (a config's `__post_init__`, `set_loss_backend`, `logprob_backend`). What
each backend is: `BACKEND_HELP`; `liger` fuses the loss too, so it has no log-prob head (the trainer switch swaps
TRL's `_compute_loss` for it instead).
"""

from __future__ import annotations

__all__ = ["BACKEND_COLORS", "BACKEND_HELP", "BACKEND_MARKERS", "BASELINE_BACKEND", "DEFAULT_LOSS_BACKEND",
           "DISPLAY_ORDER", "FUSED_BACKENDS", "LOGPROB_BACKENDS", "LOSS_BACKENDS", "REFERENCE_BACKENDS",
           "in_display_order", "resolve_backend"]

LOSS_BACKENDS = ("trl", "grpo_lab", "naive", "liger")
LOGPROB_BACKENDS = ("trl", "grpo_lab", "naive")  # the backends with a log-prob head (all but liger)
DEFAULT_LOSS_BACKEND = "grpo_lab"

# How results speak of them: memory savings and max-batch ratios are taken against the unfused baseline and against
# TRL's own fused head; tables, legends and figures list the baseline first, then the others in LOSS_BACKENDS order.
BASELINE_BACKEND = "naive"
REFERENCE_BACKENDS = (BASELINE_BACKEND, "trl")
FUSED_BACKENDS = tuple(name for name in LOSS_BACKENDS if name != BASELINE_BACKEND)  # never hold [N, V] logits
DISPLAY_ORDER = (BASELINE_BACKEND, *FUSED_BACKENDS)
# matplotlib's tab:red, tab:blue, tab:green, tab:purple
BACKEND_COLORS = {"naive": "#d62728", "trl": "#1f77b4", "grpo_lab": "#2ca02c", "liger": "#9467bd"}
BACKEND_MARKERS = {"naive": "o", "trl": "s", "grpo_lab": "^", "liger": "D"}

BACKEND_HELP = (
    "How the GRPO log-probs / loss are computed: 'grpo_lab' (this project's chunked kernel: Triton on CUDA, chunked "
    "torch elsewhere), 'trl' (TRL's built-in fused LM head), 'naive' (full logits materialised, the pre-fused "
    "baseline) or 'liger' (Liger-Kernel's LigerFusedLinearGRPOLoss, GRPOTrainer only; needs the `liger` extra)."
)


def in_display_order(names) -> list[str]:
    """`names` without repeats, the loss backends in `DISPLAY_ORDER` first and anything else after, as given."""
    names = list(dict.fromkeys(names))
    return [b for b in DISPLAY_ORDER if b in names] + [b for b in names if b not in DISPLAY_ORDER]


def resolve_backend(name: str, *, logprob_head: bool = False) -> str:
    """`name` if it is a loss backend (with `logprob_head`: one that has a log-prob head), else a `ValueError`."""
    if not isinstance(name, str) or name not in LOSS_BACKENDS:
        raise ValueError(f"Unknown loss_backend {name!r}; expected one of {', '.join(LOSS_BACKENDS)}.")
    if logprob_head and name not in LOGPROB_BACKENDS:
        raise ValueError(f"loss_backend {name!r} fuses the whole GRPO loss (LigerFusedLinearGRPOLoss), not only the "
                         "log-probs: it has no log-prob head. Use it through the trainer switch (set_loss_backend) "
                         f"or grpo_lab.loss.liger; the log-prob backends are {', '.join(LOGPROB_BACKENDS)}.")
    return name
