"""Argument names that changed across the transformers versions the kit supports (>= 4.56.2)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings


@functools.lru_cache(maxsize=1)
def _training_argument_names() -> frozenset[str]:
    from transformers import TrainingArguments

    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))


def checkpointing_args(enabled: bool) -> dict:
    """`{"activation_checkpointing": enabled}` on transformers 5.x, `{"gradient_checkpointing": enabled}` before.

    Always pass one: TRL's configs default `gradient_checkpointing=True`, and transformers 5.x warns about the
    deprecated name (a FutureWarning per trainer, pink blocks in a notebook) unless the new one is set."""
    if "activation_checkpointing" in _training_argument_names():
        return {"activation_checkpointing": bool(enabled)}
    return {"gradient_checkpointing": bool(enabled)}


# Deprecations raised inside TRL 1.16's own code under transformers 5.x, which a user of the kit cannot act on (TRL
# reads `model.is_gradient_checkpointing` around every generation). Silenced only where the kit runs a trainer.
UPSTREAM_DEPRECATIONS = (r"`is_gradient_checkpointing` is deprecated",)


@contextlib.contextmanager
def upstream_deprecations_silenced():
    with warnings.catch_warnings():
        for message in UPSTREAM_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield
