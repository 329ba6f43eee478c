"""The sweep benchmark's arithmetic (benchmarks/sweep_bench.py): what the committed comparison's figures mean."""

from __future__ import annotations

import pandas as pd
import pytest
from benchmark_scripts import load_benchmark

sweep_bench = load_benchmark("sweep_bench")


def rows(layout, seed, start, walls, startup, rewards, work):
    """One layout's runs: each starts at `start`, takes its wall time, reaches its first step after `startup`."""
    return [{"layout": layout, "seed": seed, "run": f"r{i}", "wall_s": wall, "started_at": start,
             "ended_at": start + wall, "startup_s": startup, "trained_tokens": 100, "steady_steps_per_s": 10 / wall,
             "final_reward": reward, **work} for i, (wall, reward) in enumerate(zip(walls, rewards))]


def test_jain_index_is_one_for_equal_speeds_and_one_over_n_for_one_taking_all():
    assert sweep_bench.jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert sweep_bench.jain([5.0, 0.0, 0.0, 0.0]) == pytest.approx(1.0)  # zeros are runs that did not run
    assert sweep_bench.jain([1.0, 3.0]) == pytest.approx(16 / 20)


def test_summary_ratios_slowdown_and_replica_work_counted_once_per_pool():
    shared_work = {"replica_generate_s": 80.0, "replica_adapter_load_s": 6.0, "replica_adapter_unload_s": 2.0,
                   "replica_adapter_load_n": 40}
    own_work = {"replica_generate_s": 20.0, "replica_adapter_load_s": 1.0, "replica_adapter_unload_s": 0.5,
                "replica_adapter_load_n": 10}
    frame = pd.DataFrame(
        rows("shared", 1, 0.0, [40.0, 50.0], 20.0, [0.5, 0.6], shared_work)  # every shared row repeats the pool's
        + rows("separate", 1, 100.0, [40.0, 60.0], 20.0, [0.5, 0.7], own_work)
        + rows("shared", 2, 0.0, [40.0, 50.0], 20.0, [0.9, 0.6], shared_work)
        + rows("separate", 2, 100.0, [40.0, 60.0], 20.0, [0.4, 0.6], own_work))
    summary = sweep_bench.summarize(frame).set_index("seed")
    first = summary.loc[1]
    assert first.makespan_ratio == pytest.approx(50 / 60, abs=1e-3)
    assert first.training_span_ratio == pytest.approx(30 / 40, abs=1e-3)  # past the 20 s start-up
    assert first.p99_slowdown == pytest.approx(1.0, abs=0.01)  # r0 40/40, r1 50/60: the slowest is 1.0
    assert first.worst_run == "r0"
    assert (first.generate_s_shared, first.adapter_s_shared, first.adapter_loads_shared) == (80.0, 8.0, 40)
    assert (first.generate_s_separate, first.adapter_s_separate, first.adapter_loads_separate) == (40.0, 3.0, 20)
    # r0's shared rewards (0.5, 0.9) leave its separate range 0.4-0.5 widened by its spread 0.1; r1's do not
    assert set(summary.rewards_within_spread) == {"1/2"}
