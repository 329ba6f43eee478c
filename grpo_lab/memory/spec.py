"""What one memory point is: a validated, picklable description shared by the sweep, the max-batch search and the
fresh-process probes. Bad input fails here with a plain `ValueError`, before any process is started."""

from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import os
from dataclasses import dataclass, field
from typing import Self

from grpo_lab.lab.install import install_hint
from grpo_lab.loss.backends import DEFAULT_LOSS_BACKEND, LOGPROB_BACKENDS, in_display_order, resolve_backend
from grpo_lab.models import known_model_names, load_model_config

DTYPES = ("fp32", "bf16")
MODES = ("step", "loss")  # a real TRL GRPO training step, or the log-prob/loss stage alone
GENERATIONS = ("synthetic", "model")  # fixed-length random completions via TRL's rollout_func, or model.generate

_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def normalize_dtype(dtype: str) -> str:
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
    return _DTYPE_ALIASES[key]


def check_model(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"model must be a name, got {name!r}: use one of {', '.join(known_model_names())}.")
    try:
        load_model_config(name)
    except ValueError:
        raise ValueError(f"Unknown model {name!r}: use one of {', '.join(known_model_names())}.") from None
    return name


def require_liger_if_named(backends) -> None:
    """Refuse up front, not at the first liger point, when `backends` names liger but liger-kernel is missing."""
    if "liger" in backends and importlib.util.find_spec("liger_kernel") is None:
        raise ValueError(f"loss backend 'liger' needs liger-kernel ({install_hint('liger')}), or pass "
                         f"--backends {','.join(in_display_order(LOGPROB_BACKENDS))}")


def check_positive_int(value, what: str) -> int:
    """`value` as an int (numpy integers, digit strings and whole floats too, as pandas and papermill hand them over)."""
    if (isinstance(value, str) and value.strip().isdigit()) or (isinstance(value, float) and value.is_integer()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return int(value)


def parse_int_list(values, what: str = "batch sizes") -> list[int]:
    """`"1,2,4"`, `[1, 2, 4]` or `4` → `[1, 2, 4]`; anything not a positive integer is a `ValueError`."""
    if isinstance(values, str):
        parts = [p for p in values.replace(" ", ",").split(",") if p]
    elif isinstance(values, numbers.Real) and not isinstance(values, bool):
        parts = [values]
    elif values is None or not hasattr(values, "__iter__"):
        raise ValueError(f"{what}: give a list of positive integers, got {values!r}.")
    else:
        parts = list(values)
    if not parts:
        raise ValueError(f"{what}: give at least one positive integer.")
    return [check_positive_int(p, what) for p in parts]


def parse_str_list(values, what: str = "list") -> list[str]:
    """`"a,b"` or `["a", "b"]` → `["a", "b"]`; an empty or missing list is a `ValueError` (it would measure nothing)."""
    if values is None or not isinstance(values, str | list | tuple):
        raise ValueError(f"{what}: give comma-separated names, got {values!r}.")
    out = ([p for p in values.replace(" ", ",").split(",") if p] if isinstance(values, str)
           else [str(v) for v in values])
    if not out:
        raise ValueError(f"{what}: give at least one.")
    return out


# PYTORCH_CUDA_ALLOC_CONF of a point (`PointSpec.extra["cuda_alloc_conf"]`) run with expandable segments
EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass(frozen=True)
class StepSetting:
    """The six coordinates of a GRPO step that every memory figure starts from, checked once here: a measured point
    (`PointSpec`) and a planned one (`grpo_lab.memory.planner.PlannerConfig`) both extend it. `batch_size` is per
    device: the sequences (prompt + completion) in one training micro-step. The defaults are the CPU harness's."""

    model: str = "tiny-qwen3"
    loss_backend: str = DEFAULT_LOSS_BACKEND
    dtype: str = "fp32"
    batch_size: int = 2
    prompt_len: int = 16
    completion_len: int = 16

    def __post_init__(self):
        self._check_model()
        resolve_backend(self.loss_backend)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        self._check_positive("batch_size", "prompt_len", "completion_len")

    def _check_model(self) -> None:
        check_model(self.model)

    def _check_positive(self, *names: str) -> None:
        for name in names:
            object.__setattr__(self, name, check_positive_int(getattr(self, name), name.replace("_", " ")))

    def replace(self, **changes) -> Self:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class PointSpec(StepSetting):
    """One measurement: a `StepSetting` and how it is run (mode, generation, steps, LoRA, FSDP2, budget ...)."""

    mode: str = "step"
    generation: str = "synthetic"
    steps: int = 2  # optimizer steps; the first one allocates AdamW state, the peak is the max over all of them
    lora_r: int = 0  # 0 = full fine-tuning; > 0 = LoRA on all linear layers (alpha = 2r)
    fsdp: bool = False  # FSDP2 by torch's fully_shard (`memory.fsdp`; the probe sets up the process group)
    world_size: int = 1
    budget_bytes: int | None = None  # CUDA: per-process memory cap; CPU: peak RSS above the baseline over it = OOM
    seed: int = 0
    beta: float = 0.0  # KL coefficient (0 = no reference model, TRL's default); > 0 adds the reference forward
    num_iterations: int = 1  # TRL's mu: > 1 reuses each generation batch (adds the old-log-prob forward)
    device: str = "auto"  # auto | cpu | cuda
    chunk_size: int = 0  # loss mode: vocabulary tile for the log-prob backends (0 = TRL's, as in training)
    pretrained: bool = False  # load real weights with from_pretrained(model) (a hub id online, or a local folder)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        super().__post_init__()
        self._check_positive("steps", "world_size", "num_iterations")
        if self.mode not in MODES:
            raise ValueError(f"Unknown mode {self.mode!r}: use one of {', '.join(MODES)}.")
        if self.generation not in GENERATIONS:
            raise ValueError(f"Unknown generation {self.generation!r}: use one of {', '.join(GENERATIONS)}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"Unknown device {self.device!r}: use auto, cpu or cuda.")
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be >= 0, got {self.lora_r}.")
        if self.fsdp and self.lora_r > 0 and self.beta != 0.0:
            raise ValueError("beta > 0 with FSDP2 + LoRA is not supported here: TRL would add its reference adapter "
                             "after the model is sharded.")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget must be positive, got {self.budget_bytes}.")

    def _check_model(self) -> None:
        if not self.pretrained:
            return super()._check_model()
        if not (os.path.isdir(self.model) or self.model.count("/") == 1):
            raise ValueError(f"pretrained=True needs a hub id (org/name) or a local folder, got {self.model!r}.")

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d
