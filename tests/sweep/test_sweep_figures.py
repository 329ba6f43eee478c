"""What a sweep reads of its runs: steps from a metrics log (a killed run's torn last line and the end-of-training
row left out), the final reward, each run's share of the pool, a log's last line."""

from __future__ import annotations

import json
import math

from grpo_lab.sweep.figures import curve_points, last_line, mean_of_last, pool_shares, step_rows


def test_steps_curves_and_final_reward_from_a_metrics_log(tmp_path):
    rows = [{"step": s, "reward": r, "kl": 0.01 * s, "sample/staleness_mean": 1.0, "perf/rollout_wait_s": 0.5}
            for s, r in ((1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0))]
    text = "".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"step": 4, "train_runtime": 9.0}) + "\n{\"st"
    (tmp_path / "loop_metrics.jsonl").write_text(text)
    got = step_rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert curve_points(got)[0] == {"step": 1, "reward": 0.25, "kl": 0.01, "staleness": 1.0, "rollout_wait_s": 0.5}
    assert mean_of_last(got, "reward") == 0.75  # the last three steps
    assert math.isnan(mean_of_last(got, "missing"))
    assert step_rows(tmp_path / "not-started") == []


def test_pool_shares_split_what_the_pool_granted():
    shares = pool_shares([{"name": "a", "granted": 30, "queued": 2}, {"name": "b", "granted": 10},
                          {"name": "c", "granted": 0}])
    assert [round(shares[n]["share"], 2) for n in "abc"] == [0.75, 0.25, 0.0] and shares["a"]["queued"] == 2
    assert math.isnan(pool_shares([{"name": "a", "granted": 0}])["a"]["share"])


def test_last_line_of_a_log(tmp_path):
    log = tmp_path / "run.log"
    assert last_line(log) == ""
    log.write_text("x" * 20000 + "\nstep 1/3: reward 0.5\r step 2/3: reward 0.6\n\n")
    assert last_line(log) == "step 2/3: reward 0.6"
