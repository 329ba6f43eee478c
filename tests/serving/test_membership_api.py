"""The membership endpoints against in-process fake replicas: who may change the membership, what a removal does to
completions still running, replica numbers reused, the admin key never echoed or logged."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from aiohttp.test_utils import make_mocked_request

from grpo_lab.serving.router.admin_api import AdminAPI
from grpo_lab.serving.router.config import RouterConfig

from .conftest import metric
from .fake_vllm import FakeCluster, FakeVLLM
from .test_router_defects import complete, router_for, state

ADMIN_ENV, CLIENT_ENV = "GRPO_LAB_TEST_ADMIN_KEY", "GRPO_LAB_TEST_CLIENT_KEY"


def add(url: str, replica: str, key: str | None = None, **fields) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(url + "/router/replicas", json={"url": replica, **fields}, headers=headers, timeout=30)


def remove(url: str, replica: str, key: str | None = None, **fields) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.delete(url + "/router/replicas", json={"url": replica, **fields}, headers=headers, timeout=30)


def test_loopback_router_without_admin_key_takes_membership_changes(token):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a) as router:
        reply = add(router.url, b.url + "/", wait_s=10)
        assert reply.status_code == 200 and reply.json()["state"] == "in_service", reply.text
        assert reply.json()["url"] == b.url and reply.json()["added"] is True
        assert add(router.url, b.url).json()["added"] is False  # already a member: nothing changes
        listed = requests.get(router.url + "/router/replicas", timeout=5).json()["replicas"]
        assert [r["url"] for r in listed] == [a.url, b.url]
        assert remove(router.url, b.url, drain_s=0).json()["state"] == "removed"
        assert remove(router.url, b.url).status_code == 404
        assert add(router.url, "ftp://x").status_code == 400
        assert add(router.url, b.url, wait_s="soon").status_code == 400
        assert requests.post(router.url + "/router/replicas", json={}, timeout=5).status_code == 400
        assert [r["url"] for r in state(router.url)["replicas"]] == [a.url]


def test_admin_key_guards_changes_and_is_never_echoed_or_logged(token, monkeypatch, log_lines):
    admin, client = "adm-" + token[-10:], "cli-" + token[-10:]
    monkeypatch.setenv(ADMIN_ENV, admin)
    monkeypatch.setenv(CLIENT_ENV, client)
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, admin_api_key_env=ADMIN_ENV, client_api_key_env=CLIENT_ENV) as router:
        answers = [add(router.url, b.url), add(router.url, b.url, client), add(router.url, b.url, "wrong"),
                   remove(router.url, a.url, client)]
        assert [r.status_code for r in answers] == [401] * 4
        assert [r["url"] for r in requests.get(router.url + "/router/replicas", timeout=5,
                                               headers={"Authorization": f"Bearer {client}"}).json()["replicas"]] \
            == [a.url]  # reading the members takes the client key, like /router/state
        assert requests.get(router.url + "/router/replicas", timeout=5).status_code == 401
        bad = add(router.url, f"http://{admin}@", admin)  # a key pasted by mistake comes back scrubbed
        answers += [bad, add(router.url, b.url, admin, wait_s=10), remove(router.url, "http://nowhere:1", admin)]
        assert [r.status_code for r in answers[-3:]] == [400, 200, 404]
        assert answers[-2].json()["state"] == "in_service"
    for text in [r.text for r in answers] + log_lines:
        assert admin not in text


def test_membership_changes_need_an_admin_key_off_loopback(monkeypatch):
    open_router = RouterConfig(replicas=["http://10.0.0.2:8001"], host="10.0.0.1", insecure=True)
    refusal = AdminAPI(None, open_router, None, None)._refusal(make_mocked_request("POST", "/router/replicas"))
    assert refusal.status == 403 and b"admin key" in refusal.body
    monkeypatch.setenv(ADMIN_ENV, "k")
    keyed = RouterConfig(replicas=["http://10.0.0.2:8001"], host="10.0.0.1", insecure=True,
                         admin_api_key_env=ADMIN_ENV)
    api = AdminAPI(None, keyed, keyed.read_admin_api_key(), None)
    assert api._refusal(make_mocked_request("POST", "/router/replicas",
                                            headers={"Authorization": "Bearer k"})) is None
    assert api._refusal(make_mocked_request("POST", "/router/replicas")).status == 401
    monkeypatch.setenv(ADMIN_ENV, "")
    with pytest.raises(ValueError, match="admin key"):
        keyed.read_admin_api_key()


@pytest.mark.parametrize("drain_s, finishes_on", [(5.0, "removed"), (0.0, "other")])
def test_completions_on_a_removed_replica_finish_there_or_are_resent(token, drain_s, finishes_on):
    kept, leaving = FakeVLLM(), FakeVLLM()
    leaving.completion_delay_s = 1.0
    with FakeCluster(kept, leaving), router_for(kept, leaving, health_interval_s=0.1) as router:
        assert complete(router.url, list(range(40))).json()["port"] == kept.port  # round robin: the next one ...
        replies: list = []
        sender = threading.Thread(target=lambda: replies.append(complete(router.url, list(range(1000, 1040)))))
        sender.start()  # ... goes to `leaving` and takes a second there
        deadline = time.monotonic() + 5
        while leaving.calls.get("/v1/completions", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert leaving.calls.get("/v1/completions", 0) == 1
        t0 = time.monotonic()
        gone = remove(router.url, leaving.url, drain_s=drain_s).json()
        sender.join(10)
        assert replies and replies[0].status_code == 200, replies
        port = replies[0].json()["port"]
        if finishes_on == "removed":  # a replica scaled down: its completion finished there
            assert gone["cut"] == 0 and port == leaving.port
            assert time.monotonic() - t0 < drain_s  # the removal returned once it had
        else:  # a replica that died: cut and re-sent
            assert gone["cut"] == 1 and port == kept.port
            assert 'reason="replica_down"' in requests.get(router.url + "/metrics", timeout=5).text
        assert all(r.status_code == 200 for r in [complete(router.url, [7] * 40, seed=s) for s in range(4)])
        assert leaving.calls.get("/v1/completions", 0) == 1  # nothing new reaches a removed replica


def test_replica_numbers_are_reused_once_free(token):
    a, b, c = FakeVLLM(), FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b, c), router_for(a) as router:
        for _ in range(3):
            for fake in (b, c):
                assert router.add_replica(fake.url, wait_s=10)["state"] == "in_service"
            assert sorted(r["index"] for r in router.replicas()) == [0, 1, 2]
            for fake in (b, c):
                router.remove_replica(fake.url, drain_s=0)
        assert router.call(lambda: router.router.pool.policy.num_replicas) == 3  # never grew past the membership
        assert metric(router.url, "grpo_router_membership_changes_total") == 12
        assert complete(router.url, list(range(40))).status_code == 200
