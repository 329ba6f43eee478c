"""The autotune controller on recorded signal traces (rows under TRL's metric names), and its live knobs.

Each trace is a list of logged rows as `loop_metrics.jsonl` holds them; the controller is replayed over it the way
`AutotuneCallback` runs it in the trainer, with a model of how the loop answers a change where the test needs one.
"""

from __future__ import annotations

import asyncio
import math
import pickle

import pytest

from grpo_lab.async_loop.autotune import (AutotuneCallback, Autotuner, AutotuneConfig, classify, read_steps,
                                          slowdown)
from grpo_lab.async_loop.live_knobs import BoundedBuffer, LiveKnobs, LiveLimiter

G, SPS, S = 8, 16, 4  # rollouts per prompt, samples per step, max_staleness: the embedded loop's shape


def row(step_s=1.0, wait=0.0, staleness=1.0, dropped=0.0, backpressure=0.0, samples=SPS, abandoned=0.0):
    r = {"perf/step_s": step_s, "perf/rollout_wait_s": wait, "sample/staleness_mean": staleness,
         "batch/samples_per_step": samples, "perf/fwd_bwd_s": step_s / 2}
    if dropped:
        r["sample/dropped_stale_total"] = dropped
    if abandoned:
        r["rollout/abandoned_groups_total"] = abandoned
    if backpressure:
        r["rollout/backpressure_s"] = backpressure
    return r


def replay(tuner: Autotuner, rows) -> list:
    decisions = []
    for step, r in enumerate(rows, 1):
        decisions += tuner.observe(step, r)
    return decisions


def tuner(inflight=64, queue=1024, **config) -> Autotuner:
    return Autotuner(AutotuneConfig(**config), inflight, queue, G, SPS, S)


def test_staleness_bound_trace_lowers_in_flight_and_never_raises_back_to_a_wasteful_value():
    t = tuner(64)
    decisions = replay(t, [row(staleness=3.8, dropped=6)] * 6)
    assert decisions and all(d.knob == "inflight" and d.new < d.old for d in decisions)
    assert decisions[0].regime == "staleness" and decisions[0].evidence["waste_share"] > 0.2
    assert t.ceiling < 64
    # now the trainer starves: raises stop below the value that wasted samples
    replay(t, [row(wait=0.9, staleness=0.5)] * 20)
    assert t.inflight < 64 and t.inflight <= t.ceiling


def test_staleness_with_a_full_queue_lowers_the_queue_bound_first():
    t = tuner(16, 1024)
    decisions = replay(t, [row(staleness=3.5, backpressure=0.5)] * 4)
    assert decisions and decisions[0].knob == "queue" and decisions[0].new < 1024
    assert t.inflight == 16


def test_rollout_bound_trace_raises_in_flight_and_keeps_a_raise_that_pays():
    t = tuner(1)
    speed = {1: 4.0, 2: 2.2, 4: 1.3, 8: 1.0, 16: 1.0, 32: 1.0}  # step time by in flight: flat from 8
    rows, step = [], 0
    for _ in range(40):
        step += 1
        s = speed.get(t.inflight, 1.0)
        r = row(step_s=s, wait=max(s - 1.0, 0.0), staleness=0.5)
        rows.append(r)
        t.observe(step, r)
    raised = [d for d in t.decisions if d.new > d.old]
    # starving: a slow start, no patience and no probe; waiting 3 s of a 4 s step, 4x the requests would feed it
    assert [(d.old, d.new, d.regime) for d in raised[:1]] == [(1, 4, "starving")]
    assert 5 <= t.inflight <= 16  # climbed to where steps/s stops improving ...
    reverted = [d for d in t.decisions if d.regime == "probe"]
    assert all(d.new < d.old for d in reverted)  # ... and a raise that gained nothing was taken back


def test_a_starving_loop_climbs_within_a_few_steps_and_each_raise_waits_for_its_samples():
    t = tuner(1)
    steps_of = {}
    for step in range(1, 21):
        n = t.inflight
        steps_of.setdefault(n, step)
        t.observe(step, row(step_s=4.0 / min(n, 16), wait=max(4.0 / min(n, 16) - 0.25, 0.0), staleness=0.3))
    climbs = [(d.step, d.new) for d in t.decisions if d.regime == "starving"]
    # waiting 94 % of the step, then 75 %: x4 (the most at one reading, where 1/(1 - 0.94) = 16 would be wanted), x4
    assert [n for _, n in climbs][:2] == [4, 16]
    assert climbs[1][0] <= 6  # from 1 to 16 in flight by step 6 of a 20-step run
    assert steps_of[4] == climbs[0][0] + 1 and climbs[1][0] - climbs[0][0] == 2  # one settling step before reading


def test_a_loop_starving_half_the_step_gets_twice_the_requests():
    t = tuner(4)
    decisions = replay(t, [row(step_s=1.0, wait=0.5, staleness=0.3)] * 4)
    assert [(d.old, d.new, d.regime) for d in decisions][:1] == [(4, 8, "starving")]


def test_a_fed_loop_reading_stale_cuts_its_queue_not_its_few_requests():
    """2 in flight beside a 62-sample queue bound: the trainer never waits, the samples age in the queue. Cutting the
    requests (and making that a ceiling) would leave the loop at 1 in flight for the rest of the run."""
    t = tuner(2)
    assert t.queue_bound == 62
    decisions = replay(t, [row(wait=0.0, staleness=3.2)] * 12)
    assert decisions and all(d.knob == "queue" and d.regime == "staleness" for d in decisions)
    assert "samples age in the queue" in decisions[0].reason
    assert t.inflight == 2 and t.ceiling == t.bounds.max_inflight
    assert t.queue_bound == t.bounds.min_queue == SPS  # cut until the floor: one step of samples


def test_a_queue_cut_for_a_startup_backlog_does_not_slow_the_climb_of_the_requests():
    """From 2 in flight a startup backlog reads stale while the trainer is fed: the queue bound is cut. When the
    backlog is gone and the trainer starves, the requests climb at the full slow-start rate: the queue's reversal
    of direction is the queue's own (the benchmark saw shared damping leave a run climbing one request a time)."""
    t = tuner(2)
    cuts = replay(t, [row(wait=0.0, staleness=3.2)] * 6)
    assert cuts and all(d.knob == "queue" for d in cuts)
    climb = []
    for step in range(len(cuts) + 7, len(cuts) + 15):
        climb += [d for d in t.observe(step, row(step_s=1.0, wait=0.9, staleness=0.3)) if d.knob == "inflight"]
    # the first reading still holds a fed step (waits 60 %: x2.5), the next waits 90 %: x4, undamped
    assert [(d.old, d.new, d.regime) for d in climb][:2] == [(2, 5, "starving"), (5, 20, "starving")]


def test_a_balanced_loop_with_fewer_requests_than_a_step_probes_up_to_a_step():
    t = tuner(4)
    decisions = replay(t, [row(step_s=0.5, wait=0.02, staleness=1.0)] * 30)
    assert [(d.old, d.new, d.regime) for d in decisions] == [(4, 8, "balanced"), (8, 16, "balanced")]
    assert "in flight 4 -> 8 (balanced: fewer requests in flight than a step trains on" in decisions[0].line()
    assert t.inflight == SPS  # a step's worth: balanced from there on, nothing more


def test_a_balanced_probe_that_slows_the_steps_is_reverted():
    t = tuner(4)
    rows, step = [], 0
    for _ in range(30):
        step += 1
        r = row(step_s=(0.5 if t.inflight <= 4 else 0.9) + (0.01 if step % 2 else -0.01), wait=0.02, staleness=1.0)
        rows.append(r)
        t.observe(step, r)
    assert [(d.old, d.new, d.regime) for d in t.decisions if d.step][:2] == [(4, 8, "balanced"), (8, 4, "probe")]
    assert t.inflight == 4


def test_train_bound_trace_changes_no_in_flight_and_recommends_restart_knobs():
    t = tuner(16, 64)
    decisions = replay(t, [row(staleness=2.5, backpressure=0.4)] * 8)
    assert all(d.knob == "queue" for d in decisions) and t.inflight == 16
    assert any("token_budget" in r for r in t.recommendations)
    assert t.queue_bound >= t.bounds.min_queue == SPS


def test_balanced_trace_changes_nothing():
    t = tuner(16, 64)
    assert replay(t, [row(wait=0.05, staleness=1.0)] * 30) == []


def test_oscillation_prone_trace_settles():
    """A loop that starves at low in flight and wastes at high in flight, with noise: the controller converges."""
    t = tuner(64)
    for step in range(1, 81):
        n = t.inflight
        jitter = 0.1 if step % 2 else -0.1
        if n >= 24:
            r = row(step_s=1.0 + jitter, staleness=3.6, dropped=4)
        elif n <= 6:
            r = row(step_s=2.0 + jitter, wait=1.0, staleness=0.4)
        else:
            r = row(step_s=1.0 + jitter, wait=0.05, staleness=1.5)
        t.observe(step, r)
    late = [d for d in t.decisions if d.step > 40]
    assert len(late) <= 1, [d.line() for d in t.decisions]
    assert 6 < t.inflight < 24
    directions = [d.new > d.old for d in t.decisions if d.knob == "inflight"]
    flips = sum(a != b for a, b in zip(directions, directions[1:]))
    assert flips <= 3


def test_bounds_hold_and_hysteresis_waits():
    t = tuner(16, 64, min_inflight=8, max_inflight=32, patience=3, cooldown_steps=2, warmup_steps=2)
    assert (t.bounds.min_inflight, t.bounds.max_inflight) == (8, 32)
    # mild rollout wait (not starving): no change before warmup + patience readings
    decisions = []
    for step in range(1, 5):
        decisions += t.observe(step, row(wait=0.3))
    assert decisions == []
    decisions += t.observe(5, row(wait=0.3))
    assert len(decisions) == 1 and decisions[0].new <= 32
    # a cooldown follows every change
    assert t.observe(6, row(wait=0.9)) == [] and t.observe(7, row(wait=0.9)) == []
    for step in range(8, 60):
        t.observe(step, row(wait=0.9, step_s=1.0 / (1 + step)))  # keeps paying: climbs to the bound, not past it
    assert t.inflight == 32
    for step in range(60, 120):
        t.observe(step, row(staleness=4.0, dropped=12))
    assert t.inflight == 8  # the floor: never starved below it
    assert any("more replicas" in r for r in t.recommendations)


def test_a_start_beyond_the_pipeline_budget_is_clamped_before_the_first_request():
    t = tuner(512, 1024)
    # the budget is TRL's default in-flight count, for the requests in flight and the queue together
    assert t.bounds.budget == S * SPS and t.bounds.max_inflight == (S - 1) * SPS
    assert (t.inflight, t.queue_bound) == ((S - 1) * SPS, SPS)
    first, second = t.decisions
    assert (first.step, first.knob, first.old, first.new, first.regime) == (0, "inflight", 512, 48, "budget")
    assert (second.knob, second.old, second.new) == ("queue", 1024, SPS)
    assert "pipeline budget is 64 samples" in first.line() and "-bound" not in first.line()
    # TRL's default (64 in flight, 1024 queued) is beyond it too
    default = tuner(64, 1024)
    assert (default.inflight, default.queue_bound) == (48, SPS) and len(default.decisions) == 2
    # a start below the floors is where the controller begins: the queue gets what the budget leaves
    low = tuner(1, 1024)
    assert low.bounds.min_inflight == 1 and low.queue_bound == S * SPS - 1 and low.decisions[0].new == 63
    assert tuner(16, 16).decisions == []  # inside the budget: nothing to clamp


def test_the_queue_bound_follows_the_in_flight_count_within_the_budget():
    t = tuner(48, 1024)
    replay(t, [row(staleness=3.9, dropped=8)] * 4)
    cut = t.decisions[-1]
    assert (cut.old, cut.new) == (48, 24) and t.queue_bound == S * SPS - 24
    assert "queue bound follows the budget: 16 -> 40" in cut.reason
    assert t.inflight + t.queue_bound <= t.bounds.budget


def test_a_cut_is_not_judged_on_the_waste_of_the_requests_it_cut():
    """Samples admitted before a cut are dropped for a few steps after it: the controller waits for them to be
    out of the pipeline instead of cutting again (64 -> 32 -> 16 -> 8 on the same old waste)."""
    t = tuner(48, 16)
    replay(t, [row(staleness=3.9, dropped=8)] * 3)
    assert t.inflight == 24
    cut_at = t.decisions[-1].step
    drain = min(math.ceil((48 + 16) / SPS), S + 1)  # the old in-flight count and the queue beside it
    for step in range(cut_at + 1, cut_at + drain + 1):  # the old pipeline drains: still wasting
        assert t.observe(step, row(staleness=3.5, dropped=8)) == []
    assert t.inflight == 24
    for step in range(cut_at + drain + 1, cut_at + drain + 10):  # then fresh, mildly rollout-bound but old-ish
        t.observe(step, row(wait=0.3, staleness=2.4))
    assert t.inflight == 24 and t.ceiling == 47


def test_a_slowdown_the_spread_of_the_steps_explains_is_not_a_loss():
    noisy_before = [0.4, 0.8, 0.5, 0.9, 0.45, 0.7]
    noisy_after = [0.9, 0.5, 0.85, 0.6, 0.8, 0.75]  # 10 % slower on average, well inside the spread
    assert slowdown(noisy_before, noisy_after) == 0.0
    steady_before, steady_after = [0.50, 0.52, 0.49, 0.51], [0.70, 0.72, 0.69, 0.71]
    assert slowdown(steady_before, steady_after) == pytest.approx(0.4, abs=0.01)
    assert slowdown([], [1.0]) == 0.0 and slowdown([0.5], [0.9]) == pytest.approx(0.8)


def test_a_probe_is_kept_through_noise_and_reverted_on_a_real_slowdown():
    def run(after_raise):
        t = tuner(16, 16, reprobe_steps=0)
        jitter = [0.45, 0.75, 0.5, 0.8, 0.55, 0.7]
        for step in range(1, 40):
            base = 0.6 if t.inflight == 16 else after_raise
            t.observe(step, row(step_s=base + jitter[step % 6] - 0.6, wait=0.3 * base, staleness=1.2))
        return t

    kept = run(after_raise=0.66)  # 10 % slower on average, inside the step-to-step spread
    assert kept.decisions[0].new > 16 and not [d for d in kept.decisions if d.regime == "probe"]
    reverted = run(after_raise=1.5)  # far slower: taken back, and no raise above 16 again
    probes = [d for d in reverted.decisions if d.regime == "probe"]
    assert probes and probes[0].new == 16 and "slower after the raise" in probes[0].reason
    assert reverted.inflight == 16 and reverted.ceiling == 16


def test_readings_and_regimes():
    r = read_steps([row(step_s=2.0, wait=1.0, dropped=4, staleness=2.0), row(step_s=2.0, abandoned=1)], S, G)
    assert r.wait_share == pytest.approx(0.25) and r.waste_share == pytest.approx(12 / 44)
    assert classify(r, AutotuneConfig()) == "staleness"
    assert read_steps([{"loss": 1.0}], S, G) is None
    with pytest.raises(ValueError):
        AutotuneConfig(up_factor=1.0)


def test_callback_turns_the_live_knobs_and_logs_the_decision(tmp_path):
    knobs = LiveKnobs(64, 1024, 256, 1024)
    t = Autotuner(AutotuneConfig(), 64, 1024, G, SPS, S)
    lines = []
    cb = AutotuneCallback(t, knobs, say=lines.append)

    class State:
        is_world_process_zero = True
        global_step = 0

    state = State()
    logged = []
    for step in range(1, 5):
        state.global_step = step
        logs = row(staleness=3.9, dropped=8)
        cb.on_log(None, state, None, logs=logs)
        logged.append(logs)
    assert knobs.inflight < 48 and lines and lines[0].startswith("autotune: step 3: in flight 48 -> ")
    assert "staleness-bound" in lines[0] and "wasted 33.3%" in lines[0]
    assert all("autotune/inflight" in r for r in logged) and logged[2]["autotune/changes_total"] == 1.0
    assert logged[0]["autotune/changes_total"] == 2.0  # the step-0 clamps (64 -> 48 in flight, the queue bound)
    assert "autotune/changes_total" not in logged[1]
    assert cb.row_extra() == {} or cb.row_extra()["autotune"][0]["knob"] == "inflight"


def test_live_knobs_cross_a_pickle_check_and_clamp_to_bounds():
    knobs = LiveKnobs(4, 16, 64, 1024)
    copy = pickle.loads(pickle.dumps(knobs))  # TRL's picklability check: a detached copy
    knobs.inflight = 1000
    assert knobs.inflight == 64 and copy.inflight == 4
    knobs.queue_bound = 0
    assert knobs.queue_bound == 1
    with pytest.raises(ValueError):
        LiveKnobs(65, 16, 64, 1024)


def test_live_limiter_admits_under_a_cap_changed_while_it_runs():
    knobs = LiveKnobs(2, 16, 64, 1024)
    limiter = LiveLimiter(knobs, tick_s=0.01)
    peak = {"now": 0, "max": 0}

    async def request():
        await limiter.acquire()
        try:
            peak["now"] += 1
            peak["max"] = max(peak["max"], peak["now"])
            await asyncio.sleep(0.02)
        finally:
            peak["now"] -= 1
            limiter.release()

    async def main():
        ticker = asyncio.ensure_future(limiter.tick())
        await asyncio.gather(*(request() for _ in range(10)))
        assert peak["max"] == 2
        peak["max"] = 0
        tasks = [asyncio.ensure_future(request()) for _ in range(12)]
        await asyncio.sleep(0.005)
        knobs.inflight = 6  # raised while requests wait: admitted at the next tick or release
        await asyncio.gather(*tasks)
        assert peak["max"] == 6
        waiting = [asyncio.ensure_future(request()) for _ in range(8)]
        await asyncio.sleep(0.001)
        for task in waiting:
            task.cancel()  # cancelled waiters leave no place taken
        await asyncio.gather(*waiting, return_exceptions=True)
        ticker.cancel()
        assert limiter.active == 0 and limiter.waiting == 0

    asyncio.run(main())


def test_bounded_buffer_refuses_above_the_live_bound():
    import queue as queue_module

    class Q(list):
        def qsize(self):
            return len(self)

        def put_nowait(self, item):
            self.append(item)

    knobs = LiveKnobs(4, 2, 64, 1024)
    buffer = BoundedBuffer(Q(), knobs)
    buffer.put_nowait(1)
    buffer.put_nowait(2)
    with pytest.raises(queue_module.Full):
        buffer.put_nowait(3)
    knobs.queue_bound = 3
    buffer.put_nowait(3)
    assert buffer.qsize() == 3


def test_live_limiter_admits_nothing_while_its_gate_is_shut():
    knobs = LiveKnobs(4, 16, 64, 1024)
    full = {"now": True}
    limiter = LiveLimiter(knobs, tick_s=0.01, gate=lambda: not full["now"])

    async def main():
        ticker = asyncio.ensure_future(limiter.tick())
        task = asyncio.ensure_future(limiter.acquire())
        await asyncio.sleep(0.05)
        assert not task.done() and limiter.active == 0  # the queue is full: no request starts
        full["now"] = False
        await asyncio.wait_for(task, 1.0)
        assert limiter.active == 1
        ticker.cancel()

    asyncio.run(main())


def test_the_workers_admission_gate_counts_groups_waiting_to_be_scored():
    """TRL's score loop holds finished groups while the queue is full: they are samples of their time's version,
    so the gate counts them against the queue bound (else a high in-flight count overfills the pipeline at start)."""
    from grpo_lab.async_loop.rollout_worker import LabRolloutLoop

    loop = object.__new__(LabRolloutLoop)
    loop.num_generations = G
    loop._live_knobs = LiveKnobs(8, 16, 64, 1024)

    class Sized:
        def __init__(self, n):
            self.n = n

        def qsize(self):
            return self.n

    loop.rollout_buffer, loop._groups_to_score = Sized(4), Sized(0)
    assert loop._queue_has_room()
    loop._groups_to_score = Sized(2)  # 4 queued + 2 groups x 8 waiting = 20 >= 16
    assert not loop._queue_has_room()
    loop._live_knobs.queue_bound = 32
    assert loop._queue_has_room()
