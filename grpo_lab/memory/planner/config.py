"""What the memory planner is asked about: one GRPO training setting, as a documented dataclass. Bad input fails
here with a plain `ValueError` (the CLI turns it into one line on stderr).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..spec import StepSetting

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEVICES = ("cuda", "cpu")
ATTENTIONS = ("auto", "flash", "math", "cpu_flash")


@dataclass(frozen=True)
class PlannerConfig(StepSetting):
    r"""
    One GRPO training setting whose per-device peak memory the planner predicts: the six coordinates of
    `grpo_lab.memory.spec.StepSetting` (checked there), with a one-GPU default setting, and how the step runs.

    The step is the one `grpo_lab.memory` measures: TRL 1.16's `GRPOTrainer` (through `GRPOLabTrainer`), AdamW
    (transformers' default `adamw_torch_fused`), `beta=0`, `num_iterations=1`, completions of exactly
    `completion_len` tokens; generation (vLLM or `model.generate`) is not part of it.

    Args:
        model (`str`, defaults to `"Qwen3-0.6B"`):
            A config shipped in `data/configs`, a tiny preset, or any name with a `transformers` config object as
            `model_config`.
        loss_backend (`str`, defaults to `"grpo_lab"`):
            One of `grpo_lab.loss.backends.LOSS_BACKENDS`.
        dtype (`str`, defaults to `"bf16"`):
            `"bf16"` or `"fp32"`: the model, its LoRA adapters and AdamW's state are all in this dtype.
        batch_size (`int`, defaults to `8`):
            Sequences per device in one optimizer step (TRL's `per_device_train_batch_size`).
        prompt_len (`int`, defaults to `256`), completion_len (`int`, defaults to `512`):
            Tokens per prompt and per completion; every sequence is `prompt_len + completion_len` long.
        lora_r (`int`, defaults to `16`):
            LoRA rank on `lora_targets` (adapters in the model dtype); `0` is full fine-tuning.
        lora_targets (`tuple[str, ...]`, defaults to all seven linear layers of a decoder layer):
            The projections that get adapters (PEFT's `"all-linear"` on Qwen: never the LM head).
        world_size (`int`, defaults to `1`):
            Devices of one FSDP2 group; the batch is per device.
        fsdp (`bool` or `None`, defaults to `None`):
            Shard with FSDP2 (`fully_shard` per decoder layer, the model as root), as `grpo_lab.memory.fsdp` does.
            `None`: FSDP2 when `world_size > 1`. Notebook 02 uses it at world size 1 too.
        gradient_checkpointing (`bool`, defaults to `True`):
            TRL's default: each decoder layer is recomputed in the backward (non-reentrant checkpoint).
        device (`str`, defaults to `"cuda"`):
            `"cuda"` predicts `torch.cuda.max_memory_allocated`; `"cpu"` predicts the peak RSS above the
            process's baseline, as the harness meters it on CPU (CPU kernels, and an RSS overhead).
        attention (`str`, defaults to `"auto"`):
            The SDPA kernel: `"flash"` (O(T) saved), `"math"` (keeps `[B, heads, T, T]` probabilities) or
            `"cpu_flash"`; `"auto"` is what the H200 and CPU runs show (`attention_kernel`).
        optimizer_state (`bool`, defaults to `True`):
            AdamW's two moments exist (every step after the first); `False` predicts a first step.
        expandable_segments (`bool`, defaults to `False`):
            The run sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: same peaks, but the max batch keeps
            `EXPANDABLE_SEGMENTS_HEADROOM` of the budget for fragmentation instead of `ALLOCATOR_HEADROOM`.
    """

    model: str = "Qwen3-0.6B"  # the six coordinates' one-GPU defaults (same order, same checks as StepSetting's)
    dtype: str = "bf16"
    batch_size: int = 8
    prompt_len: int = 256
    completion_len: int = 512
    lora_r: int = 16
    lora_targets: tuple[str, ...] = LORA_TARGETS
    world_size: int = 1
    fsdp: bool | None = None
    gradient_checkpointing: bool = True
    device: str = "cuda"
    attention: str = "auto"
    optimizer_state: bool = True
    expandable_segments: bool = False
    model_config: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        self._check_positive("world_size")
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"lora_r must be an integer >= 0 (0 = full fine-tuning), got {self.lora_r!r}.")
        targets = tuple(self.lora_targets)
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown or (self.lora_r > 0 and not targets):
            raise ValueError(f"lora_targets must be a non-empty subset of {', '.join(LORA_TARGETS)}, got {targets}.")
        object.__setattr__(self, "lora_targets", targets)
        if self.device not in DEVICES:
            raise ValueError(f"Unknown device {self.device!r}: use cuda or cpu.")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"Unknown attention kernel {self.attention!r}: use one of {', '.join(ATTENTIONS)}.")
        if self.fsdp is None:
            object.__setattr__(self, "fsdp", self.world_size > 1)
        if self.world_size > 1 and not self.fsdp:
            raise ValueError("world_size > 1 is planned with FSDP2 (fsdp=True); data-parallel replicas without "
                             "sharding use the world-size-1 figure.")
        if self.loss_backend == "liger" and self.lora_r == 0 and self.fsdp:
            raise ValueError("backend 'liger' under FSDP2 keeps the root parameters replicated, which the harness "
                             "does only for a frozen (LoRA) head: use lora_r > 0 or another backend.")

    def _check_model(self) -> None:
        if self.model_config is None:  # a config object passed in needs no name that resolves
            super()._check_model()

    @property
    def attention_kernel(self) -> str:
        """The SDPA kernel `attention="auto"` resolves to: `cpu_flash` on CPU; on CUDA `flash` for bf16 and `math`
        for fp32 (what the H200 runs show for Qwen3's grouped-query attention)."""
        if self.attention != "auto":
            return self.attention
        if self.device == "cpu":
            return "cpu_flash"
        return "flash" if self.dtype == "bf16" else "math"
