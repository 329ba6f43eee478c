"""grpo_lab.memory.planner — the peak memory of one GRPO training step, and the largest batch that fits, predicted
without running it (docs/memory.md, section *Memory planner*).

    from grpo_lab.memory.planner import PlannerConfig, plan, max_batch
    plan(PlannerConfig(model="Qwen3-8B", lora_r=16, world_size=4, batch_size=64)).peak_gib
    max_batch(PlannerConfig(model="Qwen3-8B", world_size=4), budget_gib=80).batch

The modules, lowest first: `shapes` (what a model config says about sizes), `config` (`PlannerConfig`), `layer` (a
decoder layer's saved tensors and backward transients), `head` (each loss backend's working set), `predict` (the
step phase by phase: `plan`, `max_batch`, the calibrated constants), `cli` (`grpo-lab plan`), `check` (measure
what it predicts with the harness), `validate` (its error on every committed measurement), `report` (world sizes
and the Liger blog post's setting) and `widgets` (notebook 02's planner panel, imported on first use).
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
