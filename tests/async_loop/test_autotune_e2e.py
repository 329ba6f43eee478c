"""Autotune on the whole loop with real processes: the controller raises the requests in flight of a starved run
while it trains (the rollout worker's child sends more requests at once, without a restart), records each change
in `loop_metrics.jsonl`, and the run ends with no process left behind."""

from __future__ import annotations

from grpo_lab.async_loop.autotune import AutotuneConfig
from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics

from loop_fixtures import MAX_STALENESS, wait_gone


def test_autotune_raises_the_in_flight_count_of_a_starved_run_live(cluster, tmp_path, no_leftover_children):
    out = tmp_path / "run"
    # one request in flight for two replicas: the trainer waits for rollouts; a sensitive controller acts at once
    # a budget of two steps of samples and a queue bound of at most one: the default queue (1024) is cut to one step
    # before the first request, so the backlog made while the trainer starts up is gone after a step and does not
    # hide the starving trainer (with the 31 the budget leaves, it could read train-bound until step 5)
    config = AutotuneConfig(budget_steps=2, max_queue=16, warmup_steps=1, patience=1, cooldown_steps=1,
                            rollout_wait_high=0.01, starving=0.01, max_loss=1.0)
    args = embedded_trainer_args(str(out), max_steps=8, max_staleness=MAX_STALENESS, save_strategy="no",
                                 max_inflight_tasks=1)
    lines, pids = [], []
    loop = AsyncLoop(LoopConfig(router_url=cluster.url, autotune=config), args, progress=False)
    with loop:
        worker = loop.trainer.rollout_worker
        # the worker's child is running while a change is made (TRL stops it when train() ends)
        loop.trainer.autotune_callback.say = lambda line: (lines.append(line), pids.append(worker.pid))
        assert worker.live_knobs.inflight == 1
        assert worker.live_knobs.max_inflight == loop.trainer.autotuner.bounds.max_inflight > 1  # TRL's slots
        loop.train()
    rows = [r for r in read_metrics(out / METRICS_FILE) if "train_runtime" not in r]
    assert [r["step"] for r in rows] == list(range(1, 9))
    decisions = [d for r in rows for d in r.get("autotune", [])]
    raised = [d for d in decisions if d["knob"] == "inflight" and d["new"] > d["old"]]
    waits = [round(r.get("perf/rollout_wait_s") or 0, 3) for r in rows]
    assert raised and raised[0]["old"] == 1, (decisions, waits)
    assert raised[0]["regime"] in ("starving", "rollout", "balanced"), (decisions, waits)
    assert "rollout_wait_share" in raised[0]["evidence"]
    # the queue bound was fitted to the pipeline budget before the first request, said once, kept with step 1
    assert decisions[0]["step"] == 0 and decisions[0]["regime"] == "budget" and decisions[0]["knob"] == "queue"
    assert rows[0]["autotune"][0] == decisions[0]
    assert lines[0].startswith("autotune: step 0: queue bound ")
    # (a startup backlog can make the first reading train-bound: a queue cut may come before the raise)
    raise_line = f"autotune: step {raised[0]['step']}: in flight 1 -> "
    said = [i for i, line in enumerate(lines) if line.startswith(raise_line)]
    assert said, lines
    # every row carries the knob; the change is the run's own value from its step on
    assert all("autotune/inflight" in r for r in rows)
    assert rows[0]["autotune/inflight"] == 1 and rows[-1]["autotune/inflight"] > 1
    # the child really sent more than one request at once after the raise (TRL's own gauge counts drawn rollouts)
    sent = [r["rollout/requests_inflight"] for r in rows if r["step"] > raised[0]["step"]
            and "rollout/requests_inflight" in r]
    assert sent and max(sent) > 1, sent
    assert all(r["sample/staleness_max"] <= MAX_STALENESS for r in rows if "sample/staleness_max" in r)
    # the raise was made while the worker's child ran (the step-0 line comes before it starts); no orphan after
    raised_pid = pids[said[0]]
    assert raised_pid is not None and wait_gone([raised_pid], 10) == []
