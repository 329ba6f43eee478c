"""FSDP2 + LoRA for the TRL GRPO trainer, with torch's `fully_shard` applied before the trainer sees the model.

Not accelerate's FSDP plugin: it picks FSDP only for GPU-like devices, so the gloo tests could not exercise it. Each
decoder layer is its own FSDP2 group, the PEFT model the root (embeddings, final norm, LM head); the model is flagged
`is_distributed_loading_by_transformers`, so the Trainer neither moves it nor wraps it in DDP. The same code runs
with gloo on CPU and NCCL on N GPUs of one host (docs/memory.md, *FSDP2 + LoRA*).
"""

from __future__ import annotations

import torch

from grpo_lab.lab import environment


def init_process_group(device: torch.device) -> None:
    """Join (or create) the default process group from the torchrun-style environment."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, rank=environment.distributed_rank(),
                                world_size=environment.world_size(), **kwargs)


def apply_lora(model, r: int):
    """LoRA adapters in the model's dtype (`autocast_adapter_dtype=False`), so each FSDP2 group has one dtype."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def keep_trainer_from_rewrapping(trainer, model) -> None:
    """Make `trainer.accelerator` prepare the pre-sharded `model` without DDP and without moving it.

    transformers >= 5.19 does this itself for models flagged `is_distributed_loading_by_transformers`; older releases
    (the H200 image has 5.17) would wrap the DTensor model in DDP. This gives every version the same behaviour."""
    accelerator = trainer.accelerator
    original = accelerator.prepare_model

    def prepare_model(obj, device_placement=None, evaluation_mode=False):
        if obj is model:
            return original(obj, device_placement=False, evaluation_mode=True)
        return original(obj, device_placement=device_placement, evaluation_mode=evaluation_mode)

    accelerator.prepare_model = prepare_model


def shard_fsdp2(model, device: torch.device, replicate_root: bool = False, flag: bool = True):
    """`fully_shard` each decoder layer, then the whole (PEFT) model as root; returns the same object, sharded.

    `replicate_root`: the root's (frozen) parameters stay replicated, for a loss that reads the head weight outside
    the root's forward (`liger`'s `_compute_loss`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", base), "layers", None)
    if layers is None:
        raise ValueError(f"no decoder layers found on {type(base).__name__}")
    ignored = None
    if replicate_root:  # found before the layers are sharded (sharding replaces their Parameter objects)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        ignored = {p for p in model.parameters() if id(p) not in in_layers}
        if any(p.requires_grad for p in ignored):
            raise ValueError("replicate_root needs the root-level parameters frozen (LoRA)")
    # resharded after forward, the root too (torch's default, None, would keep the root gathered until backward)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)
    # transformers' contract for pre-sharded models: no .to(), no DDP wrap (Trainer._prepare_for_training, >= 5.19);
    # `keep_trainer_from_rewrapping` covers older releases
    if flag:
        model.is_distributed_loading_by_transformers = True
    return model

