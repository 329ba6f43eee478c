"""The committed notebook 04 is stripped, its parameters cell first (papermill injects after it). Its headless quick
run is checked on the shared `grpo-lab reproduce --quick` run: tests/notebooks/test_notebook04.py."""

from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "04_async_lora.ipynb"


def test_committed_notebook_is_stripped_with_parameters_first():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert "parameters" in nb.cells[0].metadata.get("tags", [])
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
