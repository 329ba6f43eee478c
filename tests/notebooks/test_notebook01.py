"""Notebook 01 executes headless in quick mode, writes its CSV (one row per point, sane values) and a figure."""

import pandas as pd
import pytest

from grpo_lab.memory.sweep import PRESETS


@pytest.mark.slow
def test_notebook01_quick(reproduced):
    out_dir = reproduced.outputs("memory_vs_batch")
    p = PRESETS["quick"]
    df = pd.read_csv(out_dir / "memory_vs_batch_quick.csv")
    n_points = len(p["backends"]) * len(p["dtypes"]) * (len(p["batch_sizes"]) + len(p["loss_batch_sizes"]))
    assert len(df) == n_points
    assert df.duplicated(["mode", "dtype", "backend", "batch_size"]).sum() == 0
    assert set(df["status"]) <= {"ok", "oom"}
    ok = df[df["status"] == "ok"]
    assert len(ok) > 0 and (ok["peak_gib"] > 0).all() and (ok["peak_gib"] < 16).all()
    assert (out_dir / "memory_vs_batch_quick.png").is_file()
