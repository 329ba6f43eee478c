"""The loss stage alone: LM-head projection + log-probs (+ entropy) + a GRPO-style loss, forward and backward.

Both inputs (hidden states `[B*T, H]`, head weight `[V, H]`) are trainable, so the peak includes what the fused heads
exist to avoid (the `[N, V]` logits and their gradient); `liger` runs `LigerFusedLinearGRPOLoss` on the same tensors.
"""

from __future__ import annotations

import time

import torch

from grpo_lab.loss.heads import logprob_head

from .grpo_step import TORCH_DTYPES, model_config_of
from .meter import check_budget, device_info, prepare_probe_device
from .spec import PointSpec


def run_loss_probe(spec: PointSpec) -> dict:
    device, meter = prepare_probe_device(spec.device, spec.budget_bytes)
    cfg = model_config_of(spec)
    B, T, H, V = spec.batch_size, spec.completion_len, cfg.hidden_size, cfg.vocab_size
    dtype = TORCH_DTYPES[spec.dtype]
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    base = meter.current()
    hidden = (torch.randn(B, T, H, device=device, dtype=dtype, generator=gen) * 0.5).requires_grad_(True)
    weight = (torch.randn(V, H, device=device, dtype=dtype, generator=gen) * H**-0.5).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), device=device, generator=gen)
    advantages = torch.randn(B, device=device, generator=gen)
    mask = torch.ones(B, T, device=device, dtype=torch.long)

    if spec.loss_backend == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", compiled=False)

        def step():
            out = liger(hidden, weight, targets, mask, advantages)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
    else:
        fn = logprob_head(spec.loss_backend)
        # the vocabulary tile TRL's trainer passes to every backend (trl/trainer/utils.py), unless overridden
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        chunk = spec.chunk_size or _CHUNKED_LOGPROB_CHUNK_SIZE

        def step():
            out = fn(hidden.view(B * T, H), weight, None, targets.view(-1), 1.0, chunk, None, 1.0,
                     ("log_probs", "entropy"))
            logprobs = out[0].view(B, T)
            # dapo-shaped surrogate: on-policy ratio exp(lp - lp.detach()) = 1 with gradient d lp
            ratio = torch.exp(logprobs - logprobs.detach())
            loss = -(ratio * advantages[:, None]).sum() / (B * T)
            if out[1] is not None:
                loss = loss - 0.0 * out[1].sum()
            loss.backward()

    step()  # warm-up (Triton autotune, allocator)
    hidden.grad = weight.grad = None
    meter.reset_peak()
    t0 = time.perf_counter()
    step()
    meter.sync()
    elapsed = time.perf_counter() - t0
    peak = meter.peak()
    check_budget(meter, peak["peak"] - base, spec.budget_bytes)
    return {"peak_bytes": peak["peak"], "reserved_bytes": peak.get("reserved"), "base_bytes": base,
            "setup_bytes": base, "step_time_s": elapsed, "memory_kind": meter.kind, "peak_generation_bytes": None,
            "steps_done": 1, **device_info(device)}
