"""Suite-wide hooks: the wall time each test tier took, printed at the end of every run; and the S3 server fixtures.

CI must stay under its time budget on 2 cores; this table (setup + call + teardown per tier, i.e. per folder under
tests/) says which tier grew when it does not. `s3_server` / `s3_url` (`s3_fixtures`) are here so that every tier
shares one server process per session.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

# the S3-compatible server (moto, its own process) for the tests that publish to s3://; started only when asked for
from s3_fixtures import s3_server, s3_url  # noqa: F401 - pytest fixtures

_TESTS = Path(__file__).resolve().parent
_tier_seconds: dict[str, float] = defaultdict(float)
_tier_tests: dict[str, set[str]] = defaultdict(set)


def tier_of(nodeid: str) -> str:
    """`tests/serving/test_x.py::t` → `serving`; a module directly under tests/ → its file name."""
    parts = Path(nodeid.split("::", 1)[0]).parts
    inside = parts[parts.index("tests") + 1:] if "tests" in parts else parts
    return inside[0] if len(inside) > 1 else (inside[0] if inside else nodeid)


def pytest_runtest_logreport(report):
    tier = tier_of(report.nodeid)
    _tier_seconds[tier] += report.duration
    _tier_tests[tier].add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if not _tier_seconds:
        return
    terminalreporter.section("time per test tier")
    for tier, seconds in sorted(_tier_seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{tier:<24} {len(_tier_tests[tier]):>4} tests  {seconds:8.1f} s")
    terminalreporter.write_line(f"{'total':<24} {sum(map(len, _tier_tests.values())):>4} tests  "
                                f"{sum(_tier_seconds.values()):8.1f} s")
