"""Fixtures of the loop tests; the helpers live in `loop_fixtures` (a unique module name: several test folders have
a conftest.py, so `from conftest import ...` could pick up another folder's)."""

from loop_fixtures import cluster, no_leftover_children  # noqa: F401 - pytest fixtures
