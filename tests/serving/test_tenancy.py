"""Runs sharing one router (`tenancy`, `fair_queue`, `tenant_api`): the rules alone, then against in-process fake
replicas: one run's token can load, unload and complete only its own adapters (vLLM-style 403/404 otherwise), slots
beyond a run's share are a 409 and never an eviction, a silent run is reclaimed without touching the others, and no
token ever appears in an answer or a log line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest
import requests

from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.tenancy.fair_queue import ClientGone, FairQueue
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.tenancy.runs import RunRegistry, TenancyConfig, TenancyError, check_run_name, upstream_name

from .conftest import TOKEN_ENV, send_then_hang_up
from .fake_vllm import FakeCluster, FakeVLLM

ADMIN_ENV = "GRPO_LAB_TEST_POOL_ADMIN_KEY"


# -- the registry: names, slot shares, tokens, leases ------------------------------------------------------------------
def test_run_names_cannot_reach_into_another_namespace():
    assert check_run_name("sweep-a.lr_3e-3") == "sweep-a.lr_3e-3"
    for bad in ("", "a--b", "-a", "a/b", "a b", "x" * 49, None, 3):
        with pytest.raises(ValueError):
            check_run_name(bad)
    assert upstream_name("a", "trl-policy-v3") == "a--trl-policy-v3"


def test_slot_shares_are_refused_beyond_capacity_and_freed_on_removal():
    registry = RunRegistry(TenancyConfig())
    capacity = 2 * max_loras_for(4)
    a, token_a = registry.register("a", 4, 1.0, capacity)
    registry.register("b", 4, 2.0, capacity)
    assert a.slots == max_loras_for(4) and registry.slots_taken() == capacity
    with pytest.raises(TenancyError) as refused:
        registry.register("c", 0, 1.0, capacity)
    assert refused.value.status == 409 and "needs 3 adapter slots" in str(refused.value)
    with pytest.raises(TenancyError) as taken:
        registry.register("a", 4, 1.0, capacity)
    assert taken.value.status == 409 and "already registered" in str(taken.value)
    with pytest.raises(TenancyError):
        registry.register("z", 4, 1.0, None)  # no replica yet: the slots are unknown
    for weight in (0, -1, float("inf"), 101, True, "1"):
        with pytest.raises(TenancyError):
            registry.register("w", 0, weight, capacity + 10)
    registry.unregister("b")
    registry.register("c", 0, 1.0, capacity)  # b's slots went back to the pool
    # a replaced run (a resume) keeps its record and namespace; the old token stops working
    again, token_again = registry.register("a", 4, 1.0, capacity, replace=True)
    assert again is a and token_again != token_a
    assert registry.authenticate(token_a) is None and registry.authenticate(token_again) is a
    assert registry.authenticate("") is None and registry.authenticate("grpo-run-guess") is None
    assert token_again not in repr(a) and token_again not in str(a.describe())  # only its digest is kept


def test_a_lease_lapses_only_for_a_silent_run_with_nothing_in_flight():
    registry = RunRegistry(TenancyConfig(lease_s=0.05))
    a, _ = registry.register("a", 0, 1.0, 10)
    b, _ = registry.register("b", 0, 1.0, 10)
    c, _ = registry.register("c", 0, 1.0, 10)
    time.sleep(0.1)
    b.touch()
    assert [r.name for r in registry.lapsed(lambda name: name == "c")] == ["a"]  # c still has work in flight


# -- the fair queue ------------------------------------------------------------------------------------------------
def _run(coroutine):
    return asyncio.new_event_loop().run_until_complete(coroutine)


async def _drain(queue: FairQueue, demand: dict[str, int], hold_s: float = 0.0) -> list[str]:
    """Queue `demand[run]` completions of each run at once; returns the runs in the order they were granted."""
    order: list[str] = []

    async def one(run):
        async with queue.slot(run):
            order.append(run)
            await asyncio.sleep(hold_s)

    await asyncio.gather(*(one(run) for run, n in demand.items() for _ in range(n)))
    return order


def test_weighted_shares_while_every_run_is_backlogged():
    queue = FairQueue(lambda: 1)
    queue.set_weight("heavy", 3.0)
    queue.set_weight("light", 1.0)
    order = _run(_drain(queue, {"heavy": 60, "light": 60}))
    first = order[:40]  # both backlogged: 3 to 1
    assert first.count("heavy") == 30 and first.count("light") == 10, first
    assert queue.shares["heavy"].granted == queue.shares["light"].granted == 60


def test_a_run_with_one_request_is_not_starved_by_a_run_with_many():
    async def scenario():
        queue = FairQueue(lambda: 2)
        order: list[str] = []

        async def one(run):
            async with queue.slot(run):
                order.append(run)
                await asyncio.sleep(0.001)

        flood = [asyncio.ensure_future(one("flood")) for _ in range(200)]
        await asyncio.sleep(0.005)  # the flood is queued and running first
        before = len(order)
        await one("small")
        position = order.index("small") - before
        await asyncio.gather(*flood)
        return position, order

    position, order = _run(scenario())
    assert position <= 2, order[:10]  # within about one completion of the other backlogged run, not after 200


def test_cost_counts_tokens_and_an_idle_run_banks_no_credit():
    async def scenario():
        queue = FairQueue(lambda: 1)
        async with queue.slot("early", cost=1000):  # alone: served at once, its pass moves far ahead
            pass
        order: list[str] = []

        async def one(run, cost):
            async with queue.slot(run, cost=cost):
                order.append(run)

        holder = asyncio.ensure_future(one("hold", 1))
        await asyncio.sleep(0)
        await asyncio.gather(holder, *(one("late", 1) for _ in range(3)), one("early", 1))
        return order

    order = _run(scenario())
    assert order.index("early") == len(order) - 1  # it used 1000 tokens' worth: the newcomer's 1-token asks go first


def test_a_paused_run_waits_while_others_go_on_and_a_forgotten_run_fails_its_waiters():
    async def scenario():
        queue = FairQueue(lambda: 1)
        queue.set_paused("p", True)
        order: list[str] = []

        async def one(run):
            async with queue.slot(run):
                order.append(run)

        paused = asyncio.ensure_future(one("p"))
        await asyncio.gather(*(one("q") for _ in range(3)))
        assert order == ["q", "q", "q"] and not paused.done() and queue.queued("p") == 1
        queue.set_paused("p", False)
        await paused
        queue.set_paused("gone", True)
        waiting = asyncio.ensure_future(one("gone"))
        await asyncio.sleep(0)
        queue.forget("gone")
        with pytest.raises(ClientGone):
            await waiting
        assert queue.in_flight == 0 and not queue.busy("gone")
        # a paused run's waiter whose client hung up is never granted, yet does not keep the run busy
        hung_up = asyncio.ensure_future(queue.slot("killed", gone=lambda: True).__aenter__())
        queue.set_paused("killed", True)
        await asyncio.sleep(0)
        assert not queue.busy("killed") and queue.queued("killed") == 0
        with pytest.raises(ClientGone):
            await hung_up
        # a wait that times out leaves no trace: nothing queued, nothing held
        async with queue.slot("r"):
            with pytest.raises(asyncio.TimeoutError):
                async with queue.slot("s", timeout_s=0.01):
                    pass
        assert queue.in_flight == 0 and queue.queued() == 0
        return order

    assert _run(scenario())[-1] == "p"


# -- the router with tenancy, against fake replicas -----------------------------------------------------------------
@contextlib.contextmanager
def pool(*fakes: FakeVLLM, **tenancy):
    settings = dict(replicas=[f.url for f in fakes], port=0, api_key_env=TOKEN_ENV, health_interval_s=0.05,
                    health_timeout_s=2, load_retry_deadline_s=1, control_timeout_s=5, upstream_timeout_s=20,
                    admin_api_key_env=ADMIN_ENV, unload_drain_timeout_s=2,
                    tenancy=TenancyConfig(**{"max_in_flight_per_replica": 2, **tenancy}))
    handle = start_router(RouterConfig(**settings))
    try:
        handle.wait_ready(timeout=10)
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def admin_key(monkeypatch):
    key = "admin-" + "k" * 40
    monkeypatch.setenv(ADMIN_ENV, key)
    return key


class Client:
    """Requests with one credential; every answer is kept so the test can check no token appears in any."""

    answers: list[str] = []

    def __init__(self, url: str, key: str | None):
        self.url, self.headers = url, ({"Authorization": f"Bearer {key}"} if key else {})

    def call(self, method: str, path: str, **body) -> requests.Response:
        answer = requests.request(method, self.url + path, json=body if body else None, headers=self.headers,
                                  timeout=30)
        Client.answers.append(f"{answer.status_code} {answer.headers} {answer.text}")
        return answer

    def load(self, name, path="/adapters/x"):
        return self.call("POST", "/v1/load_lora_adapter", lora_name=name, lora_path=path)

    def unload(self, name):
        return self.call("POST", "/v1/unload_lora_adapter", lora_name=name)

    def complete(self, model, prompt=(1, 2, 3)):
        return self.call("POST", "/v1/completions", model=model, prompt=list(prompt), max_tokens=1)

    def models(self) -> list[str]:
        return [e["id"] for e in self.call("GET", "/v1/models").json()["data"]]


def _wait_until(predicate, timeout: float = 10.0) -> None:
    """Unloads leave the replicas after their drain, a moment after the 200."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _error(answer: requests.Response) -> dict:
    body = answer.json()["error"]
    assert set(body) >= {"message", "type", "code"} and body["code"] == answer.status_code  # vLLM's error shape
    return body


def test_a_run_loads_unloads_and_completes_only_its_own_adapters(token, admin_key, log_lines, caplog):
    caplog.set_level(logging.DEBUG)
    a, b = FakeVLLM(max_loras=2 * max_loras_for(2)), FakeVLLM(max_loras=2 * max_loras_for(2))
    Client.answers = []
    with FakeCluster(a, b), pool(a, b) as router:
        admin = Client(router.url, admin_key)
        registered = admin.call("POST", "/router/runs", name="alice", max_staleness=2)
        assert registered.status_code == 201, registered.text
        alice_token = registered.json()["token"]
        bob_token = router.register_run("bob", max_staleness=2)["token"]  # the Python equivalent
        third = admin.call("POST", "/router/runs", name="carol", max_staleness=0)
        assert third.status_code == 409 and "adapter slots" in _error(third)["message"]  # the pool is shared out
        alice, bob = Client(router.url, alice_token), Client(router.url, bob_token)

        # the same TRL name in two runs: no collision, each in its own namespace upstream
        assert alice.load("trl-policy-v1").status_code == 200
        assert bob.load("trl-policy-v1").status_code == 200
        assert alice.load("trl-policy-v2").status_code == 200
        for fake in (a, b):
            assert set(fake.adapters) == {"alice--trl-policy-v1", "alice--trl-policy-v2", "bob--trl-policy-v1"}
        assert sorted(bob.models()) == ["m", "trl-policy-v1"]  # only its own, by its own names
        assert sorted(alice.models()) == ["m", "trl-policy-v1", "trl-policy-v2"]

        # another run's adapter cannot be unloaded, completed or even named
        refused = bob.unload("alice--trl-policy-v1")
        assert refused.status_code == 403 and _error(refused)["type"] == "Forbidden"
        missing = bob.unload("trl-policy-v2")  # alice's name: in bob's namespace it does not exist
        assert missing.status_code == 404
        assert bob.complete("alice--trl-policy-v2").status_code == 403
        unknown = bob.complete("trl-policy-v2")
        assert unknown.status_code == 404 and _error(unknown) == {
            **_error(unknown), "type": "NotFoundError", "message": "The model `trl-policy-v2` does not exist."}
        assert bob.load("alice--trl-policy-v9").status_code == 403  # nor loaded into
        for fake in (a, b):
            assert "alice--trl-policy-v2" in fake.adapters

        # its own: answered under its own name; the base model is allowed by default
        done = alice.complete("trl-policy-v2")
        assert done.status_code == 200 and done.json()["model"] == "trl-policy-v2"
        assert bob.complete("m").status_code == 200
        assert bob.unload("trl-policy-v1").status_code == 200
        _wait_until(lambda: all(set(f.adapters) == {"alice--trl-policy-v1", "alice--trl-policy-v2"} for f in (a, b)))

        # the admin key manages runs but holds no adapters; strangers get 401; a run sees only its own run
        assert admin.load("trl-policy-v7").status_code == 403
        assert admin.complete("m").status_code == 403
        assert Client(router.url, None).complete("m").status_code == 401
        assert Client(router.url, "grpo-run-guess").call("GET", "/v1/models").status_code == 401
        assert bob.call("GET", "/router/runs").status_code == 403
        assert bob.call("GET", "/router/runs/alice").status_code == 403
        assert bob.call("DELETE", "/router/runs/alice").status_code == 403
        assert bob.call("POST", "/router/runs", name="mallory").status_code == 403
        assert bob.call("GET", "/router/runs/bob").status_code == 200
        assert Client(router.url, None).call("GET", "/health").status_code == 200
        assert "alice" not in bob.call("GET", "/metrics").text.replace("bob", "")
        listing = admin.call("GET", "/router/runs").json()
        assert {r["name"] for r in listing["runs"]} == {"alice", "bob"}
        state = bob.call("GET", "/router/state").json()
        assert state["run"]["name"] == "bob" and state["live_adapters"] == []
        assert all(entry["by"] == "run" and entry["run"] == "bob" for entry in admin.call(
            "GET", "/router/state").json()["unloads"])  # nobody but bob ever unloaded one of bob's adapters

    secrets = (alice_token, bob_token, admin_key, token)
    logged = log_lines + [r.getMessage() for r in caplog.records]
    for text in Client.answers[1:] + logged:  # the first answer is the registration, which hands alice her token
        assert not any(secret in text for secret in secrets), text[:300]


def test_a_load_beyond_the_share_is_a_409_and_never_an_eviction(token, admin_key):
    a = FakeVLLM(max_loras=2 * max_loras_for(1))
    with FakeCluster(a), pool(a) as router:
        alice = Client(router.url, router.register_run("alice", max_staleness=1)["token"])
        bob = Client(router.url, router.register_run("bob", max_staleness=1)["token"])
        for v in range(max_loras_for(1)):
            assert bob.load(f"trl-policy-v{v + 1}").status_code == 200
        assert alice.load("trl-policy-v1").status_code == 200
        bob_held = {n for n in a.adapters if n.startswith("bob--")}
        over = bob.load("trl-policy-v99")
        assert over.status_code == 409
        message = _error(over)["message"]
        assert f"holds {max_loras_for(1)} of its {max_loras_for(1)} adapter slots" in message and "alice" not in message
        assert {n for n in a.adapters if n.startswith("bob--")} == bob_held and "alice--trl-policy-v1" in a.adapters
        assert bob.unload("trl-policy-v1").status_code == 200  # TRL's order: unload the oldest, then load
        assert bob.load("trl-policy-v99").status_code == 200


def test_a_silent_run_is_reclaimed_after_its_lease_and_the_others_are_untouched(token, admin_key):
    a, b = FakeVLLM(max_loras=14), FakeVLLM(max_loras=14)
    with FakeCluster(a, b), pool(a, b, lease_s=0.6) as router:
        dead = Client(router.url, router.register_run("dead", max_staleness=1)["token"])
        alive = Client(router.url, router.register_run("alive", max_staleness=1)["token"])
        assert dead.load("trl-policy-v1").status_code == 200 and alive.load("trl-policy-v1").status_code == 200
        deadline = time.monotonic() + 10
        while any("dead--trl-policy-v1" in f.adapters for f in (a, b)) and time.monotonic() < deadline:
            alive.call("GET", "/router/runs/alive")  # alive keeps its lease; dead was kill -9'd
            time.sleep(0.1)
        for fake in (a, b):
            assert set(fake.adapters) == {"alive--trl-policy-v1"}
        assert dead.call("GET", "/v1/models").status_code == 401  # its token went with it
        assert [r["name"] for r in router.runs()] == ["alive"]
        unloads = requests.get(router.url + "/router/state", timeout=5,
                               headers={"Authorization": f"Bearer {admin_key}"}).json()["unloads"]
        assert [(u["adapter"], u["by"]) for u in unloads] == [("dead--trl-policy-v1", "lease")]
        assert alive.complete("trl-policy-v1").status_code == 200
        # the freed slots can be taken by a new run
        assert router.register_run("next", max_staleness=1)["slots"] == max_loras_for(1)


def test_a_run_killed_mid_sync_with_completions_queued_and_running_is_still_reclaimed(token, admin_key):
    """TRL pauses its server around each adapter sync: a trainer kill -9'd then leaves a paused run with a completion
    queued (never granted while paused) and, from its rollout worker, one running. Neither may keep it alive."""
    a = FakeVLLM(max_loras=14)
    a.completion_delay_s = 60
    with FakeCluster(a), pool(a, lease_s=0.6, max_in_flight_per_replica=1) as router:
        dead = Client(router.url, router.register_run("dead", max_staleness=1)["token"])
        assert dead.load("trl-policy-v1").status_code == 200
        body = {"model": "trl-policy-v1", "prompt": [1, 2, 3], "max_tokens": 4}
        auth = {"Authorization": dead.headers["Authorization"]}

        def mid_sync():  # a rollout runs on the replica; then the trainer pauses and one more rollout queues
            assert dead.call("POST", "/pause?mode=keep").status_code == 200
            send_then_hang_up(router.port, "/v1/completions", body, auth)

        send_then_hang_up(router.port, "/v1/completions", body, auth, before_hang_up=mid_sync)
        t0 = time.monotonic()
        _wait_until(lambda: not router.runs(), timeout=10)
        assert time.monotonic() - t0 < 10 and "dead--trl-policy-v1" not in a.adapters
        unloads = requests.get(router.url + "/router/state", timeout=5,
                               headers={"Authorization": f"Bearer {admin_key}"}).json()["unloads"]
        assert [(u["adapter"], u["by"]) for u in unloads] == [("dead--trl-policy-v1", "lease")]


def test_completions_of_a_flooding_run_do_not_starve_another(token, admin_key):
    a = FakeVLLM(max_loras=14)
    a.completion_delay_s = 0.1
    with FakeCluster(a), pool(a, max_in_flight_per_replica=1) as router:
        flood = Client(router.url, router.register_run("flood", max_staleness=0)["token"])
        small = Client(router.url, router.register_run("small", max_staleness=0)["token"])
        threads = [threading.Thread(target=flood.complete, args=("m",)) for _ in range(40)]
        for t in threads:
            t.start()
        time.sleep(0.2)  # the flood is queued at the router
        t0 = time.monotonic()
        assert small.complete("m").status_code == 200
        waited = time.monotonic() - t0
        for t in threads:
            t.join(30)
        # about one completion (0.1 s), not the flood's 40 (4 s); a quarter of the flood leaves room for a busy machine
        assert waited < 10 * a.completion_delay_s, waited
        metrics = requests.get(router.url + "/metrics", timeout=5, headers=small.headers).text
        assert 'grpo_router_run_completions_total{run="small",status="200"} 1' in metrics
        assert 'run="flood"' not in metrics


def test_a_resumed_run_keeps_its_namespace_and_locks_the_old_process_out(token, admin_key):
    a = FakeVLLM(max_loras=14)
    with FakeCluster(a), pool(a, allow_base_model=False) as router:
        old = Client(router.url, router.register_run("sweep", max_staleness=1)["token"])
        other = Client(router.url, router.register_run("other", max_staleness=1)["token"])
        assert old.load("trl-policy-v4").status_code == 200 and other.load("trl-policy-v4").status_code == 200
        new = Client(router.url, router.register_run("sweep", max_staleness=1, replace=True)["token"])
        assert old.call("GET", "/v1/models").status_code == 401  # the killed process's token no longer works
        assert new.models() == ["m", "trl-policy-v4"]  # what the resumed trainer reconciles: its own, nobody else's
        assert new.unload("trl-policy-v4").status_code == 200 and new.load("trl-policy-v5").status_code == 200
        _wait_until(lambda: set(a.adapters) == {"other--trl-policy-v4", "sweep--trl-policy-v5"})
        base = new.complete("m")  # this pool serves runs their adapters only
        assert base.status_code == 403 and _error(base)["param"] == "model"
        assert new.complete("trl-policy-v5").status_code == 200


def test_places_go_to_replicas_with_room_so_affinity_idles_none(token, admin_key):
    a, b = FakeVLLM(max_loras=14), FakeVLLM(max_loras=14)
    a.completion_delay_s = b.completion_delay_s = 0.2
    with FakeCluster(a, b), pool(a, b, max_in_flight_per_replica=1) as router:
        run = Client(router.url, router.register_run("r", max_staleness=0)["token"])
        prompt = list(range(1, 70))  # one long shared prefix: affinity alone would send all to one replica
        threads = [threading.Thread(target=run.complete, args=("m", prompt)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert a.served >= 2 and b.served >= 2, (a.served, b.served)
