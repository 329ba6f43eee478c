"""GPU checks of the CUTLASS frozen-head forward (Hopper; `pytest -m gpu` on the H200).

The block kernel against float64 (P~ and both row sums, ragged shapes, a P~ buffer wider than the block), then the
whole frozen head through `fused_linear_logprobs` against the float64 reference with the CUTLASS path taken — loss
values, entropy, dX — including rows redone by the Triton path and the cases that must not take it.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_fused_kernel_gpu import TOL, check, make, run_both  # noqa: E402

import grpo_lab.kernels.fused_linear_logprob as F  # noqa: E402
from grpo_lab.backends.base import expect_entropy_grad  # noqa: E402
from grpo_lab.kernels import cutlass_head  # noqa: E402
from grpo_lab.kernels.cutlass_head.build import VARIANTS  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def needs_the_library():
    if not cutlass_head.available():
        pytest.fail("the CUTLASS frozen-head kernel cannot run here (not Hopper, or not built: "
                    "python -m grpo_lab.kernels.cutlass_head.build)")


@pytest.fixture
def taken(monkeypatch):
    """Which frozen forward ran: 'cutlass' or 'triton', per call."""
    calls = []
    for name in ("_cutlass_frozen_forward", "_triton_frozen_forward"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, _real=real, _name=name: calls.append(_name.split("_")[1]) or _real(*a))
    monkeypatch.setattr(F, "FROZEN_RECOMPUTE_BELOW", dict.fromkeys(F.FROZEN_RECOMPUTE_BELOW, 0))
    return calls


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("rows,cols,hidden", [(300, 1000, 1024), (129, 8192, 4096), (4096, 40, 1024), (1, 8, 64)])
def test_block_against_float64(monkeypatch, variant, rows, cols, hidden):
    monkeypatch.setattr(cutlass_head, "VARIANT", variant)
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = (torch.randn(rows, hidden, device="cuda", generator=gen) * 0.5).bfloat16()
    w = (torch.randn(cols, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16()
    scale = 1.3
    z = scale * (x.double() @ w.double().T)
    ref = z.max(1).values - torch.rand(rows, device="cuda", generator=gen, dtype=torch.float64) * 8
    p = torch.full((rows, cols + 24), float("nan"), device="cuda", dtype=torch.bfloat16)
    sums = cutlass_head.frozen_logits_exp(x, w, (-ref).float(), p, scale, True).double().sum(1)[:, :rows]
    e = torch.exp(z - ref[:, None])
    assert ((p[:, :cols].double() - e).abs() / e).max().item() < 2 ** -8  # bf16 rounding of an fp32 exp
    assert torch.isnan(p[:, cols:].float()).all()  # the leading dimension is respected
    assert ((sums[0] - e.sum(1)) / e.sum(1)).abs().max().item() < 1e-5
    assert ((sums[1] - (e * (z - ref[:, None])).sum(1)).abs() / e.sum(1)).max().item() < 1e-4
    only_e = cutlass_head.frozen_logits_exp(x, w, (-ref).float(), p, scale, False)
    assert only_e.shape[0] == 1 and torch.allclose(only_e.double().sum(1)[0, :rows], sums[0], rtol=1e-6)


@pytest.mark.parametrize("entropy_grad", ["none", "unexpected"])
@pytest.mark.parametrize("outputs", [("entropy",), ()])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("shape", [(300, 256, 5008), (4500, 1024, 9000)])
def test_frozen_head_against_float64(taken, shape, peaked, outputs, entropy_grad):
    """Log-probs, entropy and dX at the trainable path's bf16 tolerances, through the CUTLASS first GEMM."""
    n, h, v = shape
    data = make(n, h, v, torch.bfloat16, peaked=peaked, masked=n // 10)
    with expect_entropy_grad(False):
        out = run_both(*data, frozen=True, outputs=outputs, entropy_grad=entropy_grad != "none")
    check(*out, torch.bfloat16, outputs=outputs)
    # peaked rows whose target sits far below the max are redone by Triton; an unexpected entropy gradient is
    # served by the recomputing backward (no second forward)
    assert taken[0] == "cutlass" and set(taken) <= {"cutlass", "triton"}


def test_several_tiles_and_a_ragged_last_chunk(monkeypatch, taken):
    monkeypatch.setattr(F, "FROZEN_TILE", {"16": (1024, 2048), "32": (1024, 2048)})
    data = make(2500, 512, 5000, torch.bfloat16, masked=100, seed=8)
    with expect_entropy_grad(False):
        check(*run_both(*data, frozen=True, outputs=("entropy",), entropy_grad=False), torch.bfloat16,
              outputs=("entropy",))
    assert taken == ["cutlass"]


def test_rows_over_the_headroom_are_redone_by_triton(monkeypatch, taken):
    """With a headroom of 0.5 most rows' sums say their max may be over it: the Triton path redoes them, exactly."""
    monkeypatch.setattr(F, "REF_HEADROOM", 0.5)
    data = make(2500, 256, 5008, torch.bfloat16, peaked=True, masked=100, seed=11)
    with expect_entropy_grad(False):
        check(*run_both(*data, frozen=True, outputs=("entropy",), entropy_grad=False), torch.bfloat16,
              outputs=("entropy",))
    assert taken[0] == "cutlass" and "triton" in taken


def test_same_answer_as_the_triton_path(monkeypatch, taken):
    data = make(3000, 1024, 9000, torch.bfloat16, masked=30, seed=5)
    with expect_entropy_grad(False):
        fast = run_both(*data, frozen=True, outputs=("entropy",), entropy_grad=False)
        monkeypatch.setattr(F, "CUTLASS_FROZEN", "0")
        slow = run_both(*data, frozen=True, outputs=("entropy",), entropy_grad=False)
    assert taken == ["cutlass", "triton"]
    tol_v, tol_g = TOL[torch.bfloat16]
    for a, b in ((fast[0][0], slow[0][0]), (fast[0][1], slow[0][1])):
        assert ((a - b).norm() / b.norm()).item() < tol_v / 10
    assert ((fast[2][0].grad.float() - slow[2][0].grad.float()).norm() / slow[2][0].grad.float().norm()).item() < 4e-3


@pytest.mark.parametrize("case", ["bias", "softcap", "extras", "entropy_grad_expected", "odd_vocab", "fp32"])
def test_cases_it_does_not_serve_take_triton(taken, case):
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    hidden, weight, bias, targets = make(600, 256, 5003 if case == "odd_vocab" else 5008, dtype, bias=case == "bias",
                                         masked=20, seed=2)
    outputs = ("entropy", "is_top1") if case == "extras" else ("entropy",)
    with expect_entropy_grad(case == "entropy_grad_expected"):
        out = run_both(hidden, weight, bias, targets, softcap=5.0 if case == "softcap" else None, frozen=True,
                       outputs=outputs, entropy_grad=case == "entropy_grad_expected")
    check(*out, dtype, outputs=outputs)
    assert taken == ["triton"]
