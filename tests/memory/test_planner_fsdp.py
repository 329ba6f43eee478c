"""The planner against the harness's own meter: a 2-process gloo FSDP2 + LoRA step, each rank's peak RSS.
(World sizes 1, 2 and 4 on Qwen3-0.6B are `python -m grpo_lab.memory.planner.check --preset cpu_fsdp`, minutes per
point; their CSV is committed in results/memory_planner and checked below.)"""

import pandas as pd
import pytest

from grpo_lab.memory.planner.check import CheckPoint, planner_config, run_checks
from grpo_lab.memory.spec import PointSpec


def test_two_rank_fsdp_peak_rss_is_predicted():
    spec = PointSpec(model="small-qwen3", loss_backend="trl", dtype="fp32", batch_size=4, prompt_len=16,
                     completion_len=112, lora_r=8, fsdp=True, world_size=2, steps=1, device="cpu")
    row = run_checks([CheckPoint(spec, "W=2")]).iloc[0]
    assert row["status"] == "ok"
    per_rank = [float(x) for x in row["peak_gib_per_rank"].split()]
    assert len(per_rank) == 2 and row["peak_gib"] == pytest.approx(max(per_rank), abs=1e-3)
    # RSS above the baseline moves with the environment, not only with the tensors: this very point measured 0.217 GiB
    # in one virtualenv and 0.279 GiB in another with the same packages (the lazily paged-in library code differs);
    # the 10 % validation is the committed table's (below), measured in one environment. Here: the right size.
    assert row["predicted_gib"] == pytest.approx(row["peak_gib"], rel=0.30)
    assert planner_config(spec).world_size == 2


def test_committed_cpu_world_size_runs_are_within_10_percent():
    from grpo_lab.memory.planner.validate import planner_check_rows
    from grpo_lab.memory.results import load_reference

    df = load_reference("memory_planner", "planner_cpu_fsdp.csv")
    assert df is not None, "results/memory_planner/planner_cpu_fsdp.csv is committed"
    rows = pd.DataFrame(planner_check_rows(df, "CPU"))  # predicted again by the planner as it is now
    assert set(rows["world_size"]) == {1, 2, 4} and len(rows) == 6
    assert rows["error_pct"].abs().max() <= 10
    # more GPUs, less memory per rank: measured and predicted agree on the direction
    for _, g in rows.groupby("backend"):
        g = g.sort_values("world_size")
        assert g["measured_gib"].is_monotonic_decreasing and g["predicted_gib"].is_monotonic_decreasing
