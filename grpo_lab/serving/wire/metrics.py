"""A minimal Prometheus text-format registry: counters, gauges and histograms with labels, no dependency."""

from __future__ import annotations

import bisect
import itertools
import math

DEFAULT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


class Registry:
    """Holds metric families; `render()` gives the exposition text for `/metrics`."""

    def __init__(self):
        self._families: dict[str, tuple[str, str, dict]] = {}  # name -> (type, help, {labels: value})
        self._buckets: dict[str, tuple] = {}

    def _family(self, name: str, kind: str, help_text: str) -> dict:
        return self._families.setdefault(name, (kind, help_text, {}))[2]

    def inc(self, name: str, help_text: str, amount: float = 1.0, **labels) -> None:
        series = self._family(name, "counter", help_text)
        key = tuple(sorted(labels.items()))
        series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, help_text: str, value: float, **labels) -> None:
        self._family(name, "gauge", help_text)[tuple(sorted(labels.items()))] = value

    def observe(self, name: str, help_text: str, value: float, buckets=DEFAULT_BUCKETS, **labels) -> None:
        series = self._family(name, "histogram", help_text)
        bounds = self._buckets.setdefault(name, tuple(buckets))
        state = series.setdefault(tuple(sorted(labels.items())), [[0] * (len(bounds) + 1), 0.0, 0])
        state[0][bisect.bisect_left(bounds, value)] += 1  # state: bucket counts, sum, count
        state[1] += value
        state[2] += 1

    def drop_gauges(self, **labels) -> None:
        """Forget every gauge series carrying these labels (a replica that left the router has no current state or
        load any more); counters and histograms keep their history, as Prometheus expects of them."""
        wanted = set(labels.items())
        for kind, _, series in self._families.values():
            if kind == "gauge":
                for key in [k for k in series if wanted <= set(k)]:
                    del series[key]

    def value(self, name: str, **labels) -> float:
        """The sum of a counter's or gauge's series that carry these labels (0 when none): for /router/state."""
        family = self._families.get(name)
        if family is None or family[0] == "histogram":
            return 0.0
        wanted = set(labels.items())
        return float(sum(v for k, v in family[2].items() if wanted <= set(k)))

    def render(self, keep=None) -> str:
        """The exposition text; `keep(labels)` (a dict) may leave series out (a tenant run sees only its own)."""
        lines = []
        for name, (kind, help_text, series) in self._families.items():
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            for key, value in series.items():
                labels = dict(key)
                if keep is not None and not keep(labels):
                    continue
                if kind != "histogram":
                    lines.append(f"{name}{_labels(labels)} {_num(value)}")
                    continue
                counts, total, n = value
                for bound, running in zip(self._buckets[name] + (math.inf,), itertools.accumulate(counts)):
                    le = "+Inf" if bound == math.inf else repr(bound)
                    lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {running}")
                lines.append(f"{name}_sum{_labels(labels)} {_num(total)}")
                lines.append(f"{name}_count{_labels(labels)} {n}")
        return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def parse_text(text: str) -> dict[str, float]:
    """Parse exposition text into {'name{labels}': value}; for tests and notebooks."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
