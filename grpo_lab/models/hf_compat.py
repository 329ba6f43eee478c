"""Argument names that changed across the transformers versions the kit supports (>= 4.56.2)."""

from __future__ import annotations

import contextlib
import warnings


def checkpointing_args(enabled: bool) -> dict:
    """`{"activation_checkpointing": enabled}` on transformers 5.x, `{"gradient_checkpointing": enabled}` before.

    Always pass one: TRL's configs default `gradient_checkpointing=True`, and transformers 5.x warns about the
    deprecated name (a FutureWarning per trainer, pink blocks in a notebook) unless the new one is set."""
    from transformers import TrainingArguments

    new = "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    return {"activation_checkpointing" if new else "gradient_checkpointing": bool(enabled)}


# Deprecations raised inside TRL 1.16's own code under transformers 5.x, which a user of the kit cannot act on (TRL
# reads `model.is_gradient_checkpointing` around every generation). Silenced only where the kit runs a trainer.
UPSTREAM_DEPRECATIONS = (r"`is_gradient_checkpointing` is deprecated",)


@contextlib.contextmanager
def upstream_deprecations_silenced():
    with warnings.catch_warnings():
        for message in UPSTREAM_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield


def cache_keyword(model) -> str:
    """The keyword a causal LM's forward takes its KV cache by: `cache` on newer transformers 5.x,
    `past_key_values` before. An unknown keyword is swallowed by `**kwargs` and the model silently builds a cache of
    its own, so the caller's cache stays empty (a CPU replica then failed every prompt of 16+ tokens on 5.17)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
