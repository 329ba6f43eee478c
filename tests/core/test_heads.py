"""Every log-prob head against a float64 reference, and against each other (values and gradients)."""

import pytest
import torch

from grpo_lab.loss.backends import LOGPROB_BACKENDS
from grpo_lab.loss.heads import logprob_head

ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def reference(h, w, b, y, temperature, softcap, scale, rounding_dtype):
    """float64 math on the inputs as the backends see them (rounded to `rounding_dtype`)."""
    h64 = h.to(rounding_dtype).double()
    w64 = w.to(rounding_dtype).double()
    z = h64 @ w64.t()
    if b is not None:
        z = z + b.to(rounding_dtype).double()
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, -1)
    lp = log_p.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return lp, ent


def run_backend(name, h, w, b, y, temperature, softcap, scale, g_lp, g_ent, chunk=64):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    bb = None if b is None else b.clone().requires_grad_()
    out = logprob_head(name)(hh, ww, bb, y, temperature, chunk, softcap, scale, ALL_OUTPUTS)
    valid = (y >= 0).float()
    ((out[0] * valid * g_lp).sum() + (out[1] * valid * g_ent).sum()).backward()
    return out, hh.grad, ww.grad, None if bb is None else bb.grad


CASES = [
    # N, H, V, temperature, softcap, logit_scale, bias, peaked
    (37, 24, 301, 1.0, None, 1.0, False, False),
    (50, 16, 517, 0.7, 30.0, 0.5, True, False),
    (19, 32, 1000, 1.3, None, 2.0, True, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", LOGPROB_BACKENDS)
def test_backend_matches_float64(name, case, dtype):
    n, hdim, v, temp, softcap, scale, has_bias, peaked = case
    gen = torch.Generator().manual_seed(n)
    h = torch.randn(n, hdim, generator=gen) * (4.0 if peaked else 1.0)
    w = torch.randn(v, hdim, generator=gen) / hdim**0.5 * (3.0 if peaked else 1.0)
    b = torch.randn(v, generator=gen) if has_bias else None
    y = torch.randint(0, v, (n,), generator=gen)
    y[::7] = -100  # masked rows
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    h, w = h.to(dtype), w.to(dtype)
    b = None if b is None else b.to(dtype)

    out, gh, gw, gb = run_backend(name, h, w, b, y, temp, softcap, scale, g_lp, g_ent)
    valid = y >= 0
    # The float64 reference, and its gradients by autograd.
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    lp64, ent64 = reference(h64, w64, b64, y, temp, softcap, scale, torch.float64)
    ((lp64 * valid * g_lp.double()).sum() + (ent64 * valid * g_ent.double()).sum()).backward()

    # naive rounds the logits to the compute dtype; the fused backends accumulate in fp32.
    bf16_naive = dtype == torch.bfloat16 and name in ("naive", "trl")
    logit_scale_of_case = (h.double() @ w.double().t()).abs().max().item() * scale / temp
    atol = 0.01 * logit_scale_of_case if bf16_naive else (2e-3 if dtype == torch.bfloat16 else 2e-5)
    assert out[0].dtype == torch.float32
    torch.testing.assert_close(out[0][valid].double(), lp64[valid].detach(), atol=atol, rtol=0)
    torch.testing.assert_close(out[1][valid].double(), ent64[valid].detach(), atol=atol, rtol=0)
    assert torch.all(out[0][~valid] == 0) or name != "grpo_lab"
    grad_atol = atol * 4 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(gh.double(), h64.grad, atol=grad_atol * max(1, h64.grad.abs().max().item()), rtol=0.02)
    torch.testing.assert_close(gw.double(), w64.grad, atol=grad_atol * max(1, w64.grad.abs().max().item()), rtol=0.02)
    if b is not None:
        torch.testing.assert_close(gb.double(), b64.grad, atol=grad_atol * max(1, b64.grad.abs().max().item()),
                                   rtol=0.02)
    assert torch.isfinite(out[0]).all() and torch.isfinite(gw).all()


@pytest.mark.parametrize("name", LOGPROB_BACKENDS)
def test_extra_outputs_agree_with_naive(name):
    gen = torch.Generator().manual_seed(3)
    h, w = torch.randn(40, 16, generator=gen), torch.randn(300, 16, generator=gen)
    y = torch.randint(0, 300, (40,), generator=gen)
    ref = logprob_head("naive")(h, w, None, y, 1.0, 64, None, 1.0, ALL_OUTPUTS)
    out = logprob_head(name)(h, w, None, y, 1.0, 64, None, 1.0, ALL_OUTPUTS)
    for a, r in zip(out[2:4], ref[2:4]):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[4], ref[4])


def test_chunked_path_extreme_logits_are_finite():
    h = torch.full((4, 8), 1e3)
    w = torch.randn(50, 8) * 1e2
    y = torch.tensor([0, 1, 2, 3])
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent, *_ = logprob_head("grpo_lab")(hh, ww, None, y, 1.0, 16, None, 1.0, ("log_probs", "entropy"))
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(hh.grad).all() and torch.isfinite(ww.grad).all()


def test_chunked_path_all_masked_is_differentiable_zero():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    y = torch.full((5,), -100)
    lp, ent, *_ = logprob_head("grpo_lab")(h, w, None, y, 1.0, 16, None, 1.0, ("log_probs", "entropy"))
    assert torch.equal(lp, torch.zeros(5)) and torch.equal(ent, torch.zeros(5))
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


def test_chunked_path_under_autocast_uses_bf16_projection():
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(12, 16, generator=gen), torch.randn(100, 16, generator=gen)
    y = torch.randint(0, 100, (12,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, *_ = logprob_head("grpo_lab")(h, w, None, y, 1.0, 32, None, 1.0, ("log_probs",))
    ref, _ = reference(h, w, None, y, 1.0, None, 1.0, torch.bfloat16)
    torch.testing.assert_close(lp.double(), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(hidden=torch.randn(3, 4, 5)), "hidden must be"),
        (dict(weight=torch.randn(10, 7)), "width"),
        (dict(targets=torch.zeros(2, dtype=torch.long)), "targets must be"),
        (dict(targets=torch.zeros(4)), "integer"),
        (dict(temperature=0.0), "temperature"),
        (dict(outputs=("log_probs", "logits")), "Unknown outputs"),
        (dict(bias=torch.randn(3)), "bias"),
    ],
)
def test_bad_input_is_a_clear_error(args, match):
    kw = dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), bias=None, targets=torch.zeros(4, dtype=torch.long),
              temperature=1.0, chunk_size=4, softcap=None, logit_scale=1.0, outputs=("log_probs",))
    kw.update(args)
    for name in LOGPROB_BACKENDS:
        with pytest.raises((ValueError, TypeError), match=match):
            logprob_head(name)(**kw)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="Unknown loss_backend 'fast'"):
        logprob_head("fast")
    with pytest.raises(ValueError, match="liger"):
        logprob_head("liger")


@pytest.mark.parametrize("entropy_grad", ["expected", "unexpected", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_frozen_head_matches_float64(case, dtype, entropy_grad):
    """A head that needs no gradient takes the two-GEMM path (A = Σ p·W from the forward, elementwise backward):
    the same values and input gradient as the float64 reference, whether or not the forward prepared the entropy
    gradient it then gets (an unexpected one is computed by recomputing), and for peaked rows (p_y → 1)."""
    import grpo_lab.loss.heads.chunked as chunked
    from grpo_lab.loss.frozen import expect_entropy_grad

    n, hdim, v, temp, softcap, scale, has_bias, peaked = case
    gen = torch.Generator().manual_seed(n + 1)
    h = (torch.randn(n, hdim, generator=gen) * (4.0 if peaked else 1.0)).to(dtype)
    w = (torch.randn(v, hdim, generator=gen) / hdim**0.5 * (3.0 if peaked else 1.0)).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype) if has_bias else None
    y = (h.float() @ w.float().t()).argmax(-1) if peaked else torch.randint(0, v, (n,), generator=gen)
    y[::7] = -100
    g_lp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    valid = y >= 0
    calls = []
    real = chunked.frozen_input_grad
    chunked.frozen_input_grad = lambda *a: calls.append(a[1] is not None) or real(*a)
    try:
        hh = h.clone().requires_grad_()
        with expect_entropy_grad(entropy_grad == "expected"):
            lp, ent, *_ = logprob_head("grpo_lab")(hh, w, b, y, temp, 64, softcap, scale, ALL_OUTPUTS)
        loss = (lp * valid * g_lp).sum() + ((ent * valid * g_ent).sum() if entropy_grad != "none" else 0)
        loss.backward()
    finally:
        chunked.frozen_input_grad = real
    # the elementwise backward ran unless an entropy gradient came unannounced (then the recomputing one did)
    assert calls == ([] if entropy_grad == "unexpected" else [entropy_grad == "expected"])
    h64 = h.double().requires_grad_()
    lp64, ent64 = reference(h64, w.double(), None if b is None else b.double(), y, temp, softcap, scale, torch.float64)
    ((lp64 * valid * g_lp.double()).sum() + ((ent64 * valid * g_ent.double()).sum() if entropy_grad != "none"
                                             else 0)).backward()
    atol = 2e-3 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(lp[valid].double(), lp64[valid].detach(), atol=atol, rtol=0)
    torch.testing.assert_close(ent[valid].double(), ent64[valid].detach(), atol=atol, rtol=0)
    assert torch.all(lp[~valid] == 0) and torch.all(hh.grad[~valid] == 0)
    grad_atol = atol * 4 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(hh.grad.double(), h64.grad, atol=grad_atol * max(1, h64.grad.abs().max().item()),
                               rtol=0.02)


def test_head_mode():
    from grpo_lab.loss.contract import head_mode

    h, w, b = torch.randn(2, 3), torch.randn(4, 3), torch.randn(4)
    assert head_mode(h, w, b) == "inference"
    h.requires_grad_()
    assert head_mode(h, w, b) == "frozen"
    assert head_mode(h, w, b.requires_grad_()) == "trainable"
    assert head_mode(h, w.requires_grad_(), None) == "trainable"
    with torch.no_grad():
        assert head_mode(h, w, b) == "inference"
