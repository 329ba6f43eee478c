"""The Triton kernels themselves (not the torch path) on a CPU, through Triton's interpreter.

This checks the kernels' logic: tile indexing, the online-LSE merge over vocabulary launches, the dZ epilogue with
bias / softcap / temperature, masked rows, the vocabulary-outer backward over several dZ tiles, the persistent loop
and the tensor-descriptor loads and stores. It cannot check the compiled code's numerics or speed: the GPU tests
(`pytest -m gpu`) and `benchmarks/loss_bench.py` do that on the H200.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is a dependency on Linux only")

CASE = os.path.join(os.path.dirname(__file__), "interpreter_case.py")
ROW_KERNELS = os.path.join(os.path.dirname(__file__), "interpreter_row_kernels.py")


@pytest.mark.parametrize("tma,persistent,dz_tma,fp32_mm", [
    (False, False, False, "cublas"), (True, False, False, "triton"), (False, True, False, "triton"),
    (True, True, True, "triton")])
def test_kernels_match_float64_in_the_interpreter(tma, persistent, dz_tma, fp32_mm):
    variant = {"tma": tma, "persistent": persistent, "dz_tma": dz_tma, "fp32_mm": fp32_mm}
    proc = subprocess.run([sys.executable, CASE, json.dumps(variant)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("logprobs", "entropy", "grad_hidden", "grad_weight", "grad_bias"):
        assert err[key] < 1e-5, (key, err)
    assert err["log_sum_sq_probs"] < 1e-4, err
    assert err["mean_logits"] < 1e-4, err
    assert err["is_top1_agree"] == 1.0, err
    assert err["masked_zero"] and err["masked_grad_zero"], err
    # 56 valid rows in dZ tiles of 48 x 256 over a vocabulary of 700: 2 x 3 backward launches, and one forward launch
    # (the statistics budget holds all 11 vocabulary blocks); each took the path its flags ask for
    assert err["backward_launches"] == 6 and err["launches"] == 7, err
    assert err["persistent_launches"] == (7 if persistent else 0), err
    assert err["tma_launches"] == (7 if tma else 0), err
    assert err["dz_descriptor_launches"] == (6 if dz_tma else 0), err
    # split-TF32 dX and dW: 96-column slices of the dZ tiles (256, 256, 188 columns: 3 + 3 + 2), both token tiles
    split = 2 * (3 + 3 + 2) * 2 if fp32_mm == "triton" else 0
    assert err["split_tf32_launches"] == ([split, 0] if tma else [0, split]), err


# (variant, forward + backward fused-kernel launches): 56 valid rows in [48 tokens × 256 vocabulary] P~ / dZ tiles
# over a vocabulary of 700 -> 2 x 3 launches each way; a rescue (tiny headroom) relaunches the rows it recomputes.
PATH_CASES = [
    # frozen head, entropy gradient expected: forward only (6 launches), the backward is elementwise
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True}, 6),
    # the same with P~ and P~·(z − ref) stored through tensor descriptors
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "p_tma": True}, 6),
    # frozen head, an entropy gradient the forward did not prepare for (the backward recomputes: 6 more), and every
    # row recomputed against its exact max (6 more)
    ({"tma": False, "persistent": False, "dz_tma": False, "path": "frozen", "headroom": 0.5}, 18),
    # trainable head with memory allowed: one forward launch keeps every probability, one more for the rescued rows
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "headroom": 0.5}, 2),
    # rows whose target sits hundreds of nats below the max: e^(z − ref) overflows fp32, so their statistics and P~
    # come from one more launch against the exact max (the 8 such rows fit one widened vocabulary tile)
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "softcap": None,
      "extreme_rows": True}, 7),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True}, 2),
    # targets ~50 nats below the max: e^(z − ref) fits, but Σ e^(2(z − ref)) for log Σp² does not (`sq_ref_headroom`)
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "softcap": None,
      "extreme_rows": True, "target_gap": 50.0}, 7),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "target_gap": 50.0}, 2),
    # the trainable head's statistics-only forward against ref (`ref_stats_plain`): one launch, one for the 8 rescued
    # rows, then the 6 dZ launches of the recomputing backward
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "recompute", "softcap": None, "extreme_rows": True,
      "ref_stats_plain": True}, 8),
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "recompute", "softcap": None, "extreme_rows": True,
      "target_gap": 50.0, "ref_stats_plain": True}, 8),
    # the same rows with the statistics taken against the block max (`ref_stats` off): only P~ needs the rescue
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "softcap": None,
      "extreme_rows": True, "ref_stats": False}, 7),
    # the rows check deferred to the backward (`frozen_deferred_check`): the same launches, the rescue in the backward
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "deferred": True}, 6),
    # without is_top1: the target logit from the row-wise dot, in the frozen, materialised and plain forwards (with
    # rows redone against their max, which find it in their blocks again)
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "recompute", "softcap": None, "no_top1": True}, 7),
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "softcap": None,
      "extreme_rows": True, "no_top1": True}, 7),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "target_gap": 50.0, "no_top1": True}, 2),
    # the materialised head's kept probabilities stored through descriptors
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "target_gap": 50.0, "p_tma": True}, 2),
    # no entropy gradient: the materialised backward without its elementwise pass (the kept P~ is the GEMMs'
    # operand), with rows redone against their max and targets far below it; and the elementwise pass kept
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "no_entropy_grad": True}, 1),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "no_entropy_grad": True}, 2),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "target_gap": 50.0, "no_entropy_grad": True}, 2),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "no_entropy_grad": True, "dz_free_backward": False}, 2),
    # the materialised head's rows check deferred to the backward (`materialized_deferred_check`)
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "deferred": True}, 1),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "deferred": True}, 2),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "target_gap": 50.0, "no_entropy_grad": True, "deferred": True}, 2),
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "headroom": 0.5,
      "no_entropy_grad": True, "deferred": True}, 2),
    # overflowing rows under the dZ-free backward, which runs before the check is read back and again after the repair
    ({"tma": True, "persistent": False, "dz_tma": False, "path": "materialized", "extreme_rows": True,
      "no_entropy_grad": True, "deferred": True}, 2),
    # the target column zeroed in the forward's epilogue instead of by the pass after each launch
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "deferred": True,
      "target_zero_pass": False}, 6),
    # (an entropy gradient the forward did not prepare for: the recomputing backward, so nothing is left to repair)
    ({"tma": False, "persistent": False, "dz_tma": False, "path": "frozen", "headroom": 0.5, "deferred": True}, 12),
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "headroom": 0.5,
      "deferred": True}, 12),
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "softcap": None,
      "extreme_rows": True, "deferred": True}, 7),
    ({"tma": True, "persistent": True, "dz_tma": False, "path": "frozen", "entropy_hint": True, "softcap": None,
      "extreme_rows": True, "target_gap": 50.0, "deferred": True}, 7),
]


@pytest.mark.parametrize("variant,launches", PATH_CASES,
                         ids=["frozen", "frozen-p-descriptors", "frozen-fallback-rescue", "materialized-rescue",
                              "frozen-overflow", "materialized-overflow", "frozen-sq-overflow",
                              "materialized-sq-overflow", "plain-overflow", "plain-sq-overflow",
                              "frozen-overflow-block-max-stats", "frozen-deferred", "plain-target-from-ref",
                              "frozen-overflow-target-from-ref", "materialized-overflow-target-from-ref",
                              "materialized-descriptor-stores", "materialized-dz-free",
                              "materialized-dz-free-overflow", "materialized-dz-free-gap",
                              "materialized-no-entropy-grad-elementwise",
                              "materialized-deferred", "materialized-deferred-overflow",
                              "materialized-deferred-gap-dz-free", "materialized-deferred-rescue-dz-free",
                              "materialized-deferred-overflow-dz-free",
                              "frozen-deferred-zero-in-kernel",
                              "frozen-deferred-fallback-rescue",
                              "frozen-deferred-rescue", "frozen-deferred-overflow", "frozen-deferred-sq-overflow"])
def test_frozen_and_materialized_paths_match_float64_in_the_interpreter(variant, launches):
    proc = subprocess.run([sys.executable, CASE, json.dumps(variant)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])
    assert err["path"] == [variant["path"]], err
    # logits hundreds of nats apart carry fp32 rounding of ~|z|·2^-24 ≈ 2e-5 nats into every probability
    tol = 5e-5 if variant.get("extreme_rows") else 2e-6
    for key in ("logprobs", "entropy", "log_sum_sq_probs", "grad_hidden"):
        assert err[key] < tol, (key, err)
    assert err["is_top1_agree"] == 1.0 and err["masked_zero"] and err["masked_grad_zero"], err
    if variant["path"] == "frozen":  # no weight / bias gradient is formed for a frozen head
        assert err["grad_weight"] == 0.0 and err["grad_bias"] == 0.0, err
    else:
        assert err["grad_weight"] < tol and err["grad_bias"] < tol, err
    assert err["launches"] == launches, err
    if not variant.get("p_tma"):
        assert err["p_descriptor_stores"] == 0, err
    elif variant["path"] == "frozen":  # the buffer's views are made once per (rows, chunk) shape, one or two planes
        assert 0 < err["p_descriptor_stores"] < 2 * launches, err
    else:  # the kept [N, V]: a view of its own per launch
        assert err["p_descriptor_stores"] == launches, err


def _settings_under(env: dict) -> subprocess.CompletedProcess:
    code = ("import json; from grpo_lab.loss.kernel.tuning import TUNING as T; "
            "print(json.dumps({'persistent': T.persistent, 'tile': T.bwd_tile, 'dz': T.dz_tma}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_kernel_settings_from_the_environment():
    default = json.loads(_settings_under({}).stdout)
    assert default["persistent"] == {"fwd_16": True, "bwd_16": True, "fwd_32": False, "bwd_32": False}
    assert default["tile"] == {"16": [16384, 8192], "32": [4096, 8192]}
    assert default["dz"] == {"16": True, "32": False}
    custom = json.loads(_settings_under({"GRPO_LAB_PERSISTENT": " fwd_32 , bwd_16", "GRPO_LAB_BWD_TOKENS": "2048",
                                         "GRPO_LAB_DZ_TMA": "1"}).stdout)
    assert custom["persistent"] == {"fwd_16": False, "bwd_16": True, "fwd_32": True, "bwd_32": False}
    assert custom["tile"] == {"16": [2048, 8192], "32": [2048, 8192]}
    assert custom["dz"] == {"16": True, "32": True}
    assert json.loads(_settings_under({"GRPO_LAB_PERSISTENT": ""}).stdout)["persistent"] == dict.fromkeys(
        default["persistent"], False)
    bad = _settings_under({"GRPO_LAB_PERSISTENT": "1"})
    assert bad.returncode != 0 and "GRPO_LAB_PERSISTENT='1': keys are" in bad.stderr


def test_persistent_launch_needs_a_triton_with_flattened_ranges(monkeypatch):
    import torch

    from grpo_lab.loss.kernel import launch
    from grpo_lab.loss.kernel.tuning import TUNING

    monkeypatch.setattr(TUNING, "persistent", dict.fromkeys(TUNING.persistent, True))
    monkeypatch.setattr(TUNING, "persistent_programs", 5)
    assert launch._programs("fwd", torch.bfloat16, 100, torch.device("cpu")) == (5, True)
    assert launch._programs("bwd", torch.float32, 3, torch.device("cpu")) == (3, True)
    monkeypatch.setattr(launch, "_FLATTEN_OK", False)
    assert launch._programs("fwd", torch.bfloat16, 100, torch.device("cpu")) == (100, False)


@pytest.mark.parametrize("rows,hidden,dtype,path", [
    (100, 64, "bf16", "frozen"), (2048, 1024, "bf16", "frozen"), (2048, 2048, "bf16", "frozen"),
    (3072, 1024, "bf16", "frozen"), (4096, 1024, "bf16", "frozen"),
    (2048, 4096, "bf16", "frozen"), (32768, 1024, "bf16", "frozen"),
    (2048, 1024, "fp32", "frozen"), (100, 64, "fp32", "frozen"),
    (2048, 1024, "fp16", "recompute"),  # e^60 does not fit in fp16: always the recompute path
])
def test_a_frozen_head_takes_the_path_measured_fastest_for_its_shape(rows, hidden, dtype, path):
    """A bf16 / fp32 frozen head takes the two-GEMM path at every size: with its rows check read back by the
    backward (no host sync in the forward) it was faster than recomputing down to 2048 rows (H100 probe quoted in
    `KernelTuning`); the small-head rule (`frozen_recompute_rows`) stays as a knob, off."""
    import torch

    from grpo_lab.loss.kernel.launch import choose_path

    compute = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype]
    assert choose_path("frozen", compute, None, rows, 151936, torch.device("cpu"), hidden) == path
    assert choose_path("inference", compute, None, rows, 151936, torch.device("cpu"), hidden) == "stats"


def test_the_frozen_row_kernels_match_their_torch_statement_in_the_interpreter():
    """The fused end of the frozen forward (rows check + rebase, one pass), the reference-logit dot and the dX kernel
    with its coefficients formed in the kernel, against the torch functions that state them."""
    proc = subprocess.run([sys.executable, ROW_KERNELS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = json.loads(proc.stdout.strip().splitlines()[-1])
    assert err["finish_bad_rows_1"] == [3, 5, 9] and err["finish_bad_rows_2"] == [3, 5, 9, 11], err
    for depth in (1, 2):
        assert err[f"finish_bad_agree_{depth}"], err
        assert err[f"finish_count_{depth}"][0] == err[f"finish_count_{depth}"][1], err
        assert err[f"finish_acc_{depth}"] < 1e-5, err
    assert err["ref_logit_None"] < 1e-4 and err["ref_logit_5.0"] < 1e-5, err
    for key in ("dx_1_None_True_False", "dx_2_5.0_True_True", "dx_2_None_False_True"):
        assert err[key] < 1e-6, err
