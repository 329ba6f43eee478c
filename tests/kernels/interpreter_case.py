"""Runs the Triton kernels of `grpo_lab.loss.kernel` in Triton's CPU interpreter and prints their errors as JSON.

A separate process because `TRITON_INTERPRET=1` must be set before the kernels are decorated (at import). Small
tiles so that several token and vocabulary blocks, several dZ tiles in each direction and a persistent program
looping over many tiles all occur; fp32 only (the interpreter computes in numpy, which has no bfloat16).

`variant["path"]`: "recompute" (trainable head, the default), "frozen" (the head needs no gradient: the two-GEMM
path) or "materialized" (trainable head with memory allowed for speed). `headroom` shrinks `ref_headroom` so that rows
are recomputed against their exact max; `entropy_hint` forces what the frozen forward prepares for. `extreme_rows`
gives every seventh row logits hundreds of nats apart with the lowest one as its target, so that e^(z − ref)
overflows fp32 there and those rows must be recomputed, statistics included (`softcap`: null turns the softcap off,
which would bound the logits; `target_gap` picks the target that many nats below the max instead); `ref_stats` and
`ref_stats_plain` set those fields of the kernel's tuning, `deferred` its `frozen_deferred_check` and
`materialized_deferred_check` (the rows check read back by the backward), `target_zero_pass` its `target_zero_pass` (off: the frozen P~'s target column is
zeroed in the fused forward's epilogue rather than by a pass after each launch), `no_top1` leaves is_top1 out of the
outputs (then every forward takes the target logit from the row-wise dot instead of its blocks), `no_entropy_grad`
leaves the entropy out of the loss (the materialised backward then has no elementwise dZ pass unless
`dz_free_backward` is false). `fp32_mm` picks the backward's dX / dW GEMMs ("triton": split-TF32 on K-major copies,
96 vocabulary columns per copy, through tensor descriptors where `tma` is on, else the pointer kernel; "cublas").
"""

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from grpo_lab.loss.heads.naive import naive_logprobs  # noqa: E402
from grpo_lab.loss.kernel import function, launch, split_tf32  # noqa: E402
from grpo_lab.loss.kernel.tuning import TUNING  # noqa: E402

ALL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def spy(name: str, calls: list) -> None:
    """Record the path flag (the last item) a host-side helper of the launch module returns: what really ran."""
    real = getattr(launch, name)

    def wrapper(*args):
        out = real(*args)
        calls.append(bool(out[-1]))
        return out
    setattr(launch, name, wrapper)


class Counted:
    """A Triton kernel whose launches (`kernel[grid](...)`) are counted."""

    def __init__(self, kernel, log: list):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]


def main(variant: dict) -> dict:
    from grpo_lab.loss.frozen import expect_entropy_grad

    small = (32, 64, 32, 2, 4, 2)
    TUNING.configs.update({"fwd_32": small, "bwd_32": small, "frozen_32": small, "mm_32": small})
    TUNING.fp32_mm = variant.get("fp32_mm", "triton")
    TUNING.fp32_mm_slice = 96
    # The 16-bit settings differ from the fp32 ones, so a lookup under the wrong dtype key shows in the counts.
    TUNING.bwd_tile = {"16": (4096, 4096), "32": (48, 256)}
    TUNING.frozen_tile = {"16": (4096, 4096), "32": (48, 256)}
    TUNING.use_tma = variant["tma"]
    TUNING.dz_tma = {"16": not variant["dz_tma"], "32": variant["dz_tma"]}
    TUNING.p_tma = {"16": not variant.get("p_tma", False), "32": variant.get("p_tma", False)}
    TUNING.persistent = {key: variant["persistent"] == key.endswith("_32") for key in TUNING.persistent}
    TUNING.persistent_programs = None
    path = variant.get("path", "recompute")
    TUNING.materialize_gib = 1.0 if path == "materialized" else 0.0
    TUNING.ref_headroom = variant.get("headroom", TUNING.ref_headroom)
    TUNING.ref_stats = dict.fromkeys(TUNING.ref_stats, variant.get("ref_stats", True))
    TUNING.ref_stats_plain = dict.fromkeys(TUNING.ref_stats_plain, variant.get("ref_stats_plain", False))
    TUNING.frozen_deferred_check = dict.fromkeys(TUNING.frozen_deferred_check, variant.get("deferred", False))
    TUNING.materialized_deferred_check = dict.fromkeys(TUNING.materialized_deferred_check,
                                                       variant.get("deferred", False))
    TUNING.target_zero_pass = variant.get("target_zero_pass", True)
    TUNING.dz_free_backward = variant.get("dz_free_backward", True)
    programs, loads, stores, bulk, paths = [], [], [], [], []
    spy("_programs", programs)
    spy("_operands", loads)
    spy("_dz_target", stores)
    spy("tma_target", bulk)
    nt_launches, pointer_launches = [], []
    split_tf32.nt_mm_kernel = Counted(split_tf32.nt_mm_kernel, nt_launches)
    split_tf32.mm_kernel = Counted(split_tf32.mm_kernel, pointer_launches)
    choose = function.choose_path
    function.choose_path = lambda *a: paths.append(choose(*a)) or paths[-1]
    gen = torch.Generator().manual_seed(0)
    n, h, v = 70, 64, 700
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * h ** -0.5 * 3
    bias = torch.randn(v, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::5] = -100
    if variant.get("extreme_rows"):
        hidden[3::7] *= 40
        z = hidden[3::7] @ weight.T
        gap = variant.get("target_gap")  # the target this far below the max, else the lowest logit
        targets[3::7] = z.argmin(-1) if gap is None else (z - (z.max(-1, keepdim=True).values - gap)).abs().argmin(-1)
    g, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    valid = targets >= 0
    softcap = None if path == "materialized" else 5.0  # the materialised path is not taken under a softcap
    softcap = variant.get("softcap", softcap)
    frozen = path == "frozen"
    mine = [x.clone().requires_grad_(not frozen or i == 0) for i, x in enumerate((hidden, weight, bias))]
    ref_in = [x.double().requires_grad_(not frozen or i == 0) for i, x in enumerate((hidden, weight, bias))]
    mode = "frozen" if frozen else "trainable"
    with expect_entropy_grad(variant.get("entropy_hint", False)):
        # without is_top1 the forwards take the target logit from the row-wise dot (`target_logit_from_ref`)
        wanted = tuple(o for o in ALL if o != "is_top1") if variant.get("no_top1") else ALL
        out = function.FusedLinearLogProbFunction.apply(*mine, targets, 0.9, None, softcap, 1.0, wanted, torch.float32,
                                                        mode)
    ref = naive_logprobs(*ref_in, targets, 0.9, None, softcap, 1.0, ALL)
    if variant.get("no_entropy_grad"):
        ge = torch.zeros_like(ge)
        (out[0] * g).sum().backward()
    else:
        ((out[0] * g).sum() + (out[1] * ge).sum()).backward()
    ((ref[0] * g * valid).sum() + (ref[1] * ge * valid).sum()).backward()

    def grad_err(i):
        return rel(mine[i].grad, ref_in[i].grad) if ref_in[i].grad is not None else float(mine[i].grad is not None)
    return {
        "path": paths,
        "logprobs": rel(out[0][valid], ref[0][valid]),
        "entropy": rel(out[1][valid], ref[1][valid]),
        "log_sum_sq_probs": rel(out[2][valid], ref[2][valid]),
        "mean_logits": (out[3][valid] - ref[3][valid]).abs().max().item(),
        "is_top1_agree": 1.0 if out[4] is None else (out[4][valid] == ref[4][valid]).float().mean().item(),
        "masked_zero": bool((out[0][~valid] == 0).all() and (out[1][~valid] == 0).all()),
        "grad_hidden": grad_err(0),
        "grad_weight": grad_err(1),
        "grad_bias": grad_err(2),
        "masked_grad_zero": bool((mine[0].grad[~valid] == 0).all()),
        "launches": len(programs),  # forward launches + backward dZ launches (one per dZ tile)
        "persistent_launches": sum(programs),
        "tma_launches": sum(loads),
        "dz_descriptor_launches": sum(stores),
        "backward_launches": len(stores),
        "p_descriptor_stores": sum(bulk) - sum(stores),  # P~ (and P~·(z − ref)) views stored through descriptors
        "split_tf32_launches": [len(nt_launches), len(pointer_launches)],  # (K-major descriptors, pointer fallback)
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
