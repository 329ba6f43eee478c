"""The plumbing of benchmarks/small_head_probe.py: its KernelTuning overrides apply and come back, and its
diagnostic stand-in for the rows check keeps the signature of the method it replaces (a stand-in that drifts fails
every step of its variant, which the probe then drops from the run)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("triton")

from benchmark_scripts import load_benchmark  # noqa: E402

from grpo_lab.loss.kernel import launch  # noqa: E402
from grpo_lab.loss.kernel.tuning import TUNING  # noqa: E402


def test_overrides_apply_as_tuples_and_are_restored():
    probe = load_benchmark("small_head_probe")
    before = dict(TUNING.frozen_tile)
    with probe.tuned({"frozen_tile": {"16": [8192, 8448]}, "fast_exp": False}):
        assert TUNING.frozen_tile["16"] == (8192, 8448)
        assert TUNING.frozen_tile["32"] == before["32"]
        assert TUNING.fast_exp is False
    assert TUNING.frozen_tile == before
    assert TUNING.fast_exp is True


def test_no_rescue_stand_in_matches_resolve_and_is_restored():
    probe = load_benchmark("small_head_probe")
    real = launch.PendingRescue.resolve
    with probe.tuned({"_no_rescue": True}):
        stand_in = launch.PendingRescue.resolve
        assert stand_in is not real
        assert list(inspect.signature(stand_in).parameters) == list(inspect.signature(real).parameters)
        assert stand_in(object(), lambda: None) == 0
    assert launch.PendingRescue.resolve is real
