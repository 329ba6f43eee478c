"""The router answers like vLLM 0.31 (read from its source: `serving_models.py`, `serve/dev/rlhf/api_router.py`,
`serve/exception_handling/`), client authentication covers every endpoint, and unloads drain (issue 14 item 5),
against in-process fake replicas."""

from __future__ import annotations

import threading
import time

import requests

from .conftest import metric, wait_for
from .fake_vllm import FakeCluster, FakeVLLM
from .test_router_defects import complete, complete_all, distinct_prompts, load, router_for, state

ERROR_KEYS = {"message", "type", "param", "code"}


def unload(url: str, name: str, **kwargs) -> requests.Response:
    return requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30, **kwargs)


def start_completion(url: str, model: str) -> tuple[threading.Thread, list]:
    """One completion sent from a thread; waits until the router has it in flight."""
    holder: list = []
    sender = threading.Thread(target=lambda: holder.append(complete(url, list(range(40)), model=model)))
    sender.start()
    wait_for(lambda: state(url)["replicas"][0]["in_flight"] == 1, 10, "a completion in flight")
    return sender, holder


def assert_vllm_error(reply: requests.Response, status: int, kind: str, text: str = "") -> None:
    body = reply.json()
    assert reply.status_code == status and set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, reply.text
    assert body["error"]["type"] == kind and body["error"]["code"] == status and text in body["error"]["message"]


def test_adapter_answers_match_vllm(token):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, b) as router:
        url = router.url
        assert load(url, "v1").text == "Success: LoRA adapter 'v1' added successfully."
        assert_vllm_error(load(url, "v1"), 400, "InvalidUserInput", "has already been loaded")  # same path too
        assert_vllm_error(load(url, "m"), 400, "InvalidUserInput", "conflicts with a served base model")
        missing = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "v2"}, timeout=10)
        assert_vllm_error(missing, 400, "Bad Request", "Field required")  # vLLM's request schema refuses it
        assert missing.json()["error"]["param"] == "body.lora_path"
        empty = requests.post(url + "/v1/load_lora_adapter", json={"lora_name": "v2", "lora_path": ""}, timeout=10)
        assert_vllm_error(empty, 400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        negative = complete(url, [5, -1, 7], model="m")
        assert_vllm_error(negative, 400, "Bad Request", "greater than or equal to 0")
        assert negative.json()["error"]["param"] == "body.prompt.1"
        assert unload(url, "v1").text == "Success: LoRA adapter 'v1' removed successfully."
        assert_vllm_error(unload(url, "v1"), 404, "NotFoundError", "The lora adapter 'v1' cannot be found.")
        assert_vllm_error(unload(url, ""), 400, "InvalidUserInput", "'lora_name' needs to be provided")
        unknown = complete(url, list(range(40)), model="v9")
        assert_vllm_error(unknown, 404, "NotFoundError", "The model `v9` does not exist.")
        assert unknown.json()["error"]["param"] == "model"


def test_pause_and_resume_answer_like_vllm_and_state_follows_the_replicas(token):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, b) as router:
        url = router.url
        bogus = requests.post(url + "/pause", params={"mode": "bogus"}, timeout=10)
        assert_vllm_error(bogus, 400, "Bad Request", "mode")
        assert bogus.json()["error"]["param"] == "mode"
        assert state(url)["paused"] is False and not a.paused and not b.paused  # the old bug: recorded paused
        b.fail_next("/pause", 500, "engine busy")
        failed = requests.post(url + "/pause", params={"mode": "keep"}, timeout=10)
        assert failed.status_code == 500 and "undone" in failed.json()["error"]["message"]
        assert state(url)["paused"] is False and not a.paused  # a had paused: resumed again
        assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=10).json() == {"status": "paused"}
        assert state(url)["paused"] is True and a.paused and b.paused
        assert requests.post(url + "/resume", timeout=10).json() == {"status": "resumed"}  # vLLM's word
        assert state(url)["paused"] is False and not a.paused and not b.paused


def test_client_key_guards_every_endpoint(token, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_TEST_CLIENT_KEY", "client-" + token[::-1])
    fake = FakeVLLM()
    with FakeCluster(fake), router_for(fake, client_api_key_env="GRPO_LAB_TEST_CLIENT_KEY") as router:
        url, key = router.url, "client-" + token[::-1]
        calls = [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
                 ("GET", "/server_info", None), ("GET", "/router/state", None), ("POST", "/pause", None),
                 ("POST", "/resume", None), ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/p/x"}),
                 ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
                 ("POST", "/v1/completions", {"model": "m", "prompt": [1, 2, 3]}),
                 ("POST", "/init_weight_transfer_engine", {})]
        for method, path, body in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {token}"}):
                reply = requests.request(method, url + path, json=body, headers=headers, timeout=10)
                assert reply.status_code == 401 and reply.json() == {"error": "Unauthorized"}, (path, headers)
        assert fake.calls.get("/v1/load_lora_adapter", 0) == 0 and fake.calls.get("/pause", 0) == 0
        good = {"Authorization": f"Bearer {key}"}
        assert requests.get(url + "/health", headers=good, timeout=10).status_code == 200
        assert requests.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3]}, headers=good,
                             timeout=10).status_code == 200
        assert key not in requests.get(url + "/router/state", headers=good, timeout=10).text


# -- draining unloads ----------------------------------------------------------------------------------------
def test_unload_drains_in_flight_completions_and_a_load_waits_for_the_slot(token):
    a, b = FakeVLLM(max_loras=2), FakeVLLM(max_loras=2)
    with FakeCluster(a, b), router_for(a, b) as router:
        url = router.url
        assert load(url, "v1").status_code == 200 and load(url, "v2").status_code == 200
        for fake in (a, b):
            fake.completion_delay_s = 1.5
        holder: list = []
        sender = threading.Thread(target=lambda: holder.extend(complete_all(url, distinct_prompts(4), model="v1")))
        sender.start()
        wait_for(lambda: sum(r["in_flight"] for r in state(url)["replicas"]) == 4, 10, "4 completions in flight")
        t0 = time.monotonic()
        assert unload(url, "v1").status_code == 200
        assert time.monotonic() - t0 < 0.5  # answered at once
        assert complete(url, list(range(40)), model="v1").status_code == 404  # no new work for it
        drained = state(url)["draining"]
        assert set(drained) == {"v1"} and sum(drained["v1"].values()) == 4
        assert 'grpo_router_draining_adapters{replica=' in requests.get(url + "/metrics", timeout=5).text
        assert load(url, "v3").status_code == 200  # both replicas full (v1 draining, v2): waits for the drain
        assert time.monotonic() - t0 > 1.0
        sender.join(10)
        assert [r.status_code for r in holder] == [200] * 4  # nothing was cut
        assert a.most_adapters == b.most_adapters == 2  # never over max_loras
        assert a.adapters.keys() == b.adapters.keys() == {"v2", "v3"}
        assert state(url)["draining"] == {}


def test_drain_deadline_unloads_anyway_and_a_reload_of_the_name_waits(token):
    a = FakeVLLM()
    with FakeCluster(a), router_for(a, unload_drain_timeout_s=0.5) as router:
        url = router.url
        assert load(url, "v1").status_code == 200
        a.completion_delay_s = 3
        sender, _ = start_completion(url, "v1")
        assert unload(url, "v1").status_code == 200
        assert load(url, "v1").status_code == 200  # same name again (a resumed run): after the old one is gone
        assert sender.is_alive() and a.calls["/v1/unload_lora_adapter"] == 1  # unloaded under the completion
        assert metric(url, "grpo_router_drain_timeouts_total") == 1
        sender.join(10)


def test_a_load_under_pause_does_not_wait_for_drains_frozen_by_the_pause(token):
    """TRL's sync: pause, load vN, resume, unload v{N-S-1}. Completions of a draining version are frozen by the
    pause, so waiting for their drain there would only stall the sync."""
    a = FakeVLLM(max_loras=2)
    with FakeCluster(a), router_for(a) as router:
        url = router.url
        assert load(url, "v1").status_code == 200 and load(url, "v2").status_code == 200
        a.completion_delay_s = 2
        sender, holder = start_completion(url, "v1")
        assert unload(url, "v1").status_code == 200
        assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
        a.max_loras = 3  # a vLLM replica takes the extra adapter (it evicts from its cache)
        t0 = time.monotonic()
        assert load(url, "v3").status_code == 200
        assert time.monotonic() - t0 < 1.0 and sender.is_alive()
        assert requests.post(url + "/resume", timeout=10).status_code == 200
        sender.join(10)
        assert holder[0].status_code == 200
        wait_for(lambda: state(url)["draining"] == {}, 10, "v1 drained")
        assert set(a.adapters) == {"v2", "v3"}
        models = requests.get(url + "/v1/models", timeout=10).json()["data"]
        assert {m["id"] for m in models if m.get("parent")} == {"v2", "v3"}
