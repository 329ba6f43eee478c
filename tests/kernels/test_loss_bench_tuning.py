"""The plumbing of benchmarks/loss_bench.py: tuning knobs, the grid harness and its report (the timings themselves only
mean something on a GPU)."""

import copy
import dataclasses
import os

import pytest

pytest.importorskip("triton", reason="Triton is a dependency on Linux only")

from benchmark_scripts import BENCHMARKS, load_benchmark  # noqa: E402
from grpo_lab.loss.kernel.tuning import TUNING as T  # noqa: E402


@pytest.fixture
def bench(monkeypatch):
    module = load_benchmark("loss_bench")
    for f in dataclasses.fields(T):  # experiments change the kernel's tuning: each test gets it back as it was
        monkeypatch.setattr(T, f.name, copy.deepcopy(getattr(T, f.name)))
    return module


def test_a_bf16_experiment_leaves_the_fp32_settings_alone(bench):
    before = {name: dict(getattr(T, name)) for name in ("persistent", "bwd_tile", "dz_tma")}
    bench.apply_experiment(T, {"dz_tma": True, "bwd_tile": (4096, 4096), "persistent": False,
                               "cfg": (64, 64, 32, 8, 4, 2)}, "bf16")
    assert T.dz_tma == {**before["dz_tma"], "16": True}
    assert T.bwd_tile == {**before["bwd_tile"], "16": (4096, 4096)}
    assert T.persistent == {**before["persistent"], "fwd_16": False, "bwd_16": False}
    assert T.configs["fwd_16"] == T.configs["bwd_16"] == (64, 64, 32, 8, 4, 2)
    assert T.configs["fwd_32"] != (64, 64, 32, 8, 4, 2)


def test_frozen_head_knobs_set_only_the_frozen_forward_of_their_dtype(bench):
    before = {"fwd_16": T.configs["fwd_16"], "frozen_32": T.configs["frozen_32"], "p_tma": dict(T.p_tma)}
    bench.apply_experiment(T, {"frozen_cfg": (128, 128, 64, 8, 4, 4), "p_tma": True}, "bf16")
    assert T.configs["frozen_16"] == (128, 128, 64, 8, 4, 4)
    assert T.configs["fwd_16"] == before["fwd_16"] and T.configs["frozen_32"] == before["frozen_32"]
    assert T.p_tma == {**before["p_tma"], "16": True}
    assert "P~ descriptor store 16" in bench.kernel_setting(T)


def test_per_kernel_knobs_set_programs_and_compile_options_of_the_named_kernels_only(bench):
    bench.apply_experiment(T, {"programs_per_sm": {"frozen": 2}, "launch": {"frozen": {"maxnreg": 128}},
                               "frozen_cfg": (128, 128, 64, 8, 8, 2)}, "bf16")
    assert T.programs_per_sm == {**dict.fromkeys(T.configs, 1), "frozen_16": 2}
    assert T.launch_options["frozen_16"] == {"maxnreg": 128} and T.launch_options["bwd_16"] == {}
    assert bench.frozen_only({"programs_per_sm": {"frozen": 2}, "frozen_cfg": (128, 128, 64, 8, 8, 2)})
    assert not bench.frozen_only({"programs_per_sm": {"frozen": 2, "bwd": 2}})
    assert not bench.frozen_only({})
    bench.apply_experiment(T, {"bwd_cfg": (128, 128, 64, 8, 4, 2)}, "fp32")
    assert T.configs["bwd_32"] == (128, 128, 64, 8, 4, 2) and T.configs["fwd_32"] != T.configs["bwd_32"]


def test_the_occupancy_column_counts_programs_per_sm_from_registers_and_shared_memory(bench, monkeypatch):
    from types import SimpleNamespace

    def compiled(regs):  # what Triton's compiled kernel reports
        return SimpleNamespace(n_regs=regs, n_spills=0, metadata=SimpleNamespace(shared=98304))
    last_compiled = {"frozen_16": compiled(128)}
    monkeypatch.setitem(T.configs, "frozen_16", (128, 128, 64, 8, 8, 2))
    assert bench.compiled_summary(T, last_compiled, "frozen", "bf16") == \
        "frozen: 128 regs, 0 spills, 98304 B smem, 2/SM"
    last_compiled["frozen_16"] = compiled(168)  # registers allow only one
    assert bench.compiled_summary(T, last_compiled, "frozen", "bf16").endswith("1/SM")
    assert bench.compiled_summary(T, last_compiled, "trainable", "bf16") == ""  # nothing launched for it


def test_every_committed_sweep_file_applies(bench):
    import glob
    import json

    paths = glob.glob(str(BENCHMARKS / "tune_*.json"))
    assert paths
    for path in paths:
        with open(path) as f:
            for dname, experiments in json.load(f).items():
                for exp in experiments:
                    bench.apply_experiment(T, {k: tuple(v) if isinstance(v, list) else v for k, v in exp.items()},
                                           dname)


def test_unknown_and_cross_dtype_knobs_are_refused(bench):
    with pytest.raises(ValueError, match="unknown tuning knob 'BWD_TOKENS'"):
        bench.apply_experiment(T, {"BWD_TOKENS": 16384}, "bf16")
    with pytest.raises(ValueError, match="fp32 knob"):
        bench.apply_experiment(T, {"FP32_MM": "triton"}, "bf16")


def test_every_listed_experiment_applies(bench):
    for dname, experiments in bench.TUNE_EXPERIMENTS.items():
        for exp in experiments:
            bench.apply_experiment(T, exp, dname)


def test_the_setting_column_names_the_knobs_in_force(bench):
    text = bench.kernel_setting(T)
    assert "persistent fwd_16,bwd_16" in text and "dZ tile 16:16384x8192 32:4096x8192" in text
    bench.apply_experiment(T, {"persistent": True}, "fp32")
    assert "persistent fwd_16,bwd_16,fwd_32,bwd_32" in bench.kernel_setting(T)


def test_smoke_run_on_cpu_writes_the_long_format_csv_and_the_report(bench, tmp_path):
    """The whole harness end to end on the chunked torch path with a tiny head: every backend × head mode × point
    gets a row carrying the versions and date, and the report renders tables and the figure from the CSV."""
    import csv

    args = ["--device", "cpu", "--vocab", "300", "--hidden", "32,48", "--tokens", "1024", "--dtypes", "fp32", "--fp32-full",
            "--accuracy-hidden", "32", "--accuracy-tokens", "1024",
            "--backends", "naive,trl,grpo_lab,grpo_lab+flat", "--no-issue-rows", "--budget-s", "0.01",
            "--out", str(tmp_path)]
    assert bench.main(args) == 0
    with open(tmp_path / "loss_grid.csv") as f:
        rows = list(csv.DictReader(f))
    # grpo_lab+flat only where it changes the path (a trainable head): 2 H × (3 frozen + 4 trainable)
    assert len(rows) == 14 and {r["status"] for r in rows} == {"ok"}
    assert {(r["backend"], r["head"]) for r in rows if r["backend"] == "grpo_lab+flat"} == {("grpo_lab+flat",
                                                                                             "trainable")}
    for key in ("gpu", "torch", "triton", "trl", "liger", "date", "ms", "loss_peak_gib", "tokens", "H", "V",
                "floor_ms", "floor_ratio", "ms_min", "ms_max"):
        assert all(r[key] != "" for r in rows), key
    # the floor is the GEMMs of the shape: 2 for a frozen head, 3 for a trainable one, the same inputs' GEMMs
    for r in rows:
        gemms = [float(r[k]) for k in ("gemm_logits", "gemm_dx", "gemm_dw")]
        assert all(g > 0 for g in gemms)
        expect = sum(gemms[:2]) if r["head"] == "frozen" else sum(gemms)
        assert r["floor_gemms"] == ("2" if r["head"] == "frozen" else "3")
        assert abs(float(r["floor_ms"]) - expect) <= 1e-3 * expect + 1e-4
        assert abs(float(r["floor_ratio"]) - float(r["ms"]) / float(r["floor_ms"])) <= 1e-3 * float(r["floor_ratio"]) + 1e-4
        assert float(r["ms_min"]) <= float(r["ms"]) <= float(r["ms_max"])
    with open(tmp_path / "loss_accuracy.csv") as f:
        acc = list(csv.DictReader(f))
    assert acc and all(float(r["err_logprobs"]) < 1e-5 and float(r["err_dX"]) < 1e-4 for r in acc)
    text = bench.report(str(tmp_path))
    assert "| fp32 frozen: H \\ tokens | 1k |" in text and "Worst grpo_lab" in text
    assert "| floor ms (GEMMs) |" in text and "| frozen, fp32, H=32, 1k tokens |" in text
    assert (tmp_path / "loss_grid.png").stat().st_size > 0 and (tmp_path / "loss_grid_tables.md").exists()


def test_the_bar_table_compares_each_repeat_with_its_own_baselines(bench, tmp_path):
    """Issue 45's speed bar: grpo_lab / min(naive, trl) is taken per repeat (each against the baselines measured in
    the same repeat), the worst repeat is named, and the spread is the widest ms_max − ms_min over ms of the backends
    compared; rows without a repeat (single runs) are left out."""
    import csv

    def row(backend, repeat, ms, lo, hi, status="ok"):
        return {"backend": backend, "head": "trainable", "dtype": "bf16", "H": "4096", "V": "151936",
                "tokens": "8192", "T": "512", "ms": ms, "ms_min": lo, "ms_max": hi, "status": status,
                "repeat": repeat}
    rows = [row("naive", 0, 90, 89, 91), row("trl", 0, 60, 58, 61), row("grpo_lab", 0, 61.2, 60, 63),
            row("naive", 1, 91, 90, 92), row("trl", 1, 66, 64, 67), row("grpo_lab", 1, 63, 62, 63.5),
            row("grpo_lab+free", 1, 40, 10, 90),  # not compared: its spread must not count
            row("naive", "", 1, 1, 1)]  # a single run's row: no repeat, left out
    with open(tmp_path / "loss_grid.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = bench.bar_table(str(tmp_path))
    cell = next(line for line in lines if line.startswith("| trainable, bf16, H=4096, 8k"))
    # repeat 0: 61.2 / 60 = 1.020; repeat 1: 63 / 66 = 0.955; spread: trl's first (61 − 58) / 60 = 5.0 %
    assert cell == "| trainable, bf16, H=4096, 8k | 2 | 0.955 | 1.020 | 5.0% |"
    assert lines[-1] == "Worst cell: 1.020 at trainable, bf16, H=4096, 8k tokens."


def test_the_policy_backends_set_and_restore_their_fields(bench, monkeypatch):
    """`grpo_lab+flat` turns the policy off, `grpo_lab+free` its peak rule, `grpo_lab+mem` sets an allowance, each
    only for the duration; `grpo_lab` runs the defaults."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    before = (T.materialize_fraction, T.materialize_within_peak, T.materialize_gib)
    with bench.backend_settings("grpo_lab+free"):
        assert T.materialize_within_peak is False and T.materialize_fraction == before[0]
    with bench.backend_settings("grpo_lab+flat"):
        assert T.materialize_fraction == 0.0 and T.materialize_gib is None
    with bench.backend_settings("grpo_lab+mem"):
        assert T.materialize_gib == 48.0
    with bench.backend_settings("grpo_lab"):
        assert (T.materialize_fraction, T.materialize_within_peak, T.materialize_gib) == before
    assert (T.materialize_fraction, T.materialize_within_peak, T.materialize_gib) == before


def test_mainloop_probe_refuses_bad_input_in_one_line_and_needs_a_gpu():
    """benchmarks/mainloop_probe.py: a malformed tile or hidden size is an argparse error (exit 2, no traceback); on a
    machine without CUDA it says so and exits 2 instead of failing inside Triton."""
    import subprocess
    import sys

    script = str(BENCHMARKS / "mainloop_probe.py")
    for bad in (["--configs", "128x256x64"], ["--configs", "128xAx64x8x3"], ["--hidden", "0"], ["--tokens", "-1"]):
        proc = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (bad, proc.stderr)
        assert "error" in proc.stderr.splitlines()[-1]
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the same answer on a machine that has one
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=no_gpu)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
