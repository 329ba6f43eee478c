"""The scripts of benchmarks/ as modules, for the tests of their plumbing: they are scripts, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py imported afresh, under its own name in `sys.modules` (its dataclasses, and the scripts
    that `import` one another, look it up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
