"""The routing-policy seam: a policy registered by name is what the router (in-process or from its command line) and
the replay simulator run; an unknown name is one line."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter

import pytest
import requests

from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.replica_pool import ReplicaPool
from grpo_lab.serving.routing.policy import UNMATCHED, BasePolicy, Decision, RoutingPolicy
from grpo_lab.serving.routing.registry import POLICIES, make_policy
from grpo_lab.serving.sim.routing_sim import SimConfig, replay
from grpo_lab.serving.sim.trace import TraceConfig, generate_trace
from grpo_lab.serving.wire.metrics import Registry

from .conftest import served_after_same_prompt, wait_for
from .fake_vllm import FakeCluster, FakeVLLM
from .test_router_cli import free_port, start_fake
from .test_router_defects import complete, distinct_prompts, router_for, state


class LowestLoadedPolicy(BasePolicy):
    """The toy of docs/serving.md ("Adding a routing policy"): the candidate with the fewest completions in flight,
    the lowest number on a tie; prompts ignored. It also notes each choice, for the test to compare."""

    def __init__(self, num_replicas, config=None):
        super().__init__(num_replicas, config)
        self.chosen: list[int] = []

    def choose(self, hashes, candidates):
        decision = Decision(min(candidates, key=lambda r: (self.in_flight[r], r)))
        self.chosen.append(decision.replica)
        return decision


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(POLICIES, "lowest_loaded", f"{__name__}:LowestLoadedPolicy")
    return "lowest_loaded"


def test_every_registered_policy_is_a_routing_policy():
    for name in POLICIES:
        policy = make_policy(name, 2)
        assert isinstance(policy, RoutingPolicy), name
        decision = policy.route(policy.hashes_for(list(range(40)), "v1"), [0, 1])
        assert policy.in_flight[decision.replica] == 1
        policy.finish(decision, ok=True)
        policy.finish(decision, ok=True)
        assert policy.in_flight == [0, 0]


class RouteOnly:
    """Has `route` only: not a RoutingPolicy."""

    def __init__(self, num_replicas, config):
        pass

    def route(self, hashes, candidates):
        return Decision(candidates[0])


def test_a_factory_that_is_no_routing_policy_is_refused(monkeypatch):
    monkeypatch.setitem(POLICIES, "broken", f"{__name__}:RouteOnly")
    lacking = r"'broken'.* lacks \['config', 'in_flight', 'counts', 'num_blocks', 'hashes_for', 'finish',"
    with pytest.raises(TypeError, match=lacking):
        make_policy("broken", 2)


def test_the_pool_takes_the_policy_it_is_given(toy_registered):
    config = RouterConfig(replicas=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert type(ReplicaPool(config, None, Registry()).policy).__name__ == "PrefixAffinityPolicy"
    toy = LowestLoadedPolicy(1)
    pool = ReplicaPool(config, None, Registry(), policy=toy)
    assert pool.policy is toy and toy.in_flight == [0, 0]  # grown to the membership
    named = ReplicaPool(RouterConfig(replicas=config.replicas, routing_policy=toy_registered), None, Registry())
    assert isinstance(named.policy, LowestLoadedPolicy)


def test_unknown_policy_name_is_one_clear_error():
    with pytest.raises(ValueError, match=r"^unknown routing policy 'nope': choose one of prefix, "):
        RouterConfig(replicas=["http://127.0.0.1:1"], routing_policy="nope")


def test_the_router_follows_a_registered_toy_policy(token, toy_registered):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, b, routing_policy=toy_registered) as router:
        policy = router.router.pool.policy
        assert isinstance(policy, LowestLoadedPolicy)
        for prompt in distinct_prompts(6):  # one at a time: the toy always picks replica 0 (prefix would alternate)
            assert complete(router.url, prompt).status_code == 200
        assert policy.chosen == [0] * 6
        assert (a.served, b.served) == (6, 0)
        a.completion_delay_s = b.completion_delay_s = 0.3
        replies = [None] * 4

        def send(i):
            replies[i] = complete(router.url, distinct_prompts(4)[i], seed=i)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r.status_code == 200 for r in replies)
        assert Counter(policy.chosen) == {0: a.served, 1: b.served}  # every completion went where the toy chose
        assert b.served >= 1  # concurrent: the least loaded was replica 1 at least once
        assert state(router.url)["routing"][UNMATCHED] == 10


def test_the_replay_runs_a_registered_toy_policy(toy_registered):
    trace = generate_trace(TraceConfig(num_prompts=20, num_groups=20, seed=1))
    toy = replay(trace, SimConfig(num_replicas=2, max_in_flight=16), toy_registered)
    prefix = replay(trace, SimConfig(num_replicas=2, max_in_flight=16))
    assert toy.requests == prefix.requests == 160 and toy.kinds[UNMATCHED] == 160
    assert toy.cached_tokens < prefix.cached_tokens  # prompts ignored: groups split over the replicas


def _router_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_lab.serving.router", *args], capture_output=True, text=True,
                          timeout=60)


def test_unknown_routing_policy_flag_is_one_line_and_exit_2():
    done = _router_cli("--replica", "http://127.0.0.1:9", "--routing-policy", "nope")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "unknown routing policy 'nope': choose one of prefix" in done.stderr
    helped = _router_cli("--help")
    assert "--routing-policy" in helped.stdout and "round_robin" in helped.stdout


def test_routing_policy_flag_chooses_the_policy(token, tmp_path):
    """The same prompt 8 times: prefix affinity keeps it on one replica, `--routing-policy round_robin` alternates."""
    fake = start_fake(token, "0", "0")
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    router = None
    try:
        ports = fake.stdout.readline().split()[1:]
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "grpo_lab.serving.router", "--port", str(port), "--api-key-file", str(token_file),
             "--health-interval", "0.2", "--routing-policy", "round_robin",
             *sum((["--replica", f"http://127.0.0.1:{p}"] for p in ports), [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"

        def both_in_service():
            try:
                replicas = requests.get(url + "/router/state", timeout=2).json()["replicas"]
            except requests.RequestException:
                return False
            return [r["state"] for r in replicas] == ["in_service"] * 2

        wait_for(both_in_service, 30, "the router and both fake replicas")
        served = served_after_same_prompt(url, ports, token)
        assert served == [4, 4]
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=10)
        fake.terminate()
        fake.wait(timeout=10)
