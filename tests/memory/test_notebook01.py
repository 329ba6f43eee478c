"""Notebook 01 executes headless in quick mode, writes its CSV (one row per point, sane values) and a figure."""

from pathlib import Path

import nbformat
import pandas as pd
import pytest

from grpo_lab.notebook_runner import run_notebook

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_notebook01_quick(tmp_path):
    nb_path = ROOT / "notebooks" / "01_memory_vs_batch.ipynb"
    src = nbformat.read(nb_path, as_version=4)
    assert "parameters" in src.cells[0].metadata.get("tags", [])
    assert all(not c.get("outputs") for c in src.cells if c.cell_type == "code"), "commit notebooks stripped"
    out_dir = tmp_path / "results"
    executed = run_notebook(nb_path, parameters={"OUT_DIR": str(out_dir)}, executed_dir=tmp_path)
    from grpo_lab.memory.sweep import PRESETS

    p = PRESETS["quick"]
    df = pd.read_csv(out_dir / "memory_vs_batch_quick.csv")
    n_points = len(p["backends"]) * len(p["dtypes"]) * (len(p["batch_sizes"]) + len(p["loss_batch_sizes"]))
    assert len(df) == n_points
    assert df.duplicated(["mode", "dtype", "backend", "batch_size"]).sum() == 0
    assert set(df["status"]) <= {"ok", "oom"}
    ok = df[df["status"] == "ok"]
    assert len(ok) > 0 and (ok["peak_gib"] > 0).all() and (ok["peak_gib"] < 16).all()
    assert (out_dir / "memory_vs_batch_quick.png").is_file()
    nb = nbformat.read(executed, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the executed notebook has no figure output"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
