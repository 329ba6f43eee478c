"""What of the kernel package runs without a GPU: imports, the CPU fallback, and the fused GRPO module."""

from __future__ import annotations

import importlib

import pytest
import torch

from grpo_lab.loss.config import GRPOLossConfig
from grpo_lab.loss.heads.naive import naive_logprobs
from grpo_lab.loss.reference import grpo_loss


def test_kernel_package_imports_without_gpu():
    kernel = importlib.import_module("grpo_lab.loss.kernel")
    assert callable(kernel.fused_linear_logprobs)
    if not torch.cuda.is_available():
        assert kernel.fused_kernel_available() is False


def test_the_loss_package_imports_nothing_heavy_until_a_name_is_used():
    """`import grpo_lab.loss` (and `grpo_lab`) pulls in neither TRL, Triton nor torch; the re-exported names import
    their module on first use."""
    import subprocess
    import sys

    code = ("import sys, grpo_lab, grpo_lab.loss, grpo_lab.loss.heads, grpo_lab.loss.kernel;"
            "print(sorted(m for m in ('trl', 'triton', 'torch') if m in sys.modules));"
            "from grpo_lab.loss import GRPOLossConfig, grpo_loss, logprob_head;"
            "print(GRPOLossConfig.__module__, grpo_loss.__module__, logprob_head('naive').__module__);"
            "print(grpo_lab.GRPOLabConfig.__module__, grpo_lab.fused_linear_logprobs.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "[]", "grpo_lab.loss.config grpo_lab.loss.reference grpo_lab.loss.heads.naive",
        "grpo_lab.loss.trl_switch grpo_lab.loss.kernel"]


def test_fused_entry_refuses_cpu_tensors_clearly():
    kernel = importlib.import_module("grpo_lab.loss.kernel")
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    expected = (ValueError, "CUDA") if kernel.TRITON_AVAILABLE else (ImportError, "Triton")
    with pytest.raises(expected[0], match=expected[1]):
        kernel.fused_linear_logprobs(h, w, None, y)


def test_without_triton_the_entry_raises_import_error(monkeypatch):
    kernel = importlib.import_module("grpo_lab.loss.kernel")
    monkeypatch.setattr(kernel, "TRITON_AVAILABLE", False)
    assert kernel.fused_kernel_available() is False
    with pytest.raises(ImportError, match="Triton"):
        kernel.fused_linear_logprobs(torch.randn(2, 4), torch.randn(5, 4), None, torch.zeros(2, dtype=torch.long))


def test_dispatch_falls_back_to_torch_path_on_cpu():
    from grpo_lab.loss.heads.grpo_lab import grpo_lab_logprobs

    torch.manual_seed(0)
    h = torch.randn(37, 24, dtype=torch.float64)
    w = torch.randn(301, 24, dtype=torch.float64)
    y = torch.randint(0, 301, (37,))
    y[5] = -100
    lp, ent, *_ = grpo_lab_logprobs(h, w, None, y, 0.8, None, None, 1.0, ("entropy",))
    ref_lp, ref_ent, *_ = naive_logprobs(h, w, None, y, 0.8, None, None, 1.0, ("entropy",))
    valid = y >= 0
    torch.testing.assert_close(lp[valid], ref_lp[valid].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[valid], ref_ent[valid].float(), rtol=1e-5, atol=1e-5)
    assert lp[5] == 0


CONFIGS = [
    GRPOLossConfig(),
    GRPOLossConfig(loss_type="grpo", beta=0.04),
    GRPOLossConfig(loss_type="bnpo", importance_sampling_level="sequence", epsilon_high=0.28),
    GRPOLossConfig(loss_type="dr_grpo", entropy_coef=0.01, max_completion_length=12, temperature=0.7),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.loss_type}-b{c.beta}")
def test_fused_module_matches_reference_loss_on_naive_logprobs(config):
    from grpo_lab.loss.fused_module import GRPOLabFusedLinearGRPOLoss

    torch.manual_seed(1)
    b, t, hdim, v = 3, 12, 16, 97
    hidden = torch.randn(b, t, hdim, dtype=torch.float64)
    weight = torch.randn(v, hdim, dtype=torch.float64) * 0.5
    ids = torch.randint(0, v, (b, t))
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 8:] = 0
    mask[2, 3:] = 0
    adv = torch.randn(b, dtype=torch.float64)
    old = torch.randn(b, t, dtype=torch.float64) * 0.1 - 4.0
    ref = torch.randn(b, t, dtype=torch.float64) * 0.1 - 4.0
    is_ratio = torch.rand(b, 1, dtype=torch.float64) + 0.5
    kwargs = dict(old_per_token_logps=old, ref_per_token_logps=ref if config.beta else None)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    module = GRPOLabFusedLinearGRPOLoss(config)
    loss, metrics = module(h1, w1, ids, mask, adv, vllm_is_ratio=is_ratio, **kwargs)
    loss.backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, *_ = naive_logprobs(h2.reshape(-1, hdim), w2, None, ids.reshape(-1), config.temperature, None, None,
                                 1.0, ("entropy",))
    keep = mask.reshape(-1).to(lp.dtype)
    lp, ent = (lp * keep).view(b, t), (ent * keep).view(b, t)
    if not config.entropy_coef:
        ent = ent.detach()
    out = grpo_loss(lp.float(), mask.float(), adv.float(), config, old_per_token_logps=old.float(),
                    ref_per_token_logps=None if not config.beta else ref.float(), entropies=ent.float(),
                    importance_sampling_ratio=is_ratio.float(), num_items_in_batch=mask.sum())
    out.loss.backward()
    torch.testing.assert_close(loss.double(), out.loss.double(), rtol=1e-5, atol=1e-6)
    assert metrics.keys() == out.metrics.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(out.metrics[key], rel=1e-4, abs=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)


def test_fused_module_checks_shapes():
    from grpo_lab.loss.fused_module import GRPOLabFusedLinearGRPOLoss

    module = GRPOLabFusedLinearGRPOLoss()
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        module(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), torch.ones(4), torch.ones(1))
    with pytest.raises(ValueError, match="selected_token_ids"):
        module(torch.randn(2, 3, 8), torch.randn(10, 8), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3),
               torch.ones(2))


@pytest.mark.parametrize("backend", ["trl", "naive", "grpo_lab"])
def test_fused_module_runs_on_every_logprob_backend(backend):
    """The module offers the other backends for side-by-side comparisons: each gives the same loss."""
    from grpo_lab.loss.fused_module import GRPOLabFusedLinearGRPOLoss

    torch.manual_seed(2)
    hidden, weight = torch.randn(2, 5, 16), torch.randn(33, 16) * 0.5
    ids, mask, adv = torch.randint(0, 33, (2, 5)), torch.ones(2, 5), torch.tensor([0.5, -1.0])
    old = torch.randn(2, 5) * 0.1 - 3.0
    ref_loss, _ = GRPOLabFusedLinearGRPOLoss(backend="naive")(hidden, weight, ids, mask, adv, old_per_token_logps=old)
    loss, _ = GRPOLabFusedLinearGRPOLoss(backend=backend)(hidden, weight, ids, mask, adv, old_per_token_logps=old)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


def test_an_entropy_bonus_without_entropies_is_a_clear_error():
    from grpo_lab.loss.fused_module import GRPOLabFusedLinearGRPOLoss

    logps, mask, adv = torch.randn(2, 4), torch.ones(2, 4), torch.ones(2)
    with pytest.raises(ValueError, match="need entropies"):
        grpo_loss(logps, mask, adv, GRPOLossConfig(), entropy_coef=0.1)
    module = GRPOLabFusedLinearGRPOLoss(compute_entropy=False)
    with pytest.raises(ValueError, match="need entropies"):
        module(torch.randn(2, 4, 8), torch.randn(10, 8), torch.zeros(2, 4, dtype=torch.long), mask, adv,
               entropy_coef=0.1)


def test_every_kernel_variable_is_read_in_one_place():
    """`KernelTuning.from_env` reads the 15 GRPO_LAB_* variables of the kernel (through `grpo_lab.lab.environment`,
    the one reader of the environment); unset, they leave the defaults. No module of the loss stack reads it."""
    from dataclasses import fields
    from pathlib import Path

    import grpo_lab.loss
    from grpo_lab.loss.kernel.tuning import KernelTuning

    root = Path(grpo_lab.loss.__file__).parent
    readers = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "os.environ" in p.read_text()]
    assert readers == []

    assert KernelTuning.from_env({}) == KernelTuning()
    env = {"GRPO_LAB_TMA": "0", "GRPO_LAB_FP32_MM": "cublas", "GRPO_LAB_FP32_MM_SLICE": "512", "GRPO_LAB_FP32_DOT": "ieee",
           "GRPO_LAB_BWD_TOKENS": "4096", "GRPO_LAB_BWD_VOCAB": "2048", "GRPO_LAB_PERSISTENT": "bwd_32",
           "GRPO_LAB_DZ_TMA": "1", "GRPO_LAB_P_TMA": "0", "GRPO_LAB_FROZEN": "recompute",
           "GRPO_LAB_FROZEN_RECOMPUTE_BELOW": "7", "GRPO_LAB_MATERIALIZE_GIB": "2.5", "GRPO_LAB_REF_STATS": "0",
           "GRPO_LAB_MATERIALIZE_FRACTION": "0.25", "GRPO_LAB_MATERIALIZE_FLAT_BELOW": "9",
           "GRPO_LAB_REF_STATS_PLAIN": "1", "GRPO_LAB_MATERIALIZE_WITHIN_PEAK": "0", "GRPO_LAB_LEAN_EPILOGUE": "0"}
    default, tuned = KernelTuning(), KernelTuning.from_env(env)
    changed = {f.name for f in fields(KernelTuning) if getattr(tuned, f.name) != getattr(default, f.name)}
    assert changed == {"use_tma", "fp32_mm", "fp32_mm_slice", "fp32_dot", "bwd_tile", "persistent", "dz_tma", "p_tma", "frozen_two_gemm",
                       "frozen_recompute_below", "materialize_fraction", "materialize_flat_below", "materialize_gib",
                       "materialize_within_peak", "ref_stats",
                       "ref_stats_plain", "fast_exp", "target_zero_pass", "target_logit_from_ref"}
    assert tuned.bwd_tile == {"16": (4096, 2048), "32": (4096, 2048)}
    assert tuned.persistent == {"fwd_16": False, "bwd_16": False, "fwd_32": False, "bwd_32": True}
    assert tuned.frozen_recompute_below == {"16": 7, "32": 0} and tuned.materialize_gib == 2.5
    assert tuned.materialize_fraction == 0.25 and tuned.materialize_flat_below == {"16": 9, "32": 0}
    assert tuned.dz_tma == tuned.ref_stats_plain == {"16": True, "32": True}
    assert tuned.p_tma == tuned.ref_stats == {"16": False, "32": False}
    assert not (tuned.fast_exp or tuned.target_zero_pass or tuned.target_logit_from_ref)  # LEAN_EPILOGUE=0
    assert tuned.fp32_mm_slice == 512
    with pytest.raises(ValueError, match="LEAN_EPILOGUE"):
        KernelTuning.from_env({"GRPO_LAB_LEAN_EPILOGUE": "off"})
    with pytest.raises(ValueError, match="FP32_MM="):
        KernelTuning.from_env({"GRPO_LAB_FP32_MM": "cutlass"})
    with pytest.raises(ValueError, match="FP32_MM_SLICE"):
        KernelTuning.from_env({"GRPO_LAB_FP32_MM_SLICE": "0"})
