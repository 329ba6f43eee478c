"""GPU checks of the Triton fused linear -> log-prob kernel (run on the H200 with `pytest -m gpu`).

Reference: the naive materialised head in float64 on the same (already rounded) inputs, via plain autograd; and
TRL 1.16's `ChunkedLogProbFunction`. Error measure: ||out - ref|| / ||ref|| over the valid rows.
"""

from __future__ import annotations

import os

import pytest
import torch

# Deselected on CPU machines by the default `-m 'not gpu'`; `pytest -m gpu` without a GPU reports them skipped.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from grpo_lab.loss.heads.naive import naive_logprobs
from grpo_lab.loss.kernel import fused_linear_logprobs
from grpo_lab.loss.kernel.tuning import TUNING

ALL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
GiB = 2**30


@pytest.fixture(autouse=True)
def flat_trainable_head(monkeypatch):
    """These tests were written for the memory-flat trainable path (the default before the memory policy): they keep
    it (`materialize_fraction` = 0) unless they set the policy themselves, so the recompute backward and its kernel
    variants stay covered; `test_against_float64` and the policy tests at the end run the default policy."""
    monkeypatch.setattr(TUNING, "materialize_fraction", 0.0)
    monkeypatch.setattr(TUNING, "materialize_gib", None)
# (log-prob / entropy tolerance, gradient tolerance) by input dtype
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-4, 1.5e-2)}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def make(n, h, v, dtype, *, peaked=False, bias=False, masked=0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=gen)
    weight = torch.randn(v, h, device="cuda", generator=gen) * (h ** -0.5) * (12.0 if peaked else 1.5)
    b = torch.randn(v, device="cuda", generator=gen) if bias else None
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    if peaked:  # the target is usually the argmax: log-probs near 0, most p_j tiny
        targets = (hidden @ weight.t()).argmax(-1)
        targets[::7] = torch.randint(0, v, targets[::7].shape, device="cuda", generator=gen)
    if masked:
        targets[torch.randperm(n, device="cuda", generator=gen)[:masked]] = -100
    cast = [x.to(dtype) if x is not None else None for x in (hidden, weight, b)]
    return cast[0], cast[1], cast[2], targets


def run_both(hidden, weight, bias, targets, temperature=1.0, softcap=None, logit_scale=1.0, outputs=ALL,
             entropy_grad=True, frozen=False):
    """The kernel and the float64 reference on the same inputs; `frozen`: only the hidden states need a gradient."""
    grads = (True, not frozen, not frozen)
    leaves = [x.detach().clone().requires_grad_(r) if x is not None else None
              for x, r in zip((hidden, weight, bias), grads)]
    refs = [x.detach().double().requires_grad_(r) if x is not None else None
            for x, r in zip((hidden, weight, bias), grads)]
    out = fused_linear_logprobs(*leaves, targets, temperature, None, softcap, logit_scale, outputs)
    ref = naive_logprobs(*refs, targets, temperature, None, softcap, logit_scale, outputs)
    valid = targets >= 0
    gen = torch.Generator(device="cuda").manual_seed(1)
    g = torch.randn(targets.shape, device="cuda", generator=gen)
    ge = torch.randn(targets.shape, device="cuda", generator=gen)
    loss = (out[0] * g).sum()
    ref_loss = (ref[0] * g * valid).sum()
    if entropy_grad and "entropy" in outputs:
        loss = loss + (out[1] * ge).sum()
        ref_loss = ref_loss + (ref[1] * ge * valid).sum()
    loss.backward()
    ref_loss.backward()
    return out, ref, leaves, refs, valid


def check(out, ref, leaves, refs, valid, dtype, outputs=ALL):
    tol_v, tol_g = TOL[dtype]
    assert out[0].dtype == torch.float32 and torch.isfinite(out[0]).all()
    assert rel(out[0][valid], ref[0][valid]) < tol_v, rel(out[0][valid], ref[0][valid])
    assert (out[0][~valid] == 0).all()
    if "entropy" in outputs:
        assert rel(out[1][valid], ref[1][valid]) < tol_v
    if "log_sum_sq_probs" in outputs:
        assert rel(out[2][valid], ref[2][valid]) < 10 * tol_v
    if "mean_logits" in outputs:
        assert (out[3][valid] - ref[3][valid]).abs().max().item() < 1e-3
    if "is_top1" in outputs:
        agree = (out[4][valid] == ref[4][valid]).float().mean().item()
        assert agree > (0.999 if dtype == torch.float32 else 0.99)
    for mine, theirs in zip(leaves, refs):
        if mine is None or not mine.requires_grad:
            assert mine is None or mine.grad is None
            continue
        assert mine.grad is not None and mine.grad.dtype == mine.dtype and torch.isfinite(mine.grad).all()
        assert rel(mine.grad, theirs.grad) < tol_g, rel(mine.grad, theirs.grad)


@pytest.mark.parametrize("policy", ["flat", "policy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("shape", [(300, 200, 5003), (4500, 256, 9001)])
def test_against_float64(monkeypatch, dtype, peaked, shape, policy):
    """`flat`: the recompute path; `policy`: the default memory policy with its small-head rule and its peak rule
    lifted (these heads fit the free memory: the materialised path)."""
    if policy == "policy":
        monkeypatch.setattr(TUNING, "materialize_fraction", type(TUNING)().materialize_fraction)
        monkeypatch.setattr(TUNING, "materialize_within_peak", False)
        monkeypatch.setattr(TUNING, "materialize_flat_below", dict.fromkeys(TUNING.materialize_flat_below, 0))
    n, h, v = shape
    data = make(n, h, v, dtype, peaked=peaked, masked=n // 10)
    check(*run_both(*data), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_softcap_scale_temperature(dtype):
    hidden, weight, bias, targets = make(777, 192, 3001, dtype, bias=True, masked=50, seed=3)
    check(*run_both(hidden, weight, bias, targets, temperature=0.7, softcap=5.0, logit_scale=1.7), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_grad_only_and_entropy_grad_only(dtype):
    hidden, weight, _, targets = make(513, 128, 2049, dtype, seed=4)
    check(*run_both(hidden, weight, None, targets, outputs=("entropy",), entropy_grad=False), dtype, ("entropy",))
    # entropy gradient alone (log-probs unused)
    h1 = hidden.detach().clone().requires_grad_()
    h2 = hidden.detach().double().requires_grad_()
    fused_linear_logprobs(h1, weight, None, targets, 1.0, None, None, 1.0, ("entropy",))[1].sum().backward()
    naive_logprobs(h2, weight.double(), None, targets, 1.0, None, None, 1.0, ("entropy",))[1].sum().backward()
    assert rel(h1.grad, h2.grad) < TOL[dtype][1]


def test_all_masked_gives_zeros_and_zero_grads():
    hidden, weight, _, targets = make(64, 96, 1000, torch.bfloat16)
    targets[:] = -100
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    lp, ent, *_ = fused_linear_logprobs(h, w, None, targets, 1.0, None, None, 1.0, ("entropy",))
    assert (lp == 0).all() and (ent == 0).all()
    (lp.sum() + ent.sum()).backward()
    assert h.grad is not None and w.grad is not None
    assert (h.grad == 0).all() and (w.grad == 0).all()


def test_autocast_fp32_master_weights():
    """fp32 hidden/weight under bf16 autocast: the projection runs in bf16 (cast inside the kernel), grads fp32."""
    hidden, weight, _, targets = make(1000, 256, 5000, torch.float32, seed=5)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, ent, *_ = fused_linear_logprobs(h, w, None, targets, 1.0, None, None, 1.0, ("entropy",))
    (lp.sum() + ent.sum()).backward()
    hr = hidden.to(torch.bfloat16).double().requires_grad_()
    wr = weight.to(torch.bfloat16).double().requires_grad_()
    lr, er, *_ = naive_logprobs(hr, wr, None, targets, 1.0, None, None, 1.0, ("entropy",))
    (lr.sum() + er.sum()).backward()
    assert w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    assert rel(lp, lr) < 1e-4 and rel(ent, er) < 1e-4
    assert rel(h.grad, hr.grad) < 1.5e-2 and rel(w.grad, wr.grad) < 1.5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_trl(dtype):
    trl_kernels = pytest.importorskip("trl.kernels")
    hidden, weight, _, targets = make(2000, 256, 7001, dtype, seed=6)
    out = []
    for fn in ("mine", "trl"):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        if fn == "mine":
            lp, ent, *_ = fused_linear_logprobs(h, w, None, targets, 0.9, None, None, 1.0, ("entropy",))
        else:
            lp, ent, *_ = trl_kernels.ChunkedLogProbFunction.apply(h, w, None, targets, 0.9, 4096, None, 1.0,
                                                                  ("entropy",))
        (lp.sum() + 0.3 * ent.sum()).backward()
        out.append((lp, ent, h.grad, w.grad))
    # TRL rounds each logits tile to the input dtype before the softmax; this kernel keeps fp32 logits
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(*out):
        assert rel(a, b) < tol


def test_dispatch_uses_triton_on_cuda(monkeypatch):
    """bf16 / fp32 on CUDA go to the Triton kernel; float64 (no Triton path) to the chunked torch one."""
    import grpo_lab.loss.heads.grpo_lab as dispatch

    calls = []
    real = dispatch.fused_linear_logprobs
    monkeypatch.setattr(dispatch, "fused_linear_logprobs", lambda *a: calls.append(a[0].dtype) or real(*a))
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        hidden, weight, _, targets = make(100, 64, 500, dtype)
        lp = dispatch.grpo_lab_logprobs(hidden, weight, None, targets)[0]
        assert lp.shape == (100,) and torch.isfinite(lp).all()
    assert calls == [torch.bfloat16, torch.float32]


def test_matches_chunked_torch_path():
    from grpo_lab.loss.heads.chunked import chunked_logprobs

    hidden, weight, bias, targets = make(600, 128, 3000, torch.float32, bias=True, masked=30, seed=7)
    a = fused_linear_logprobs(hidden, weight, bias, targets, 1.1, None, 4.0, 1.0, ALL)
    b = chunked_logprobs(hidden, weight, bias, targets, 1.1, None, 4.0, 1.0, ALL)
    for x, y in zip(a[:4], b[:4]):
        assert rel(x, y) < 1e-4


@pytest.mark.parametrize("tma,fp32_mm,persistent,dz_tma", [
    (True, "cublas", False, False), (False, "cublas", False, False), (False, "triton", False, False),
    (True, "triton", False, False), (True, "cublas", True, False), (False, "cublas", True, False),
    (True, "cublas", False, True), (True, "cublas", True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_variants(monkeypatch, tma, fp32_mm, persistent, dz_tma, dtype):
    """Pointer or tensor-descriptor loads, one program per tile or persistent, dZ stored through pointers or a
    descriptor, cuBLAS or Triton fp32 dX/dW GEMMs: all compute the same function."""
    monkeypatch.setattr(TUNING, "use_tma", tma)
    monkeypatch.setattr(TUNING, "fp32_mm", fp32_mm)
    monkeypatch.setattr(TUNING, "dz_tma", {key: dz_tma for key in TUNING.dz_tma})
    monkeypatch.setattr(TUNING, "persistent", {key: persistent for key in TUNING.persistent})
    monkeypatch.setattr(TUNING, "persistent_programs", 7)  # every program loops over many tiles
    monkeypatch.setattr(TUNING, "bwd_tile", {"16": (1024, 2048), "32": (1024, 2048)})
    monkeypatch.setattr(TUNING, "fp32_mm_slice", 768)  # split-TF32: 768, 768, 512 columns of each 2048 chunk
    data = make(2500, 200, 5003, dtype, masked=100, seed=8)
    check(*run_both(*data), dtype)


def test_fp32_as_accurate_as_ieee_sgemm():
    """The fp32 path (split-TF32 dots and dX / dW GEMMs by default) is within 3x the error of plain IEEE fp32 (naive,
    TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hidden, weight, _, targets = make(2000, 512, 8000, torch.float32, seed=9)
    out, ref, leaves, refs, valid = run_both(hidden, weight, None, targets, outputs=("entropy",))
    h32 = hidden.detach().clone().requires_grad_()
    w32 = weight.detach().clone().requires_grad_()
    lp, ent, *_ = naive_logprobs(h32, w32, None, targets, 1.0, None, None, 1.0, ("entropy",))
    gen = torch.Generator(device="cuda").manual_seed(1)
    g = torch.randn(targets.shape, device="cuda", generator=gen)
    ge = torch.randn(targets.shape, device="cuda", generator=gen)
    ((lp * g).sum() + (ent * ge).sum()).backward()
    for mine, ieee, exact in ((out[0], lp, ref[0]), (out[1], ent, ref[1]), (leaves[0].grad, h32.grad, refs[0].grad),
                              (leaves[1].grad, w32.grad, refs[1].grad)):
        assert rel(mine, exact) <= 3 * rel(ieee, exact) + 1e-7, (rel(mine, exact), rel(ieee, exact))


# --- the frozen head (two GEMMs) and the materialised trainable head ------------------------------------------------


@pytest.fixture
def paths(monkeypatch):
    """The path each call of the kernel took (`frozen`, `materialized`, `recompute`, `stats`)."""
    from grpo_lab.loss.kernel import function

    taken = []
    real = function.choose_path
    monkeypatch.setattr(function, "choose_path", lambda *a: taken.append(real(*a)) or taken[-1])
    # these tests' heads are small: should the small-head rule (`frozen_recompute_rows`) be on, keep them two-GEMM
    monkeypatch.setattr(TUNING, "frozen_recompute_below", dict.fromkeys(TUNING.frozen_recompute_below, 0))
    return taken


@pytest.mark.parametrize("entropy_grad", ["expected", "unexpected", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("shape", [(300, 200, 5003), (4500, 256, 9001)])
def test_frozen_head_against_float64(paths, dtype, peaked, shape, entropy_grad):
    """Loss values, entropy and dX of the frozen path at the trainable path's tolerances; an entropy gradient the
    forward did not expect is still exact (the backward recomputes); peaked rows (p_y → 1) keep their precision."""
    from grpo_lab.loss.frozen import expect_entropy_grad

    n, h, v = shape
    data = make(n, h, v, dtype, peaked=peaked, masked=n // 10)
    with expect_entropy_grad(entropy_grad == "expected"):
        out = run_both(*data, frozen=True, entropy_grad=entropy_grad != "none")
    check(*out, dtype)
    assert paths == ["frozen"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_bias_softcap_scale_temperature(paths, dtype):
    from grpo_lab.loss.frozen import expect_entropy_grad

    hidden, weight, bias, targets = make(777, 192, 3001, dtype, bias=True, masked=50, seed=3)
    with expect_entropy_grad():
        out = run_both(hidden, weight, bias, targets, temperature=0.7, softcap=5.0, logit_scale=1.7, frozen=True)
    check(*out, dtype)
    assert paths == ["frozen"]


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_rows_recomputed_against_their_max(monkeypatch, paths, dtype, deferred):
    """Rows whose max is far above the target's logit (the reference e^(z − ref) is stored against) are recomputed
    against their exact max: with a headroom of 0.5 that is most rows, and nothing changes, whether the forward
    checks them itself or the backward does (`frozen_deferred_check`)."""
    from grpo_lab.loss.frozen import expect_entropy_grad

    monkeypatch.setattr(TUNING, "frozen_deferred_check", dict.fromkeys(TUNING.frozen_deferred_check, deferred))
    monkeypatch.setattr(TUNING, "ref_headroom", 0.5)
    monkeypatch.setattr(TUNING, "frozen_tile", {"16": (1024, 2048), "32": (1024, 2048)})  # several token tiles
    data = make(2500, 200, 5003, dtype, peaked=True, masked=100, seed=11)
    with expect_entropy_grad():
        check(*run_both(*data, frozen=True), dtype)
    assert paths == ["frozen"]


@pytest.mark.parametrize("tma,persistent,p_tma", [(True, True, True), (True, True, False), (False, False, False),
                                                  (True, False, True), (False, True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_kernel_variants(monkeypatch, paths, tma, persistent, p_tma, dtype):
    from grpo_lab.loss.frozen import expect_entropy_grad

    monkeypatch.setattr(TUNING, "use_tma", tma)
    monkeypatch.setattr(TUNING, "p_tma", {key: p_tma for key in TUNING.p_tma})
    monkeypatch.setattr(TUNING, "persistent", {key: persistent for key in TUNING.persistent})
    monkeypatch.setattr(TUNING, "persistent_programs", 7)
    monkeypatch.setattr(TUNING, "frozen_tile", {"16": (1024, 2048), "32": (1024, 2048)})
    data = make(2500, 200, 5003, dtype, masked=100, seed=8)
    with expect_entropy_grad():
        check(*run_both(*data, frozen=True), dtype)
    assert paths == ["frozen"]


@pytest.mark.parametrize("mode", ["frozen", "trainable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_chunk_launches_compute_what_the_jit_launches_compute(monkeypatch, mode, dtype):
    """`direct_launch`: after the first launch of each specialisation in a chunk loop, the compiled kernel is called
    without Triton's dispatch. Same kernels, same arguments: the outputs and gradients are bit for bit the JIT's, and
    most launches did go direct (several token tiles, a last chunk of another width, rows not a multiple of 16)."""
    from grpo_lab.loss.frozen import expect_entropy_grad
    from grpo_lab.loss.kernel import relaunch

    monkeypatch.setattr(TUNING, "frozen_tile", {"16": (1024, 1024), "32": (1024, 1024)})
    # the statistics forward (2400 valid rows): 4 vocabulary blocks a launch, 5 or 10 chunks
    monkeypatch.setattr(TUNING, "part_budget_bytes", 6 * 4 * 2400 * 4)
    direct = []
    real_call = relaunch.Relauncher.__call__

    def counted(self, grid, key, args, options):
        direct.append(TUNING.direct_launch and key() in self.compiled)
        return real_call(self, grid, key, args, options)

    monkeypatch.setattr(relaunch.Relauncher, "__call__", counted)
    data = make(2500, 200, 5003, dtype, masked=100, seed=12)
    results = []
    for on in (False, True):
        monkeypatch.setattr(TUNING, "direct_launch", on)
        with expect_entropy_grad():
            out, _, leaves, _, _ = run_both(*data, frozen=mode == "frozen")
        results.append([x for x in (*out, *(leaf.grad for leaf in leaves if leaf is not None)) if x is not None])
    for jit, fast in zip(*results):
        assert torch.equal(jit, fast)
    launches = len(direct) // 2
    assert not any(direct[:launches]) and sum(direct[launches:]) >= launches // 2, direct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_frozen_heads_take_the_recompute_path_with_the_frozen_tile(monkeypatch, paths, dtype):
    """Under `frozen_recompute_below` rows × hidden (and `frozen_recompute_rows` rows) a frozen head recomputes (dX
    only, exact) in dZ tiles of the frozen P~ tile's budget; at or above it, the two-GEMM path."""
    from grpo_lab.loss.frozen import expect_entropy_grad
    from grpo_lab.loss.kernel import function

    n, h, v = 2500, 200, 5003
    key = "32" if dtype == torch.float32 else "16"
    monkeypatch.setattr(TUNING, "frozen_tile", {"16": (1024, 2048), "32": (1024, 2048)})
    monkeypatch.setattr(TUNING, "frozen_recompute_rows", {"16": 10**9, "32": 10**9})
    tiles = []
    real = function.recompute_backward
    monkeypatch.setattr(function, "recompute_backward", lambda *a: tiles.append(a[-1]) or real(*a))
    data = make(n, h, v, dtype, masked=100, seed=5)
    valid_rows = int((data[3] >= 0).sum())
    for below in (valid_rows * h + 1, valid_rows * h):
        monkeypatch.setattr(TUNING, "frozen_recompute_below", {**TUNING.frozen_recompute_below, key: below})
        with expect_entropy_grad():
            check(*run_both(*data, frozen=True), dtype)
    assert paths == ["recompute", "frozen"]
    assert tiles == [(1024, 2048)]


def test_frozen_all_masked_and_the_choice_of_path(paths):
    """All rows masked: zeros. The path follows what needs a gradient: frozen, trainable (recompute), no grad."""
    hidden, weight, _, targets = make(64, 96, 1000, torch.bfloat16)
    h = hidden.detach().clone().requires_grad_()
    lp, ent, *_ = fused_linear_logprobs(h, weight, None, torch.full_like(targets, -100), 1.0, None, None, 1.0,
                                        ("entropy",))
    (lp.sum() + ent.sum()).backward()
    assert (lp == 0).all() and (h.grad == 0).all()
    fused_linear_logprobs(h, weight.detach().clone().requires_grad_(), None, targets)
    with torch.no_grad():
        fused_linear_logprobs(h, weight, None, targets)
    fused_linear_logprobs(h, weight, None, targets)
    assert paths == ["stats", "recompute", "stats", "frozen"]


def test_frozen_under_autocast_with_fp32_master_weights(paths):
    """A frozen fp32 head under bf16 autocast: the bf16 frozen path, fp32 input gradient."""
    from grpo_lab.loss.frozen import expect_entropy_grad

    hidden, weight, _, targets = make(1000, 256, 5000, torch.float32, seed=5)
    h = hidden.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16), expect_entropy_grad():
        lp, ent, *_ = fused_linear_logprobs(h, weight, None, targets, 1.0, None, None, 1.0, ("entropy",))
    (lp.sum() + ent.sum()).backward()
    hr = hidden.to(torch.bfloat16).double().requires_grad_()
    lr, er, *_ = naive_logprobs(hr, weight.to(torch.bfloat16).double(), None, targets, 1.0, None, None, 1.0,
                                ("entropy",))
    (lr.sum() + er.sum()).backward()
    assert h.grad.dtype == torch.float32 and paths == ["frozen"]
    assert rel(lp, lr) < 1e-4 and rel(ent, er) < 1e-4 and rel(h.grad, hr.grad) < 1.5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_materialized_head_against_float64(monkeypatch, paths, dtype, peaked, entropy_grad):
    """Trainable head with memory allowed for speed: probabilities kept, backward = two GEMMs after an elementwise
    pass (an entropy gradient) or with none (`dz_free_backward`: the kept P~ is the GEMMs' operand)."""
    monkeypatch.setattr(TUNING, "materialize_gib", 4.0)
    data = make(4500, 256, 9001, dtype, peaked=peaked, bias=True, masked=450, seed=12)
    check(*run_both(*data, entropy_grad=entropy_grad), dtype)
    assert paths == ["materialized"]
    monkeypatch.setattr(TUNING, "ref_headroom", 0.5)  # most rows recomputed against their max
    check(*run_both(*data, entropy_grad=entropy_grad), dtype)
    monkeypatch.setattr(TUNING, "materialize_gib", 0.01)  # does not fit: the memory-lean recompute path
    check(*run_both(*data, entropy_grad=entropy_grad), dtype)
    assert paths == ["materialized", "materialized", "recompute"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("loss_type", ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"))
def test_frozen_head_every_loss_type_through_trl(tmp_path, paths, loss_type, dtype):
    """A real LoRA `GRPOTrainer` on the GPU: TRL's own `_compute_loss` with the grpo_lab head (which takes the frozen
    path) against the same with the naive head — loss, every LoRA gradient and the logged entropy and KL."""
    from peft import LoraConfig

    from grpo_lab.tasks.tiny import build_char_tokenizer

    here = os.path.dirname(__file__)
    fixtures, frozen_tests = (_load(os.path.join(here, "..", "core", name))
                              for name in ("trainer_fixtures.py", "test_frozen_head.py"))
    torch.backends.cuda.matmul.allow_tf32 = False
    trainer = fixtures.make_trainer(
        tmp_path, build_char_tokenizer(), use_cpu=False, bf16=dtype == "bf16", loss_type=loss_type, beta=0.04,
        epsilon_high=0.28, temperature=0.9,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert not trainer.model.get_output_embeddings().weight.requires_grad
    frozen_tests.assert_parity(frozen_tests.loss_parity(trainer, "cuda"), 1e-4 if dtype == "fp32" else 3e-2)
    assert paths == ["frozen"]


def _load(path):
    """A test module of tests/core by file path (the two test folders are not packages)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0] + "_for_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the memory policy of a trainable head ---------------------------------------------------------------------------


def _peak_bytes(step) -> int:
    """Peak allocated bytes of `step()` above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_of_memory_the_policy_keeps_the_flat_paths_peak(monkeypatch, paths, dtype):
    """The free-memory side of the policy (its peak rule off): with little memory free (faked: the [N, V] buffer over
    half of it) the flat path, with the same peak as the policy turned off; with the card's real free memory it keeps
    the buffer (peak ≥ flat + its size), with the same results. `path_counts()` says which ran."""
    from grpo_lab.loss.kernel import launch, path_counts, reset_path_counts

    monkeypatch.setattr(TUNING, "materialize_within_peak", False)
    monkeypatch.setattr(TUNING, "materialize_flat_below", dict.fromkeys(TUNING.materialize_flat_below, 0))
    n, h, v = 16384, 256, 50000 if dtype == torch.float32 else 100000
    need = n * v * (4 if dtype == torch.float32 else 2)  # 3.05 GiB either way
    hidden, weight, _, targets = make(n, h, v, dtype, seed=21)
    gen = torch.Generator(device="cuda").manual_seed(2)
    g, ge = (torch.randn(n, device="cuda", generator=gen) for _ in range(2))
    x, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    results = []

    def step():
        x.grad = w.grad = None
        lp, ent, *_ = fused_linear_logprobs(x, w, None, targets, 1.0, None, None, 1.0, ("entropy",))
        ((lp * g).sum() + (ent * ge).sum()).backward()
        results.append((lp.detach(), x.grad, w.grad))

    real_free = launch.free_device_bytes

    def peak(fraction, free=None):
        monkeypatch.setattr(TUNING, "materialize_fraction", fraction)
        monkeypatch.setattr(launch, "free_device_bytes", real_free if free is None else (lambda device: free))
        step()  # compiles, and settles the allocator
        return _peak_bytes(step)

    reset_path_counts()
    flat = peak(0.0)
    short = peak(0.5, free=int(need * 1.9))  # need + 2 GiB is free, but not twice need: flat for memory
    kept = peak(0.5)
    counts = path_counts()
    assert paths == ["recompute"] * 2 + ["recompute"] * 2 + ["materialized"] * 2
    assert (counts.recompute, counts.flat_for_memory, counts.materialized) == (4, 2, 2)
    assert abs(short - flat) <= 2**20, (short, flat)
    assert kept >= flat + 0.75 * need, (kept, flat, need)
    for a, b in zip(results[1], results[-1]):
        assert rel(a, b) < (5e-5 if dtype == torch.float32 else 1.5e-2)


def test_the_default_policy_and_the_path_counts(monkeypatch, paths):
    """Defaults as shipped: a 16-bit trainable head takes the flat path where its buffer would raise the run's peak
    (right after a reset of the peak, as at a run's first step), the materialised one from 2^22 rows × hidden once
    the run has reached a higher peak elsewhere (a tensor allocated and freed stands for an optimizer step), the flat
    one below 2^22 (host-bound there); a frozen head its two-GEMM path, old log-probs the statistics-only one;
    `path_counts()` counts each."""
    from grpo_lab.loss.kernel import path_counts, reset_path_counts

    for name in ("materialize_fraction", "materialize_flat_below", "materialize_within_peak"):
        monkeypatch.setattr(TUNING, name, getattr(type(TUNING)(), name))
    reset_path_counts()
    hidden, weight, _, targets = make(4096, 1024, 9001, torch.bfloat16, seed=4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    check(*run_both(hidden, weight, None, targets), torch.bfloat16)
    torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")  # the run's peak, reached outside the head
    check(*run_both(hidden, weight, None, targets), torch.bfloat16)
    check(*run_both(hidden[:2048], weight, None, targets[:2048]), torch.bfloat16)
    check(*run_both(hidden, weight, None, targets, frozen=True), torch.bfloat16)
    with torch.no_grad():
        fused_linear_logprobs(hidden, weight, None, targets)
    assert paths == ["recompute", "materialized", "recompute", "frozen", "stats"]
    counts = path_counts()
    assert (counts.materialized, counts.recompute, counts.frozen, counts.stats) == (1, 2, 1, 1)
    assert counts.flat_for_memory == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_default_the_buffer_never_raises_the_runs_peak(monkeypatch, paths, dtype):
    """The default policy over a run of steps whose own peak lies outside the head (a tensor of 1.5 × the buffer,
    allocated and freed after each head step, stands for the optimizer step): the first step has no room under the
    peak and runs flat; the next ones keep the buffer, and the run's peak stays that of the flat run to the MiB. With
    the peak rule off the free memory decides, and the head's peak grows by the buffer. Results equal either way."""
    from grpo_lab.loss.kernel import path_counts, reset_path_counts

    for name in ("materialize_fraction", "materialize_within_peak"):
        monkeypatch.setattr(TUNING, name, getattr(type(TUNING)(), name))
    monkeypatch.setattr(TUNING, "materialize_flat_below", dict.fromkeys(TUNING.materialize_flat_below, 0))
    n, h, v = 16384, 256, 50000 if dtype == torch.float32 else 100000
    need = n * v * (4 if dtype == torch.float32 else 2)  # 3.05 GiB either way
    hidden, weight, _, targets = make(n, h, v, dtype, seed=22)
    gen = torch.Generator(device="cuda").manual_seed(3)
    g = torch.randn(n, device="cuda", generator=gen)
    x, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    results = []

    def run(steps):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            x.grad = w.grad = None
            lp, *_ = fused_linear_logprobs(x, w, None, targets)
            (lp * g).sum().backward()
            results.append(tuple(t.detach().cpu() for t in (lp, x.grad, w.grad)))  # off the GPU: no peak of its own
            del lp
            torch.empty(need + need // 2, dtype=torch.uint8, device="cuda")  # the step's "optimizer" peak
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    reset_path_counts()
    monkeypatch.setattr(TUNING, "materialize_fraction", 0.0)
    flat = run(3)
    monkeypatch.setattr(TUNING, "materialize_fraction", 0.5)
    default = run(3)
    assert paths[3:6] == ["recompute", "materialized", "materialized"], paths
    assert path_counts().flat_for_memory == 1
    assert abs(default - flat) <= 2**20, (default, flat)
    monkeypatch.setattr(TUNING, "materialize_within_peak", False)
    results_before = len(results)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    x.grad = w.grad = None
    lp, *_ = fused_linear_logprobs(x, w, None, targets)
    (lp * g).sum().backward()
    torch.cuda.synchronize()
    assert paths[-1] == "materialized"
    assert torch.cuda.max_memory_allocated() - base >= 0.75 * need
    results.append(tuple(t.detach().cpu() for t in (lp, x.grad, w.grad)))
    for a, b in zip(results[0], results[results_before]):
        assert rel(a, b) < (5e-5 if dtype == torch.float32 else 1.5e-2)
    for a, b in zip(results[0], results[4]):
        assert rel(a, b) < (5e-5 if dtype == torch.float32 else 1.5e-2)
