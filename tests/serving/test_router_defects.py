"""The faults an outside suite found in the router (issue 17), each against in-process fake replicas (`fake_vllm`):
garbage 200 answers, a hung replica, a replica restarted during a long load, a token echoed in a 200 answer, a bad
adapter path holding the control lock, slow bodies and huge prompts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest
import requests

from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.router.config import RouterConfig

from .conftest import TOKEN_ENV, metric, send_then_hang_up, wait_for
from .fake_vllm import FakeCluster, FakeVLLM


@contextlib.contextmanager
def router_for(*fakes: FakeVLLM, **overrides):
    settings = dict(replicas=[f.url for f in fakes], port=0, api_key_env=TOKEN_ENV, health_interval_s=0.05,
                    health_timeout_s=2, load_retry_deadline_s=1, control_timeout_s=5, upstream_timeout_s=20)
    handle = start_router(RouterConfig(**{**settings, **overrides}))
    try:
        handle.wait_ready(timeout=10)
        yield handle
    finally:
        handle.stop()


def state(url: str) -> dict:
    return requests.get(url + "/router/state", timeout=5).json()


def complete(url: str, prompt: list[int], model: str = "m", seed: int = 0, timeout: float = 30):
    return requests.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "seed": seed},
                         timeout=timeout)


def complete_all(url: str, prompts: list[list[int]], model: str = "m", timeout: float = 30) -> list:
    """Send concurrently; returns the responses in order."""
    out: list = [None] * len(prompts)

    def one(i):
        out[i] = complete(url, prompts[i], model, seed=i, timeout=timeout)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


def distinct_prompts(n: int) -> list[list[int]]:
    return [list(range(1000 * i, 1000 * i + 40)) for i in range(1, n + 1)]


def load(url: str, name: str, path: str | None = None) -> requests.Response:
    return requests.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path or f"/p/{name}"},
                         timeout=30)


# -- 1. a 200 that is not a completion ------------------------------------------------------------------------
def test_malformed_200_body_is_resent_elsewhere_and_counted(token):
    good, broken = FakeVLLM(), FakeVLLM()
    broken.garbage_completions = True
    with FakeCluster(good, broken), router_for(good, broken, health_interval_s=60) as router:
        replies = complete_all(router.url, distinct_prompts(4))  # unmatched prompts alternate between replicas
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert all(r.json()["port"] == good.port for r in replies)
        assert metric(router.url, "grpo_router_malformed_answers_total") >= 1
        assert 'reason="malformed"' in requests.get(router.url + "/metrics", timeout=5).text
        assert [r["state"] for r in state(router.url)["replicas"]] == ["in_service", "down"]


def test_malformed_200_from_the_only_replica_is_a_502(token):
    broken = FakeVLLM()
    broken.garbage_completions = True
    with FakeCluster(broken), router_for(broken, health_interval_s=60) as router:
        reply = complete(router.url, list(range(40)))
        assert reply.status_code == 502
        assert "not completion JSON" in reply.json()["error"]["message"]


# -- 2. a hung replica --------------------------------------------------------------------------------------------
def test_hung_replica_is_taken_out_its_completions_resent_and_health_stays_fast(token):
    good, hung = FakeVLLM(), FakeVLLM()
    with FakeCluster(good, hung), router_for(good, hung, health_interval_s=0.1, health_timeout_s=0.5) as router:
        hung.hang = {"/v1/completions", "/health"}  # accepts, never answers
        t0 = time.monotonic()
        holder: list = []
        sender = threading.Thread(target=lambda: holder.extend(complete_all(router.url, distinct_prompts(4))))
        sender.start()
        health_s = []
        while sender.is_alive() and time.monotonic() - t0 < 15:
            began = time.monotonic()
            assert requests.get(router.url + "/health", timeout=5).status_code == 200
            health_s.append(time.monotonic() - began)
            time.sleep(0.05)
        sender.join(20)
        took = time.monotonic() - t0
        assert [r.status_code for r in holder] == [200] * 4, [r.text for r in holder]
        assert all(r.json()["port"] == good.port for r in holder)
        assert took < 10, took  # not the 20 s upstream deadline
        assert max(health_s) < 2, health_s  # answered from state, not by probing the hung replica
        assert state(router.url)["replicas"][1]["state"] == "down"
        assert 'reason="replica_down"' in requests.get(router.url + "/metrics", timeout=5).text


# -- 3. restarted during a long load ----------------------------------------------------------------------------
def test_replica_that_lost_its_adapters_during_a_long_load_leaves_routing(token):
    slow, restarted = FakeVLLM(), FakeVLLM()
    with FakeCluster(slow, restarted), router_for(slow, restarted, health_interval_s=0.1) as router:
        assert load(router.url, "v1").status_code == 200
        slow.load_delay_s = 4  # the next load holds on for a while
        loader = threading.Thread(target=lambda: load(router.url, "v2"))
        loader.start()
        wait_for(lambda: "v2" in restarted.adapters, 10, "v2 loaded on the quick replica")
        restarted.adapters.pop("v1")  # it restarted: its adapters are gone, and it answers health checks
        wait_for(lambda: state(router.url)["replicas"][1]["state"] != "in_service", 2, "the restarted replica out")
        assert loader.is_alive()  # found out while the load still ran
        replies = complete_all(router.url, distinct_prompts(8), model="v1")
        assert [r.status_code for r in replies] == [200] * 8
        loader.join(15)
        wait_for(lambda: all(r["state"] == "in_service" for r in state(router.url)["replicas"]), 10, "re-admission")
        assert restarted.adapters.keys() == slow.adapters.keys() == {"v1", "v2"}
        # every 404 it gave was re-sent and counted
        assert restarted.unknown_model <= metric(router.url, "grpo_router_reroutes_total")


# -- 4. the upstream token in a 200 answer -----------------------------------------------------------------------
def test_token_echoed_in_a_200_answer_is_scrubbed_from_body_and_headers(token):
    echo = FakeVLLM()
    echo.echo_token = True
    with FakeCluster(echo), router_for(echo) as router:
        reply = complete(router.url, list(range(40)))
        assert reply.status_code == 200
        assert token not in reply.text and token not in str(dict(reply.headers))
        assert reply.json()["echo"] == "Bearer ***"  # the replica did echo it; the router scrubbed it


# -- 5. open binds and adapter paths --------------------------------------------------------------------------
def test_non_loopback_bind_needs_client_auth_and_adapter_roots(monkeypatch):
    with pytest.raises(ValueError, match="client authentication.*adapter storage roots.*--insecure"):
        RouterConfig(replicas=["http://127.0.0.1:1"], host="0.0.0.0")
    with pytest.raises(ValueError, match="adapter storage roots"):
        RouterConfig(replicas=["http://127.0.0.1:1"], host="0.0.0.0", client_api_key_env="K")
    RouterConfig(replicas=["http://127.0.0.1:1"], host="0.0.0.0", client_api_key_env="K", adapter_roots=["/data"])
    RouterConfig(replicas=["http://127.0.0.1:1"], host="0.0.0.0", insecure=True)
    RouterConfig(replicas=["http://127.0.0.1:1"], host="127.0.0.2")  # loopback needs neither
    with pytest.raises(ValueError, match="absolute"):
        RouterConfig(replicas=["http://127.0.0.1:1"], adapter_roots=["relative/dir"])


def test_router_cli_refuses_an_open_bind_with_a_clear_message():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "grpo_lab.serving.router.server", "--replica", "http://127.0.0.1:1",
                          "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "refusing to listen on '0.0.0.0'" in out.stderr and "Traceback" not in out.stderr


def test_adapter_paths_must_lie_under_the_roots(token, tmp_path):
    fake = FakeVLLM()
    root = tmp_path / "adapters"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    with FakeCluster(fake), router_for(fake, adapter_roots=[str(root)]) as router:
        for bad in ("/etc/passwd", f"{root}/../elsewhere", f"{root}x/v1", "relative/v1", f"{root}/escape"):
            reply = load(router.url, "v1", bad)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "lora_path", (bad, reply.text)
        assert fake.adapters == {}
        assert load(router.url, "v1", f"{root}/v1").status_code == 200


# -- 6. a bad adapter path ---------------------------------------------------------------------------------------
def test_missing_adapter_path_blocks_no_other_control_call_and_says_where(token):
    a, b = FakeVLLM(), FakeVLLM()
    for fake in (a, b):
        fake.missing_paths.add("/p/missing")
    with FakeCluster(a, b), router_for(a, b, load_retry_deadline_s=2.5, load_retry_interval_s=0.05) as router:
        holder: list = []
        loader = threading.Thread(target=lambda: holder.append(load(router.url, "bad", "/p/missing")))
        loader.start()
        wait_for(lambda: a.calls.get("/v1/load_lora_adapter", 0) >= 2, 10, "the retries under way")
        t0 = time.monotonic()
        assert requests.post(router.url + "/pause", params={"mode": "keep"}, timeout=10).status_code == 200
        assert load(router.url, "good").status_code == 200
        assert requests.post(router.url + "/resume", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.5  # not held behind the 2.5 s of retries
        assert loader.is_alive()
        loader.join(10)
        reply = holder[0]
        assert reply.status_code == 400  # not 404, which TRL reads as "runtime LoRA loading is off"
        message = reply.json()["error"]["message"]
        assert "No adapter found for /p/missing" in message and a.url in message and b.url in message
        assert "after 2." in message and "retries" in message


# -- 7. request hygiene ------------------------------------------------------------------------------------------
def test_slow_body_gets_408(token):
    fake = FakeVLLM()
    with FakeCluster(fake), router_for(fake, body_read_timeout_s=0.5) as router:
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
            t0 = time.monotonic()
            answer = sock.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and "did not arrive" in answer
        assert time.monotonic() - t0 < 5
        assert requests.get(router.url + "/health", timeout=5).status_code == 200


def test_a_completion_whose_client_hung_up_is_cancelled_and_frees_its_replica(token):
    fake = FakeVLLM()
    fake.completion_delay_s = 60  # a long generation: without the cancel it would hold the replica a minute
    with FakeCluster(fake), router_for(fake) as router:
        def running() -> bool:
            return state(router.url)["replicas"][0]["in_flight"] == 1

        send_then_hang_up(router.port, "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8},
                          before_hang_up=lambda: wait_for(running, 5, "the completion on the replica"))
        t0 = time.monotonic()
        wait_for(lambda: state(router.url)["replicas"][0]["in_flight"] == 0, 5, "the cancelled completion's place")
        assert time.monotonic() - t0 < 5
        fake.completion_delay_s = 0.0
        assert complete(router.url, [4, 5, 6]).status_code == 200  # the router serves on, nothing leaked
        assert fake.served == 1


def test_long_prompts_are_hashed_off_the_event_loop(token, monkeypatch):
    fake = FakeVLLM()
    with FakeCluster(fake), router_for(fake, hash_off_loop_tokens=1000) as router:
        policy = router.router.pool.policy
        threads: list[str] = []
        real = policy.hashes_for

        def spy(tokens, namespace):
            threads.append(threading.current_thread().name)
            return real(tokens, namespace)

        monkeypatch.setattr(policy, "hashes_for", spy)
        assert complete(router.url, list(range(100))).status_code == 200
        assert complete(router.url, list(range(3000))).status_code == 200
        assert complete(router.url, list(range(5000))).status_code == 200  # over max_model_len: not hashed at all
        assert threads[0] == "grpo-router" and threads[1] != "grpo-router" and len(threads) == 2


def test_batch_prompts_are_split_routed_and_merged_like_vllm(token):
    a, b = FakeVLLM(), FakeVLLM()
    with FakeCluster(a, b), router_for(a, b) as router:
        prompts = distinct_prompts(3)
        prompts[1] = prompts[1][:17]
        reply = requests.post(router.url + "/v1/completions", json={"model": "m", "prompt": prompts, "seed": 1},
                              timeout=30)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["token_ids"] for c in body["choices"]] == [[40], [17], [40]]  # in prompt order
        assert body["usage"] == {"prompt_tokens": 97, "completion_tokens": 3, "total_tokens": 100}
        assert a.served + b.served == 3
        too_many = requests.post(router.url + "/v1/completions", json={"model": "m", "prompt": [[1]] * 1025},
                                 timeout=30)
        assert too_many.status_code == 400 and "exceeds the maximum allowed count of 1024" in too_many.text
        a.fail_next("/v1/completions", 400, "bad prompt")
        b.fail_next("/v1/completions", 400, "bad prompt")
        failed = requests.post(router.url + "/v1/completions", json={"model": "m", "prompt": prompts}, timeout=30)
        assert failed.status_code == 400  # one failed prompt fails the batch, as in vLLM
        for bad in ("", None, [1, -2], [[1], "x"], 5):
            reply = requests.post(router.url + "/v1/completions", json={"model": "m", "prompt": bad}, timeout=30)
            # vLLM names the field ("prompt") or, for a schema violation inside it, its path ("body.prompt.1")
            param = reply.json()["error"]["param"]
            assert reply.status_code == 400 and param in ("prompt", "body.prompt", "body.prompt.1"), (bad, reply.text)
