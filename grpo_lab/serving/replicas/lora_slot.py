"""One PEFT LoRA slot that the CPU replica's adapters take turns in, as vLLM's punica slots do on a GPU.

PEFT keeps every loaded adapter in the module tree, so loading, unloading and switching walk every module once per
adapter held: on a shared pool, where a replica holds K runs' live versions, each of those grew K-fold. Here PEFT
holds a single adapter of the replica's largest rank; a loaded adapter is only its tensors, and making one active
copies them into the slot (zero-padded to the slot's rank, its alpha / r scale on each layer). The base model is the
slot with every scale 0, so no request takes PEFT's disable path.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from ..adapters.storage import ADAPTER_CONFIG

SLOT = "slot"
PREFIX = "base_model.model."  # how PEFT's saved keys start
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json fields the slot cannot honour: per-module ranks or scales, DoRA, extra trained modules
UNSERVED = ("use_dora", "modules_to_save", "fan_in_fan_out", "rank_pattern", "alpha_pattern")


class AdapterFormatError(ValueError):
    """An adapter this slot cannot serve (its files, its rank, or modules the slot does not have)."""


@dataclass
class LoraWeights:
    """A loaded adapter: per LoRA module (its path in the base model) its A and B, and the scale PEFT would use."""

    rank: int
    scale: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoraSlot:
    """The base model wrapped with one all-linear LoRA adapter of rank `max_rank`, which `activate` fills."""

    def __init__(self, base: torch.nn.Module, max_rank: int):
        from peft import LoraConfig, get_peft_model

        self.max_rank = max_rank
        self.model = get_peft_model(base, LoraConfig(r=max_rank, lora_alpha=max_rank, target_modules="all-linear",
                                                     lora_dropout=0.0), adapter_name=SLOT).eval()
        self.layers = {name.removeprefix(PREFIX): module for name, module in self.model.named_modules()
                       if SLOT in getattr(module, "lora_A", {})}
        self.activate(None)

    def read(self, path: str) -> LoraWeights:
        """The adapter saved in folder `path` (PEFT's `save_pretrained` layout), checked against the slot."""
        try:
            with open(os.path.join(path, ADAPTER_CONFIG)) as f:
                config = json.load(f)
        except (OSError, ValueError) as error:
            raise AdapterFormatError(f"unreadable {ADAPTER_CONFIG} in {path}: {error}") from None
        rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise AdapterFormatError(f"{ADAPTER_CONFIG} in {path} has no valid r / lora_alpha")
        if rank > self.max_rank:
            raise AdapterFormatError(f"LoRA rank {rank} is greater than max_lora_rank {self.max_rank}.")
        unserved = [key for key in UNSERVED if config.get(key)]
        if unserved:  # one rank and one scale for every module, plain A and B: what the slot computes
            raise AdapterFormatError(f"adapter in {path} sets {', '.join(unserved)}, which this replica does not serve")
        state = _read_state(path)
        tensors: dict[str, list] = {}
        for key, tensor in state.items():
            module, _, part = key.removeprefix(PREFIX).rpartition(".lora_")
            if part not in ("A.weight", "B.weight") or module not in self.layers:
                raise AdapterFormatError(f"adapter in {path} has weight {key}, which this replica's all-linear "
                                         "LoRA slot does not have")
            tensors.setdefault(module, [None, None])[part[0] == "B"] = tensor
        for module, (a, b) in tensors.items():
            layer = self.layers[module]
            if a is None or b is None or a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
                raise AdapterFormatError(f"adapter in {path}: module {module} lacks lora_A or lora_B or has "
                                         f"shapes that do not fit rank {rank}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return LoraWeights(rank, scale, {m: (a, b) for m, (a, b) in tensors.items()})

    @torch.no_grad()
    def activate(self, weights: LoraWeights | None) -> None:
        """Fill the slot with `weights` (None: the base model, every scale 0)."""
        for module, layer in self.layers.items():
            pair = weights.tensors.get(module) if weights is not None else None
            if pair is None:
                layer.scaling[SLOT] = 0.0
                continue
            a, b, rank = layer.lora_A[SLOT].weight, layer.lora_B[SLOT].weight, weights.rank
            a[:rank].copy_(pair[0])
            a[rank:].zero_()
            b[:, :rank].copy_(pair[1])
            layer.scaling[SLOT] = weights.scale


def _read_state(path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors from its safetensors file (or a legacy .bin), as PEFT saved them."""
    for file in WEIGHT_FILES:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        try:
            if file.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(full)
            return torch.load(full, map_location="cpu", weights_only=True)
        except Exception as error:  # a truncated or foreign file is the client's problem, not a crash
            raise AdapterFormatError(f"failed to load adapter from {path}: {type(error).__name__}: {error}") \
                from None
    raise AdapterFormatError(f"failed to load adapter from {path}: no {' or '.join(WEIGHT_FILES)}")
