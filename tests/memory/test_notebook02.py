"""Notebook 02 executes headless in quick mode, writes its CSV (one row per search, sane values) and a figure."""

from pathlib import Path

import nbformat
import pandas as pd
import pytest

from grpo_lab.notebook_runner import run_notebook

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_notebook02_quick(tmp_path):
    nb_path = ROOT / "notebooks" / "02_fsdp_max_batch.ipynb"
    src = nbformat.read(nb_path, as_version=4)
    assert "parameters" in src.cells[0].metadata.get("tags", [])
    assert all(not c.get("outputs") for c in src.cells if c.cell_type == "code"), "commit notebooks stripped"
    out_dir = tmp_path / "results"
    executed = run_notebook(nb_path, parameters={"OUT_DIR": str(out_dir)}, executed_dir=tmp_path)
    from grpo_lab.memory.max_batch import PRESETS

    p = PRESETS["quick"]
    df = pd.read_csv(out_dir / "fsdp_max_batch_quick.csv")
    assert len(df) == len(p["models"]) * len(p["backends"])
    assert df.duplicated(["model", "backend"]).sum() == 0
    assert (df["status"] == "ok").all()
    assert ((df["max_batch"] >= 1) & (df["max_batch"] <= p["upper"])).all()
    # the search brackets the limit: max fits, first_oom (when hit) does not, and they are within the tolerance
    hit = df[df["first_oom"].notna()]
    assert (hit["first_oom"] > hit["max_batch"]).all()
    assert ((hit["first_oom"] - hit["max_batch"]) <= (p["rel_tol"] * hit["max_batch"]).clip(lower=1)).all()
    probes = pd.read_csv(out_dir / "fsdp_max_batch_quick_probes.csv")
    assert len(probes) == df["n_probes"].sum() and set(probes["status"]) <= {"ok", "oom"}
    assert (out_dir / "fsdp_max_batch_quick.png").is_file()
    nb = nbformat.read(executed, as_version=4)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the executed notebook has no figure output"
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
