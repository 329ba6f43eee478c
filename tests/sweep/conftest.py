"""The sweep tests reuse the loop tests' process helpers (`tests/async_loop/loop_fixtures`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "async_loop"))

from loop_fixtures import no_leftover_children  # noqa: F401 - a pytest fixture
