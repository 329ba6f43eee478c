"""Exact live tensor bytes on any device: the oracle the planner's terms are checked against on CPU.

A `TorchDispatchMode` that registers every storage an op creates and drops it when freed: what
`torch.cuda.max_memory_allocated` counts, without the allocator's rounding or RSS's noise, on any device.

    with LiveTensorBytes() as live:
        loss = model(x).sum(); loss.backward()
    live.peak
"""

from __future__ import annotations

import tempfile
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grpo_lab.lab import environment


def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return None


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops create while the mode is active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def _register(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        if self._sizes.pop(key, None) is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = _storage_key(t)
                if key is not None and key not in inputs:
                    self._register(t)
        return out


def traced_step_peak(spec, gradient_checkpointing: bool = True) -> dict:
    """Run `spec.steps` real TRL GRPO steps of `spec` (a `PointSpec`, CPU, one process, no FSDP) in this process
    under `LiveTensorBytes`; returns the training phases' peak of live tensor bytes created during training
    (`peak_bytes`) and the parameters' bytes (`setup_bytes`). `gradient_checkpointing=False` turns off TRL's
    default activation checkpointing."""
    from transformers import TrainerCallback

    from .grpo_step import make_trainer

    if spec.fsdp or spec.world_size != 1:
        raise ValueError("traced_step_peak runs one process without FSDP")
    live = LiveTensorBytes()
    peaks = []

    class _Phases(TrainerCallback):
        def on_step_begin(self, *a, **k):
            live.reset_peak()

        def on_step_end(self, *a, **k):
            peaks.append(live.peak)

    environment.silence_trl_experimental()
    with tempfile.TemporaryDirectory(prefix="grpo_lab_trace_") as out:
        trainer = make_trainer(spec, out, torch.device("cpu"), callbacks=[_Phases()])
        if not gradient_checkpointing:  # transformers >= 5.20 reads `activation_checkpointing` (the old name's alias)
            for name in ("gradient_checkpointing", "activation_checkpointing"):
                if hasattr(trainer.args, name):
                    setattr(trainer.args, name, False)
        generate = trainer._generate_and_score_completions

        def scored(*a, **k):  # the scoring phase is not the training step's: restart the peak after it
            result = generate(*a, **k)
            live.reset_peak()
            return result

        trainer._generate_and_score_completions = scored
        setup = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        with live:
            trainer.train()
    return {"peak_bytes": max(peaks), "setup_bytes": setup}
