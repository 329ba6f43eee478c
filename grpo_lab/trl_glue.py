"""The one `loss_backend` switch for TRL's `GRPOTrainer` and `AsyncGRPOTrainer`.

TRL 1.16 computes every GRPO log-prob through `trl.trainer.utils._ChunkedLogProbFunction.apply` (inside the fused
LM head it patches onto the model), then runs its own loss math on the `(B, T)` log-probs. grpo-lab puts a
dispatcher in that slot: while a trainer whose backend is `grpo_lab` or `naive` is computing log-probs, the call goes
to that backend; at any other time (other trainers, generation, user code) it goes to TRL's own function. So TRL's
loss code runs unchanged for every option. `liger` fuses the loss too, so for it the trainer's `_compute_loss` is
swapped for Liger's `LigerFusedLinearGRPOLoss` (see `backends.liger`).

Use it in one line, either way:

    trainer = GRPOLabTrainer(model, reward_funcs, args=GRPOLabConfig(..., loss_backend="grpo_lab"), ...)
    set_loss_backend(existing_trainer, "naive")        # any GRPOTrainer / AsyncGRPOTrainer instance
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

from trl import GRPOConfig, GRPOTrainer

from .backends import LOGPROB_BACKENDS, check_backend_name, get_logprob_backend

_ACTIVE_LOGPROB_FN: contextvars.ContextVar = contextvars.ContextVar("grpo_lab_logprob_fn", default=None)


class _LogProbDispatcher:
    """Stands in for TRL's `_ChunkedLogProbFunction`: routes `.apply` to the active backend, else to TRL's own."""

    def __init__(self, trl_function):
        self.trl_function = trl_function

    def apply(self, *args):
        fn = _ACTIVE_LOGPROB_FN.get()
        return self.trl_function.apply(*args) if fn is None else fn(*args)


def _install_dispatcher() -> None:
    import trl.trainer.utils as trl_utils

    if not isinstance(trl_utils._ChunkedLogProbFunction, _LogProbDispatcher):
        trl_utils._ChunkedLogProbFunction = _LogProbDispatcher(trl_utils._ChunkedLogProbFunction)


@contextlib.contextmanager
def logprob_backend(name: str):
    """Inside this block, TRL's fused LM head computes log-probs with backend `name` (`trl`: TRL's own)."""
    check_backend_name(name)
    if name not in LOGPROB_BACKENDS:
        raise ValueError(f"{name!r} is not a log-prob backend; choose one of {', '.join(LOGPROB_BACKENDS)}.")
    _install_dispatcher()
    token = _ACTIVE_LOGPROB_FN.set(None if name == "trl" else get_logprob_backend(name))
    try:
        yield
    finally:
        _ACTIVE_LOGPROB_FN.reset(token)


def _scoped(method, name: str):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with logprob_backend(name):
            return method(*args, **kwargs)

    wrapper._grpo_lab_original = getattr(method, "_grpo_lab_original", method)
    return wrapper


# The trainer methods inside which every training-time log-prob is computed (old/ref log-probs included).
_SCOPED_METHODS = ("compute_loss", "_get_per_token_logps_and_entropies")


def set_loss_backend(trainer, name: str):
    """Make `trainer` (a TRL `GRPOTrainer` or `AsyncGRPOTrainer`) compute its GRPO loss with backend `name`.

    Calling it again switches backends; `trl` restores TRL's own behaviour. Returns the trainer.
    """
    check_backend_name(name)
    if name == "liger":  # refuse before touching the trainer: a failed switch leaves it as it was
        from .backends.liger import check_liger_supports

        check_liger_supports(trainer)
    for attr in (*_SCOPED_METHODS, "_compute_loss"):
        current = trainer.__dict__.get(attr)
        if current is not None and hasattr(current, "_grpo_lab_original"):
            del trainer.__dict__[attr]  # back to the class's own method
    if name == "liger":
        from .backends.liger import liger_compute_loss

        trainer._compute_loss = _mark(functools.partial(liger_compute_loss, trainer))
    elif name != "trl":
        for attr in _SCOPED_METHODS:
            method = getattr(trainer, attr, None)
            if method is not None:
                setattr(trainer, attr, _scoped(method, name))
    trainer.loss_backend = name
    return trainer


def _mark(fn):
    fn._grpo_lab_original = fn
    return fn


_BACKEND_HELP = (
    "How the GRPO log-probs / loss are computed: 'grpo_lab' (this project's chunked kernel: Triton on CUDA, chunked "
    "torch elsewhere), 'trl' (TRL's built-in fused LM head), 'naive' (full logits materialised, the pre-fused "
    "baseline) or 'liger' (Liger-Kernel's LigerFusedLinearGRPOLoss; needs the `liger` extra)."
)


@dataclass
class GRPOLabConfig(GRPOConfig):
    r"""
    TRL's [`GRPOConfig`] plus one field.

    Args:
        loss_backend (`str`, *optional*, defaults to `"grpo_lab"`):
            How the GRPO log-probs / loss are computed: `"grpo_lab"`, `"trl"`, `"naive"` or `"liger"`.
    """

    loss_backend: str = field(default="grpo_lab", metadata={"help": _BACKEND_HELP})

    def __post_init__(self):
        check_backend_name(self.loss_backend)
        super().__post_init__()


class GRPOLabTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` honouring `args.loss_backend` (a plain `GRPOConfig` means `grpo_lab`)."""

    def __init__(self, *args, loss_backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        set_loss_backend(self, loss_backend or getattr(self.args, "loss_backend", "grpo_lab"))


def __getattr__(name):
    # The async classes live in `grpo_lab.async_loop` (importing trl.experimental pulls in more than most users need).
    if name == "AsyncGRPOLabConfig":
        from .async_loop.config import AsyncGRPOLabConfig

        return AsyncGRPOLabConfig
    if name == "AsyncGRPOLabTrainer":
        from .async_loop.trainer import AsyncGRPOLabTrainer

        return AsyncGRPOLabTrainer
    raise AttributeError(name)
