"""benchmarks/step_timeline.py's reading of a profiler timeline: which idle gaps it finds and what it blames them on
(the timings themselves only mean something on a GPU; the parsing is checked here on a hand-made trace)."""

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def tool():
    return load_benchmark("step_timeline")


def _x(name, cat, ts, dur, tid=1, corr=None):
    e = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace(tool):
    return [
        _x(tool.STEP_LABEL, "user_annotation", 0, 100),
        _x("prologue", "cpu_op", 0, 9),
        _x("cudaLaunchKernel", "cuda_runtime", 8, 1, corr=1),
        _x("fwd_kernel", "kernel", 10, 20, tid=7, corr=1),           # 10 us of start
        _x("cudaLaunchKernel", "cuda_runtime", 12, 1, corr=2),
        _x("gemm", "kernel", 33, 10, tid=7, corr=2),                 # launched early: 3 us device gap
        _x("resolve", "cpu_op", 14, 46),
        _x("cudaEventSynchronize", "cuda_runtime", 15, 29),          # returns at 44, after gemm ends at 43
        _x("cuLaunchKernel", "cuda_driver", 50, 1, corr=3),
        _x("frozen_dx_kernel", "kernel", 53, 5, tid=7, corr=3),      # 10 us: the host sat in the sync
        _x("aten::add", "cpu_op", 62, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 70, 1, corr=4),
        _x("add_kernel", "kernel", 72, 1, tid=7, corr=4),            # 14 us: the host was late, in aten::add
        _x("cudaLaunchKernel", "cuda_runtime", 73, 1, corr=5),
        _x("tiny", "kernel", 74, 1, tid=7, corr=5),                  # a 1 us gap: under the threshold
    ]


def test_gaps_are_found_and_put_down_to_their_cause(tool):
    tl = tool.timeline(_trace(tool))
    assert tl["kernels"] == 5
    assert tl["busy_us"] == pytest.approx(20 + 10 + 5 + 1 + 1)
    assert tl["idle_us"] == pytest.approx(10 + 3 + 10 + 14 + 1)
    assert dict(tl["by_cause"]) == pytest.approx({"start": 10, "device": 3, "sync": 10, "host": 14})
    assert [g["cause"] for g in tl["gaps"]] == ["host", "start", "sync", "device"]  # largest first
    assert tl["gaps"][0]["where"] == "aten::add" and tl["gaps"][0]["after"] == "add_kernel"
    assert tl["by_host_op"]["resolve (cudaEventSynchronize)"] == pytest.approx(10)


def test_only_the_annotated_step_counts(tool):
    before = [_x("cudaLaunchKernel", "cuda_runtime", -50, 1, corr=9), _x("warmup", "kernel", -40, 30, tid=7, corr=9)]
    tl = tool.timeline(before + _trace(tool))
    assert tl["kernels"] == 5 and tl["busy_us"] == pytest.approx(37)


def test_a_trace_without_gpu_work_reports_nothing_idle(tool):
    tl = tool.timeline([_x(tool.STEP_LABEL, "user_annotation", 0, 10), _x("aten::mm", "cpu_op", 1, 5)])
    assert tl["kernels"] == 0 and tl["idle_us"] == 0 and not tl["gaps"]


def test_host_profile_lists_the_hosts_functions_per_step(tool, capsys):
    """A CPU smoke run (the chunked CPU path): the host's time is split by function, per step."""
    assert tool.main(["--device", "cpu", "--vocab", "512", "--points", "frozen:fp32:64:256:64", "--backends",
                      "grpo_lab", "--reps", "2", "--top", "2", "--host-profile"]) == 0
    out = capsys.readouterr().out
    assert "host per step:" in out
    fns = [line for line in out.splitlines() if "host fn" in line]
    assert len(fns) == 6 and all("/step" in line for line in fns)
