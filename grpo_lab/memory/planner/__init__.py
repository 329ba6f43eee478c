"""grpo_lab.memory.planner — the peak memory of one GRPO training step, and the largest batch that fits, predicted
without running it (docs/memory.md, section *Memory planner*).

    from grpo_lab.memory.planner import PlannerConfig, plan, max_batch
    plan(PlannerConfig(model="Qwen3-8B", lora_r=16, world_size=4, batch_size=64)).peak_gib
    max_batch(PlannerConfig(model="Qwen3-8B", world_size=4), budget_gib=80).batch

The modules, lowest first, are listed in docs/memory.md (*Where*); `widgets`, notebook 02's panel, loads on first use.
"""

from .predict import (ALLOCATOR_HEADROOM, CPU_RSS_OVERHEAD_BYTES, CPU_RSS_SLACK, CUDA_WORKSPACE_BYTES,
                      DEFAULT_ALLOCATOR_BAND, EXPANDABLE_SEGMENTS_HEADROOM, GiB, MaxBatch, MemoryPlan, PlannerConfig,
                      max_batch, max_batch_band, plan, plan_loss_only, usable_budget)

# notebook 02's panel: pandas, matplotlib and ipywidgets, loaded only when asked for
_WIDGETS = ("PlannerPanel", "searches_against_planner", "with_committed_searches")

__all__ = ["ALLOCATOR_HEADROOM", "CPU_RSS_OVERHEAD_BYTES", "CPU_RSS_SLACK", "CUDA_WORKSPACE_BYTES",
           "DEFAULT_ALLOCATOR_BAND", "EXPANDABLE_SEGMENTS_HEADROOM", "GiB", "MaxBatch", "MemoryPlan", "PlannerConfig",
           "max_batch", "max_batch_band", "plan", "plan_loss_only", "usable_budget", *_WIDGETS]


def __getattr__(name: str):
    if name in _WIDGETS:
        from . import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
