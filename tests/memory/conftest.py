"""Shared fixtures of the memory-harness tests."""

from pathlib import Path

import nbformat
import pytest

from grpo_lab.notebook_runner import run_notebook

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture
def quick_notebook(tmp_path):
    """Run a committed notebook headless in quick mode with its results under tmp_path/results; checks that it is
    committed as the kit expects (parameters cell first, outputs stripped) and that the executed copy shows a
    figure and no error. Returns the results folder."""

    def run(name: str) -> Path:
        nb_path = NOTEBOOKS / name
        src = nbformat.read(nb_path, as_version=4)
        assert "parameters" in src.cells[0].metadata.get("tags", [])
        assert all(not c.get("outputs") for c in src.cells if c.cell_type == "code"), "commit notebooks stripped"
        out_dir = tmp_path / "results"
        executed = nbformat.read(run_notebook(nb_path, parameters={"OUT_DIR": str(out_dir)}, executed_dir=tmp_path),
                                 as_version=4)
        outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
        assert [o for o in outputs if "image/png" in o.get("data", {})], "the executed notebook has no figure output"
        assert not [o for o in outputs if o.output_type == "error"]
        return out_dir

    return run


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
