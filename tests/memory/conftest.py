"""Shared fixtures of the memory-harness tests."""

import pytest


class FakeClock:
    """Stands in for a module's `time`: `perf_counter()` returns `now`, which the fake probes advance."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def advance(self, seconds: float):
        self.now += seconds


@pytest.fixture
def fake_clock():
    return FakeClock()
