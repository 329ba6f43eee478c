"""The one `loss_backend` switch for TRL's `GRPOTrainer` and `AsyncGRPOTrainer`.

TRL 1.16 computes every GRPO log-prob through `trl.trainer.utils._ChunkedLogProbFunction.apply`; grpo-lab puts a
dispatcher in that slot, which calls the trainer's backend while that trainer computes log-probs and TRL's own
function at any other time, so TRL's loss code runs unchanged for every option. `liger` fuses the loss too: the
trainer's `_compute_loss` is swapped for it (`liger`). Use it in one line, either way:

    trainer = GRPOLabTrainer(model, reward_funcs, args=GRPOLabConfig(..., loss_backend="grpo_lab"), ...)
    set_loss_backend(existing_trainer, "naive")        # any GRPOTrainer / AsyncGRPOTrainer instance
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

from trl import GRPOConfig, GRPOTrainer

from .backends import BACKEND_HELP, DEFAULT_LOSS_BACKEND, resolve_backend
from .heads import logprob_head

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
def _active_head(head):
    """Inside this block, TRL's fused LM head calls `head` (None: TRL's own function)."""
    _install_dispatcher()
    token = _ACTIVE_LOGPROB_FN.set(head)
    try:
        yield
    finally:
        _ACTIVE_LOGPROB_FN.reset(token)


def _head_of(name: str):
    """The function TRL's fused LM head should call for the resolved log-prob backend `name` (None: TRL's own)."""
    return None if name == "trl" else logprob_head(name)


def logprob_backend(name: str):
    """A context manager: inside it, TRL's fused LM head computes log-probs with backend `name` (`trl`: TRL's own)."""
    return _active_head(_head_of(resolve_backend(name, logprob_head=True)))


def _scoped(method, head):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _active_head(head):
            return method(*args, **kwargs)

    wrapper._grpo_lab_original = getattr(method, "_grpo_lab_original", method)
    return wrapper


# The trainer methods inside which every training-time log-prob is computed (old/ref log-probs included).
_SCOPED_METHODS = ("compute_loss", "_get_per_token_logps_and_entropies")


def set_loss_backend(trainer, name: str):
    """Make `trainer` (a TRL `GRPOTrainer` or `AsyncGRPOTrainer`) compute its GRPO loss with backend `name`.

    Calling it again switches backends; `trl` restores TRL's own behaviour. Returns the trainer.
    """
    name = resolve_backend(name)
    if name == "liger":  # refuse before touching the trainer: a failed switch leaves it as it was
        from .liger import check_liger_supports, liger_compute_loss

        check_liger_supports(trainer)
    for attr in (*_SCOPED_METHODS, "_compute_loss"):
        current = trainer.__dict__.get(attr)
        if current is not None and hasattr(current, "_grpo_lab_original"):
            del trainer.__dict__[attr]  # back to the class's own method
    if name == "liger":
        trainer._compute_loss = functools.partial(liger_compute_loss, trainer)
        trainer._compute_loss._grpo_lab_original = trainer._compute_loss  # ours: the next switch removes it
    elif name != "trl":
        head = _head_of(name)
        for attr in _SCOPED_METHODS:
            method = getattr(trainer, attr, None)
            if method is not None:
                setattr(trainer, attr, _scoped(method, head))
    trainer.loss_backend = name
    return trainer


@dataclass
class GRPOLabConfig(GRPOConfig):
    r"""
    TRL's [`GRPOConfig`] plus one field.

    Args:
        loss_backend (`str`, *optional*, defaults to `"grpo_lab"`):
            How the GRPO log-probs / loss are computed: `"grpo_lab"`, `"trl"`, `"naive"` or `"liger"`.
    """

    loss_backend: str = field(default=DEFAULT_LOSS_BACKEND, metadata={"help": BACKEND_HELP})

    def __post_init__(self):
        resolve_backend(self.loss_backend)
        super().__post_init__()


class GRPOLabTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` honouring `args.loss_backend` (a plain `GRPOConfig` means `grpo_lab`)."""

    def __init__(self, *args, loss_backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        set_loss_backend(self, loss_backend or getattr(self.args, "loss_backend", DEFAULT_LOSS_BACKEND))

