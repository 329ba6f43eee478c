"""grpo_lab.memory — peak memory of real TRL GRPO steps in fresh processes: notebook 01's sweep, notebook 02's FSDP2 +
LoRA max-batch search, and the memory planner. See docs/memory.md.

    from grpo_lab.memory import PointSpec, run_point
    run_point(PointSpec(model="Qwen3-0.6B", loss_backend="grpo_lab", dtype="bf16", batch_size=16,
                        prompt_len=256, completion_len=512))          # {'status': 'ok', 'peak_bytes': ..., ...}
"""

from .probe import ProbeError, run_point
from .spec import PointSpec

__all__ = ["PointSpec", "ProbeError", "run_point"]
