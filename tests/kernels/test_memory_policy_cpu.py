"""The trainable head's memory policy on a CPU: the decision as a function of bytes needed, bytes free, the
fraction and the room under the run's peak; the path `launch.choose_path` takes from it (free memory and the
allocator's high-water mark faked); the off switches; and the path counts.
`tests/kernels/test_fused_kernel_gpu.py` checks on the GPU that a head short of memory keeps the flat path's peak."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.loss.kernel import path_counts, reset_path_counts
from grpo_lab.loss.kernel.policy import SPARE_BYTES, materialize_decision
from grpo_lab.loss.kernel.tuning import KernelTuning

GiB = 2**30


@pytest.mark.parametrize("need,free,fraction,allowance,expected", [
    (10 * GiB, 40 * GiB, 0.5, None, True),      # a quarter of the free memory: kept
    (20 * GiB, 40 * GiB, 0.5, None, True),      # exactly the budget
    (20 * GiB + 1, 40 * GiB, 0.5, None, False),  # one byte over it: flat
    (10 * GiB, 40 * GiB, 0.0, None, False),     # fraction 0: always flat
    (1, 40 * GiB, 0.0, None, False),
    (3 * GiB, 4 * GiB, 1.0, None, False),       # within the fraction, but 2 GiB must stay free
    (2 * GiB, 4 * GiB, 1.0, None, True),
    (30 * GiB, 40 * GiB, 0.5, 32 * GiB, True),   # an explicit allowance replaces the fraction
    (33 * GiB, 40 * GiB, 0.5, 32 * GiB, False),
    (39 * GiB, 40 * GiB, 0.5, 48 * GiB, False),  # ... and still leaves 2 GiB free
    (1, 40 * GiB, 0.5, 0, False),                # allowance 0: always flat
    (0, 40 * GiB, 0.5, None, False),             # nothing to keep (no valid rows)
])
def test_the_decision_is_a_function_of_need_free_and_fraction(need, free, fraction, allowance, expected):
    assert materialize_decision(need, free, fraction, allowance) is expected


@pytest.mark.parametrize("need,backward,room,expected", [
    (10 * GiB, GiB, 11 * GiB, True),       # the buffer and the backward's outputs fit under the peak
    (10 * GiB, GiB, 11 * GiB - 1, False),  # one byte over: keeping it would raise the run's peak
    (10 * GiB, 0, 0, False),               # right after a reset of the peak (the first step): flat
    (10 * GiB, GiB, None, True),           # no peak rule: the fraction of the free memory alone
])
def test_the_buffer_must_fit_under_the_runs_peak(need, backward, room, expected):
    assert materialize_decision(need, 40 * GiB, 0.5, room_below_peak=room, backward_bytes=backward) is expected
    # an explicit allowance is the user's choice to spend memory: the peak does not bind it
    assert materialize_decision(need, 40 * GiB, 0.5, 32 * GiB, room_below_peak=room, backward_bytes=backward)


def test_the_decision_at_the_memory_limit():
    """A batch at the limit: whatever the buffer's size, less than twice it free means flat (fraction 0.5)."""
    for need in (GiB, 9 * GiB, 37 * GiB):
        assert not materialize_decision(need, 2 * need - 1, 0.5)
        assert materialize_decision(need, max(2 * need, need + SPARE_BYTES), 0.5)


def test_the_policy_variables():
    """On by default (half of the free memory, under the run's peak); `GRPO_LAB_MATERIALIZE_FRACTION=0` and
    `GRPO_LAB_MATERIALIZE_GIB=0` turn it off, a positive `GRPO_LAB_MATERIALIZE_GIB` is an explicit allowance,
    `GRPO_LAB_MATERIALIZE_WITHIN_PEAK=0` lets the free memory alone decide; a fraction outside [0, 1] is an error."""
    default = KernelTuning.from_env({})
    assert default.materialize_fraction == 0.5 and default.materialize_gib is None
    assert default.materialize_within_peak is True
    assert KernelTuning.from_env({"GRPO_LAB_MATERIALIZE_WITHIN_PEAK": "0"}).materialize_within_peak is False
    with pytest.raises(ValueError, match="MATERIALIZE_WITHIN_PEAK"):
        KernelTuning.from_env({"GRPO_LAB_MATERIALIZE_WITHIN_PEAK": "yes"})  # not silently off
    assert KernelTuning.from_env({"GRPO_LAB_MATERIALIZE_FRACTION": "0"}).materialize_fraction == 0.0
    assert KernelTuning.from_env({"GRPO_LAB_MATERIALIZE_GIB": "0"}).materialize_gib == 0.0
    assert KernelTuning.from_env({"GRPO_LAB_MATERIALIZE_GIB": "48"}).materialize_gib == 48.0
    with pytest.raises(ValueError, match="MATERIALIZE_FRACTION"):
        KernelTuning.from_env({"GRPO_LAB_MATERIALIZE_FRACTION": "1.5"})


class FakeBytes:
    """Stands in for `launch.free_device_bytes` or `launch.room_below_peak`: returns `bytes`, counts the calls."""

    def __init__(self, free_bytes):
        self.bytes, self.calls = free_bytes, 0

    def __call__(self, device):
        self.calls += 1
        return self.bytes


@pytest.fixture
def launch(monkeypatch):
    """`launch` with the free memory and the room under the run's peak faked (`launch.free_device_bytes.bytes`,
    `launch.room_below_peak.bytes`: ample unless a test lowers it), the policy at its defaults, the counts reset."""
    pytest.importorskip("triton", reason="Triton is a dependency on Linux only")
    from grpo_lab.loss.kernel import launch as module

    monkeypatch.setattr(module, "free_device_bytes", FakeBytes(80 * GiB))
    monkeypatch.setattr(module, "room_below_peak", FakeBytes(10**6 * GiB))
    monkeypatch.setattr(module.TUNING, "materialize_within_peak", True)
    monkeypatch.setattr(module.TUNING, "materialize_fraction", 0.5)
    monkeypatch.setattr(module.TUNING, "materialize_gib", None)
    monkeypatch.setattr(module.TUNING, "materialize_flat_below", {"16": 2**22, "32": 0})
    reset_path_counts()
    yield module
    reset_path_counts()


CUDA = torch.device("cuda")  # a device object only: nothing runs on it
V = 151936


def choose(launch, rows, dtype=torch.bfloat16, mode="trainable", softcap=None):
    return launch.choose_path(mode, dtype, softcap, rows, V, CUDA, 1024)


def test_the_path_follows_the_free_memory(launch):
    """32k rows × V in bf16 = 9.3 GiB: kept with 80 GiB free, flat with 16 GiB free (the budget is 8)."""
    assert choose(launch, 32768) == "materialized"
    launch.free_device_bytes.bytes = 16 * GiB
    assert choose(launch, 32768) == "recompute"
    assert choose(launch, 32768, torch.float32) == "recompute"  # fp32: twice the bytes
    launch.free_device_bytes.bytes = 40 * GiB
    assert choose(launch, 32768, torch.float32) == "materialized"
    assert path_counts().materialized == 2 and path_counts().recompute == 2
    assert path_counts().flat_for_memory == 2


def test_forcing_the_flat_path_keeps_the_flat_path(launch, monkeypatch):
    """Fraction 0, or an allowance of 0 GiB: always the flat path, whatever is free, without asking the driver."""
    launch.free_device_bytes.bytes = 10**6 * GiB
    monkeypatch.setattr(launch.TUNING, "materialize_fraction", 0.0)
    assert [choose(launch, n) for n in (2048, 32768, 65536)] == ["recompute"] * 3
    monkeypatch.setattr(launch.TUNING, "materialize_fraction", 0.5)
    monkeypatch.setattr(launch.TUNING, "materialize_gib", 0.0)
    assert [choose(launch, n) for n in (2048, 32768, 65536)] == ["recompute"] * 3
    assert launch.free_device_bytes.calls == 0
    counts = path_counts()
    assert counts.recompute == 6 and counts.materialized == 0 and counts.flat_for_memory == 0  # off, not short


def test_frozen_softcap_fp16_and_inference_heads_never_keep_the_buffer(launch):
    launch.free_device_bytes.bytes = 10**6 * GiB
    assert choose(launch, 32768, mode="frozen") == "frozen"
    assert choose(launch, 32768, softcap=30.0) == "recompute"
    assert choose(launch, 32768, torch.float16) == "recompute"
    assert choose(launch, 32768, mode="inference") == "stats"
    counts = path_counts()
    assert (counts.frozen, counts.recompute, counts.stats, counts.materialized, counts.flat_for_memory) == (
        1, 2, 1, 0, 0)


def test_small_16_bit_heads_stay_flat_unless_the_user_allows_memory(launch, monkeypatch):
    """Below `materialize_flat_below` rows × hidden (16-bit) the step is host-bound and the flat path is as fast:
    flat whatever is free, and not counted as short of memory. fp32 has no such rule; an explicit allowance overrides
    it."""
    assert choose(launch, 2048) == "recompute"            # 2048 × 1024 < 2^22
    assert choose(launch, 4096) == "materialized"         # = 2^22
    assert choose(launch, 2048, torch.float32) == "materialized"
    monkeypatch.setattr(launch.TUNING, "materialize_gib", 48.0)
    assert choose(launch, 2048) == "materialized"
    assert path_counts().flat_for_memory == 0


def test_the_buffer_is_kept_only_where_the_runs_peak_has_room(launch, monkeypatch):
    """The head runs at the top of the step's activation peak: with 80 GiB free but no room under the run's
    high-water mark (the first step, or a step whose peak is the head itself) the 9.3 GiB buffer of 32k rows stays
    flat, counted as short of memory; with room for it and the backward's dX (fp32), X scaled per row and dW it is
    kept. An explicit allowance, or the rule turned off, does not ask."""
    need = 32768 * V * 2
    backward = 32768 * 1024 * (4 + 2) + V * 1024 * 2
    weight_bytes = V * 1024 * 2
    launch.room_below_peak.bytes = 0
    assert launch.choose_path("trainable", torch.bfloat16, None, 32768, V, CUDA, 1024, weight_bytes) == "recompute"
    launch.room_below_peak.bytes = need + backward - 1
    assert launch.choose_path("trainable", torch.bfloat16, None, 32768, V, CUDA, 1024, weight_bytes) == "recompute"
    launch.room_below_peak.bytes = need + backward
    assert launch.choose_path("trainable", torch.bfloat16, None, 32768, V, CUDA, 1024, weight_bytes) == "materialized"
    assert path_counts().flat_for_memory == 2
    asked = launch.room_below_peak.calls
    launch.room_below_peak.bytes = 0
    monkeypatch.setattr(launch.TUNING, "materialize_gib", 48.0)
    assert choose(launch, 32768) == "materialized"
    monkeypatch.setattr(launch.TUNING, "materialize_gib", None)
    monkeypatch.setattr(launch.TUNING, "materialize_within_peak", False)
    assert choose(launch, 32768) == "materialized"
    assert launch.room_below_peak.calls == asked
