"""Per-try deadlines: a completion stuck on a replica that still answers /health is hedged on another replica after a
deadline derived from recent latencies, the first answer wins, and a hung replica costs about one per-try deadline
instead of the whole upstream deadline."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import requests

from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.routing.per_try import PerTryConfig, PerTryDeadlines, size_class
from grpo_lab.serving.wire.metrics import parse_text

from .conftest import TOKEN_ENV, metric
from .fake_vllm import FakeCluster, FakeVLLM
from .test_router_defects import complete, distinct_prompts, load, router_for, state

FLOOR_S = 0.5
UPSTREAM_S = 30.0


def test_deadline_is_a_floored_capped_multiple_of_a_recent_quantile():
    c = PerTryConfig(quantile=0.9, factor=3.0, floor_s=0.5, cap_s=10.0, initial_s=4.0, min_samples=5, window=10)
    d = PerTryDeadlines(c)
    assert d.deadline_s(16) == 4.0  # nothing known yet (start-up, a router restart): the initial deadline
    for s in (0.1, 1.0, 0.1):
        d.observe(16, s)
    assert d.deadline_s(16) == 4.0  # fewer than min_samples, all fast: never shorter than the initial deadline
    d.observe(16, 2.0)
    assert d.deadline_s(16) == pytest.approx(6.0)  # ... but the slowest of them x the factor when that is longer
    assert d.deadline_s(32) == 4.0  # another size class knows nothing yet
    d = PerTryDeadlines(c)
    for s in (0.1,) * 4:
        d.observe(16, s)
    d.observe(16, 0.1)
    assert d.deadline_s(16) == 0.5  # 3 x 0.1 is under the floor
    for s in [1.0] * 10:
        d.observe(16, s)
    assert d.deadline_s(16) == pytest.approx(3.0)  # the window holds the last 10: quantile 1.0 s
    for s in [9.0] * 10:
        d.observe(16, s)
    assert d.deadline_s(16) == 10.0  # capped
    assert d.deadline_s(3000) == 4.0  # another size class has its own samples (none yet)
    assert size_class(16) == 16 and size_class(17) == 32 and size_class(None) == 0 and size_class(True) == 0
    assert set(d.snapshot()) == {"16"}
    with pytest.raises(ValueError):
        PerTryConfig(floor_s=5, cap_s=1)
    with pytest.raises(ValueError):
        PerTryConfig(initial_s=0)
    assert PerTryDeadlines(PerTryConfig(cap_s=10.0)).deadline_s(16) == 10.0  # the initial deadline is capped too


def warm(url: str, n: int = 24) -> None:
    """Enough fast completions for the quantile to be trusted (min_samples 20 by default)."""
    for i in range(n):
        assert complete(url, [5, 6, 7] * 14, seed=i).status_code == 200


def hedge_metrics(url: str) -> dict:
    values = parse_text(requests.get(url + "/metrics", timeout=5).text)
    return {k: v for k, v in values.items() if "hedge" in k}


def complete_at_once(url: str, model: str, n: int) -> list:
    """`n` completions of distinct prompts sent together (a thread each); their replies, in prompt order."""
    replies = [None] * n
    threads = [threading.Thread(target=lambda i=i, p=p: replies.__setitem__(
        i, complete(url, p, model=model, seed=i, timeout=UPSTREAM_S + 5))) for i, p in enumerate(distinct_prompts(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(UPSTREAM_S + 10)
    return replies


def test_hung_replica_costs_one_per_try_deadline_not_the_upstream_deadline(token):
    healthy, hung = FakeVLLM(), FakeVLLM()
    healthy.completion_delay_s = hung.completion_delay_s = 0.02
    per_try = PerTryConfig(floor_s=FLOOR_S, cap_s=10.0)
    with FakeCluster(healthy, hung), router_for(healthy, hung, health_interval_s=0.1, upstream_timeout_s=UPSTREAM_S,
                                                per_try=per_try) as router:
        assert load(router.url, "v1").status_code == 200  # a hedge goes only to a replica holding the adapter
        warm(router.url)
        deadline = state(router.url)["hedging"]["per_try_deadline_s"]["0"]["deadline_s"]
        assert deadline == FLOOR_S  # fast completions: the floor
        hung.hang = {"/v1/completions"}  # still answers /health, /v1/models and loads
        t0 = time.monotonic()
        replies = complete_at_once(router.url, "v1", 6)
        took = time.monotonic() - t0
        print(f"6 completions, some first sent to a hung replica: {took:.2f} s (per-try deadline {deadline} s, "
              f"upstream deadline {UPSTREAM_S} s)")
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        assert all(r.json()["port"] == healthy.port for r in replies)
        assert took < FLOOR_S + 2.0, took  # about one per-try deadline, far from the 30 s upstream deadline
        hedges = metric(router.url, "grpo_router_hedges_total")
        assert hedges >= 1  # unmatched prompts alternate: some went to the hung replica first
        text = requests.get(router.url + "/metrics", timeout=5).text
        assert f'grpo_router_hedges_total{{replica="{hung.url}"}} {int(hedges)}' in text
        assert f'grpo_router_hedge_wins_total{{winner="hedge"}} {int(hedges)}' in text
        assert state(router.url)["hedging"]["won_by_hedge"] == hedges
        assert [r["state"] for r in state(router.url)["replicas"]] == ["in_service", "in_service"]  # /health is fine
        time.sleep(0.3)
        assert state(router.url)["hedging"]["in_flight"] == 0  # the losers were cancelled, their claims released
        assert [r["in_flight"] for r in state(router.url)["replicas"]] == [0, 0]


def test_a_slow_first_try_loses_to_its_hedge_and_a_fast_one_is_never_hedged(token):
    slow, fast = FakeVLLM(), FakeVLLM()
    per_try = PerTryConfig(floor_s=FLOOR_S, cap_s=10.0)
    with FakeCluster(slow, fast), router_for(slow, fast, per_try=per_try) as router:
        warm(router.url)
        assert metric(router.url, "grpo_router_hedges_total") == 0  # fast completions are never hedged
        slow.completion_delay_s = 3.0
        t0 = time.monotonic()
        replies = [complete(router.url, p, seed=i) for i, p in enumerate(distinct_prompts(4))]
        assert [r.status_code for r in replies] == [200] * 4
        assert all(r.json()["port"] == fast.port for r in replies)  # a slow first try always lost
        hedges = metric(router.url, "grpo_router_hedges_total")
        assert 1 <= hedges and time.monotonic() - t0 < hedges * FLOOR_S + 1.5
        assert state(router.url)["hedging"]["won_by_hedge"] == hedges


def owned_by(url: str, fake: FakeVLLM) -> list[int]:
    """A prompt that `fake` has served, so prefix affinity sends it there again."""
    for i, prompt in enumerate(distinct_prompts(20)):
        if complete(url, prompt, seed=i).json()["port"] == fake.port:
            return prompt
    raise AssertionError("no prompt reached the replica")


def test_no_hedge_while_paused_nor_when_disabled(token):
    healthy, hung = FakeVLLM(), FakeVLLM()
    with FakeCluster(healthy, hung), router_for(healthy, hung, per_try=PerTryConfig(floor_s=FLOOR_S)) as router:
        warm(router.url)
        prompt = owned_by(router.url, hung)
        hung.hang = {"/v1/completions"}
        assert requests.post(router.url + "/pause", params={"mode": "keep"}, timeout=5).status_code == 200
        replies: list = []
        sender = threading.Thread(target=lambda: replies.append(complete(router.url, prompt, seed=99)))
        sender.start()  # affinity sends it to the hung replica
        time.sleep(3 * FLOOR_S)
        assert metric(router.url, "grpo_router_hedges_total") == 0  # a pause holds every completion: no hedge
        t0 = time.monotonic()
        assert requests.post(router.url + "/resume", timeout=5).status_code == 200
        sender.join(10)
        assert [r.status_code for r in replies] == [200] and replies[0].json()["port"] == healthy.port
        assert time.monotonic() - t0 >= FLOOR_S * 0.9  # the per-try deadline counted from the resume
        assert metric(router.url, "grpo_router_hedges_total") == 1
    healthy, hung = FakeVLLM(), FakeVLLM()
    with FakeCluster(healthy, hung), router_for(healthy, hung, upstream_timeout_s=2,
                                                per_try=PerTryConfig(enabled=False, floor_s=0.1)) as router:
        warm(router.url)
        prompt = owned_by(router.url, hung)
        hung.hang = {"/v1/completions"}
        assert complete(router.url, prompt, seed=99).status_code == 504  # without hedging: the whole deadline
        assert metric(router.url, "grpo_router_hedges_total") == 0


@contextlib.contextmanager
def fake_replica(delay_s: float, token: str):
    """`python -m grpo_lab.serving.replicas.fake_replica` on a free loopback port (a `delay_s` far beyond the test:
    a replica that answers /health, /server_info and /v1/models but never a completion); stopped by its pid."""
    proc = subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.replicas.fake_replica", "--ports", "0",
                             "--delay-s", str(delay_s), "--jitter", "0"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "VLLM_API_KEY": token})
    try:
        ready = proc.stdout.readline().split()
        assert ready[:1] == ["READY"], ready
        yield f"http://127.0.0.1:{ready[1]}"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_replica_hung_from_the_start_costs_the_initial_deadline_at_start_up_and_after_a_router_restart(token):
    """Issue 43: with no latency known yet (a fresh router, or one restarted), the per-try deadline was the cap (300
    s), so a replica hung from the start cost each completion sent there the whole upstream deadline."""
    per_try = PerTryConfig(floor_s=FLOOR_S, initial_s=2.0)
    with fake_replica(0.05, token) as healthy, fake_replica(1e6, token) as hung:
        for life in ("start-up", "after a restart"):
            config = RouterConfig(replicas=[healthy, hung], port=0, api_key_env=TOKEN_ENV, health_interval_s=0.2,
                                  upstream_timeout_s=UPSTREAM_S, per_try=per_try)
            handle = start_router(config)
            try:
                handle.wait_ready(timeout=10)
                assert state(handle.url)["hedging"]["per_try_deadline_s"] == {}  # nothing learnt yet
                replies = complete_at_once(handle.url, "fake", 6)
                assert [r.status_code for r in replies] == [200] * 6, (life, [r.text for r in replies])
                text = requests.get(handle.url + "/metrics", timeout=5).text
                assert f'grpo_router_hedges_total{{replica="{hung}"}}' in text, life  # the hung one was hedged
                assert metric(handle.url, "grpo_router_hedge_wins_total") == metric(handle.url,
                                                                                    "grpo_router_hedges_total")
            finally:
                handle.stop()
