"""`AsyncGRPOLabConfig`: TRL's `AsyncGRPOConfig` plus what the grpo_lab async loop adds."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..lab.settings import check_as
from ..loss.backends import BACKEND_HELP, DEFAULT_LOSS_BACKEND, resolve_backend
from .loop_settings import LoopSettings, inflight_tasks  # noqa: F401 - inflight_tasks: its old import path


@dataclass
class AsyncGRPOLabConfig(AsyncGRPOConfig):
    """TRL's `AsyncGRPOConfig` plus the fields of the grpo_lab async loop (each field's help says what it is). Every TRL
    field keeps its meaning; without CUDA `bf16` defaults to False (the replicas serve float32, and the importance
    ratio compares their log-probs with the trainer's). Liger's loss is not the async trainer's, so "liger" is
    refused. `group_consistent_versions` (False: TRL's behaviour) keeps a group's advantages within one policy and
    its prefix on one replica. The two timeouts bound what TRL waits minutes to hours (or forever) for."""

    loss_backend: str = field(default=DEFAULT_LOSS_BACKEND, metadata={"help": BACKEND_HELP})
    tree_attention: str = field(default=LoopSettings.tree_attention,
                                metadata={"help": "Tree attention: auto, sdpa, flex or fa3."})
    adapter_storage: str | None = field(
        default=None, metadata={"help": "Where adapters are published (path or fsspec URL); default "
                                        "<output_dir>/.vllm_lora."})
    adapter_replica_root: str | None = field(
        default=None, metadata={"help": "The replicas' path for adapter_storage (a bucket's mount point)."})
    checkpoint_storage: str | None = field(
        default=None, metadata={"help": "Also publish each complete checkpoint here (fsspec URL), for resuming on "
                                        "another machine."})
    group_consistent_versions: bool = field(
        default=True, metadata={"help": "All rollouts of a prompt use one policy version."})
    rollout_failure_timeout_s: float = field(
        default=LoopSettings.rollout_failure_timeout,
        metadata={"help": "Seconds of failing rollout requests before the run stops with an error."})
    control_timeout_s: float = field(
        default=600.0, metadata={"help": "Timeout of each control call (pause, resume, adapter load/unload, info)."})

    def __post_init__(self):
        resolve_backend(self.loss_backend)
        if self.loss_backend == "liger":
            raise ValueError("loss_backend='liger' is not available with AsyncGRPOTrainer: its loss (token-level "
                             "clip normalised by the global token count) is not one Liger computes.")
        check_as(LoopSettings, self, {"tree_attention": "tree_attention", "max_staleness": "max_staleness",
                                      "rollout_failure_timeout_s": "rollout_failure_timeout"})
        if self.control_timeout_s <= 0:
            raise ValueError(f"control_timeout_s must be > 0, got {self.control_timeout_s}")
        if self.bf16 is None and not self.fp16:
            import torch

            self.bf16 = bool(torch.cuda.is_available()) and not self.use_cpu
        super().__post_init__()
