"""grpo_lab.memory — peak memory of real TRL GRPO steps, fresh-process probes, the sweep behind notebook 01 and the
FSDP2 + LoRA max-batch search behind notebook 02. See docs/memory.md.

    from grpo_lab.memory import PointSpec, run_point
    run_point(PointSpec(model="Qwen3-0.6B", loss_backend="grpo_lab", dtype="bf16", batch_size=16,
                        prompt_len=256, completion_len=512))          # {'status': 'ok', 'peak_bytes': ..., ...}
"""

from .probe import ProbeError, run_point
from .spec import PointSpec

__all__ = ["PointSpec", "ProbeError", "run_point"]
