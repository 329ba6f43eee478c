"""`AsyncGRPOLabConfig`: TRL's `AsyncGRPOConfig` plus what the grpo_lab async loop adds."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..loss.backends import BACKEND_HELP, DEFAULT_LOSS_BACKEND, resolve_backend
from .loop_settings import LoopSettings, check_setting, inflight_tasks  # noqa: F401 - inflight_tasks: its old import path
from .tree_attention import CHOICES as TREE_ATTENTION_CHOICES


@dataclass
class AsyncGRPOLabConfig(AsyncGRPOConfig):
    r"""
    TRL's [`AsyncGRPOConfig`] plus the fields of the grpo_lab async loop. Every TRL field keeps its meaning; on a
    machine without CUDA, `bf16` defaults to `False` (the replicas serve float32, and the importance ratio compares
    their log-probs with the trainer's).

    Args:
        loss_backend (`str`, *optional*, defaults to `"grpo_lab"`):
            How the GRPO log-probs are computed: `"grpo_lab"`, `"trl"` or `"naive"` (Liger's loss is not the async
            trainer's loss, so `"liger"` is refused).
        tree_attention (`str`, *optional*, defaults to `"auto"`):
            Attention over TRL's packed prefix-trie rows: `"sdpa"` (dense ancestor mask, runs everywhere), `"flex"`
            (FlexAttention block mask, CUDA), `"fa3"` (TRL's Hub flash-attention-3 kernel, Hopper + network) or
            `"auto"` (fa3 where available, else flex on CUDA, else sdpa).
        adapter_storage (`str`, *optional*):
            Where adapter versions are published: a local or mounted directory, or any fsspec URL. Defaults to
            `<output_dir>/.vllm_lora`, as TRL. Every replica must be able to read it.
        adapter_replica_root (`str`, *optional*):
            What the replicas call `adapter_storage` (the mount point of a bucket on their hosts); defaults to the
            same path or URL.
        checkpoint_storage (`str`, *optional*):
            Where each complete checkpoint is also published (any fsspec URL, e.g. `s3://bucket/run1/checkpoints`;
            files first, manifest last), so a resume on another machine can pull the last one back
            (`checkpoint_store.pull_last_checkpoint`). None: checkpoints stay in `output_dir` only.
        group_consistent_versions (`bool`, *optional*, defaults to `True`):
            Generate all `num_generations` rollouts of a prompt with the policy version current when its first
            rollout started. The group's advantages then compare rollouts of one policy, and the other G-1
            rollouts find the first one's KV prefix on the replica the router sent it to. `False` is TRL's
            behaviour (each rollout names the version current when it starts).
        rollout_failure_timeout_s (`float`, *optional*, defaults to `120.0`):
            How long a rollout request may keep failing (router or replicas unreachable, 5xx) before the rollout
            worker stops with an error and the trainer raises it. TRL retries far longer (minutes to hours).
        control_timeout_s (`float`, *optional*, defaults to `600.0`):
            Timeout of every control call the trainer makes (`/pause`, `/resume`, adapter load and unload,
            `/server_info`, `/v1/models`). TRL's own client waits up to 1800 s, or forever for the info calls.
    """

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
        if self.tree_attention not in TREE_ATTENTION_CHOICES:
            raise ValueError(f"tree_attention must be one of {', '.join(TREE_ATTENTION_CHOICES)}, "
                             f"got {self.tree_attention!r}")
        if self.rollout_failure_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ValueError("rollout_failure_timeout_s and control_timeout_s must be > 0")
        check_setting(LoopSettings, "max_staleness", self.max_staleness)
        if self.bf16 is None and not self.fp16:
            import torch

            self.bf16 = bool(torch.cuda.is_available()) and not self.use_cpu
        super().__post_init__()
