"""Argument names that changed across the transformers versions the kit supports (>= 4.56.2)."""

from __future__ import annotations

import dataclasses
import functools


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
