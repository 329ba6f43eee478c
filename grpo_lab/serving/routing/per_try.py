"""Per-try deadlines: how long one replica may take on a completion before the router also asks another one.

A replica can hang while still answering `/health`, so each try gets a deadline from what completions of about its
size recently cost; when it passes, the completion is *hedged* on another replica and the first answer wins. Until
`min_samples` latencies are known it is `initial_s`: a run's first completions meet empty queues and must not set off
hedges on a pool that is only filling up.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from grpo_lab.lab.settings import Range, check_fields, setting


@dataclass
class PerTryConfig:
    """When a completion still running on one replica is also sent to another.

    Args:
        enabled: hedge stuck completions at all (False: a try runs until it answers, fails or the whole deadline).
        quantile: which quantile of recent completion latencies the deadline starts from.
        factor: the deadline is that quantile times this.
        floor_s: the deadline is never shorter (short completions vary a lot in relative terms).
        cap_s: the deadline is never longer. The overall `upstream_timeout_s` bounds everything: a hedge is never
            sent after it.
        initial_s: the deadline while no latency of the size class is known (start-up, a router restart): what a
            replica hung from the start costs a completion (floored and capped too). Long enough for a first completion on a loaded replica;
            a too-short one costs hedges, which `budget` bounds.
        min_samples: latencies needed (per size class) before the quantile is trusted; with fewer (but some), the
            slowest of them times `factor` where that is longer than `initial_s`.
        window: latencies kept per size class (the most recent ones).
        budget: at most this fraction of the completions in flight may be hedges at once (at least 2).
    """

    enabled: bool = True
    quantile: float = setting(0.95, check=Range(0, open=True, high=1))
    factor: float = setting(2.0, check=Range(1))
    floor_s: float = setting(1.0, check=Range(0, open=True))
    cap_s: float = 300.0
    initial_s: float = setting(60.0, check=Range(0, open=True))
    min_samples: int = setting(20, check=Range(1))
    window: int = 512
    budget: float = setting(0.25, check=Range(0, open=True, high=1))

    def __post_init__(self):
        check_fields(self)
        if self.floor_s > self.cap_s or self.window < self.min_samples:
            raise ValueError(f"per_try needs floor_s <= cap_s and window >= min_samples, got {self.floor_s}, "
                             f"{self.cap_s}, {self.window} and {self.min_samples}")


def size_class(max_tokens) -> int:
    """Completions are compared with those asking for the same power of two of tokens (0: not given)."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return 0
    return 1 << (max_tokens - 1).bit_length()


@dataclass(slots=True)
class _Window:
    samples: deque[float]
    quantile: float | None = None
    stale: int = 0  # samples added since the quantile was computed


class PerTryDeadlines:
    """Recent completion latencies per size class, and the per-try deadline they give. One event loop; cheap: the
    quantile is recomputed every 16 new samples (sooner while the window is small), not per request."""

    REFRESH = 16

    def __init__(self, config: PerTryConfig):
        self.config = config
        self._windows: dict[int, _Window] = {}

    def observe(self, max_tokens, seconds: float) -> None:
        """A completion that answered 200 in `seconds` (the try that won)."""
        key = size_class(max_tokens)
        if (window := self._windows.get(key)) is None:
            window = self._windows[key] = _Window(deque(maxlen=self.config.window))
        window.samples.append(seconds)
        window.stale += 1

    def deadline_s(self, max_tokens) -> float:
        """How long one try may run before a hedge is sent."""
        c = self.config
        window = self._windows.get(size_class(max_tokens))
        if window is None or len(window.samples) < c.min_samples:
            slowest = max(window.samples) if window is not None and window.samples else 0.0
            return min(c.cap_s, max(c.floor_s, c.initial_s, c.factor * slowest))
        if window.quantile is None or window.stale >= min(self.REFRESH, max(1, len(window.samples) // 8)):
            ordered = sorted(window.samples)
            window.quantile = ordered[min(len(ordered) - 1, math.ceil(c.quantile * len(ordered)) - 1)]
            window.stale = 0
        return min(c.cap_s, max(c.floor_s, c.factor * window.quantile))

    def snapshot(self) -> dict[str, dict]:
        """{size class: {samples, deadline_s}} for /router/state."""
        return {str(key): {"samples": len(w.samples), "deadline_s": round(self.deadline_s(key or None), 4)}
                for key, w in sorted(self._windows.items())}
