"""Notebook 02 executes headless in quick mode, writes its CSV (one row per search, sane values) and a figure."""

import pandas as pd
import pytest

from grpo_lab.memory.max_batch import PRESETS


@pytest.mark.slow
def test_notebook02_quick(reproduced):
    out_dir = reproduced.outputs("fsdp_max_batch")
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
