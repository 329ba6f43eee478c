"""Two real CPU replica processes behind the router, driven through TRL's own VLLMClient and TRL's payload."""

from __future__ import annotations

import types

import pytest
import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .conftest import metric, run_group, trl_payload

PROMPT = list(range(10, 60))  # 50 tokens: 3 cacheable blocks


def test_trl_client_sees_one_adapter_capable_server(cluster, adapters):
    from peft import LoraConfig, get_peft_model
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync

    from grpo_lab.models import build_model

    client = VLLMClient(cluster.url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.1)
    info = client.get_server_info()
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert info["lora_config"]["max_loras"] == 6 and info["cache_config"]["block_size"] == 16
    assert client.get_max_model_len() == 1024
    assert client.get_dtype() == "torch.float32"
    peft_model = get_peft_model(build_model("tiny-qwen3"), LoraConfig(r=1, target_modules="all-linear"))
    assert select_adapter_sync(info, peft_model, types.SimpleNamespace(max_staleness=4)) is True


def test_sync_cycle_and_group_affinity(cluster, adapters, token):
    client = VLLMClient(cluster.url, server_timeout=30)
    client.pause()
    client.load_lora_adapter("trl-policy-v1", adapters["trl-policy-v1"])
    client.resume()
    for r in cluster.replicas:  # loaded everywhere, with the path TRL gave
        models = requests.get(r.url + "/v1/models", headers={"Authorization": f"Bearer {token}"},
                              timeout=10).json()["data"]
        assert {"trl-policy-v1": adapters["trl-policy-v1"]}.items() <= {m["id"]: m["root"] for m in models}.items()
    before = [metric(r.url, "vllm:request_success_total") for r in cluster.replicas]
    hits_before = [metric(r.url, "vllm:prefix_cache_hits_total") for r in cluster.replicas]
    bodies = run_group(cluster.url, [trl_payload("trl-policy-v1", PROMPT, seed=s) for s in range(8)])
    for body in bodies:
        assert not isinstance(body, Exception), body
        choice = body["choices"][0]
        assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["token_logprobs"]) == 4
        assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    served = [metric(r.url, "vllm:request_success_total") - b for r, b in zip(cluster.replicas, before)]
    assert sorted(served) == [0, 8]  # the whole group landed on one replica
    hot = served.index(8)
    hits = metric(cluster.replicas[hot].url, "vllm:prefix_cache_hits_total") - hits_before[hot]
    assert hits >= 7 * 48  # 7 of 8 reused the prompt's 3 cacheable blocks
    # the adapter changes the policy: same seed, base vs adapter differ; same seed twice is reproducible
    a, b, c = run_group(cluster.url, [trl_payload("trl-policy-v1", PROMPT, 5, 8),
                                      trl_payload("trl-policy-v1", PROMPT, 5, 8),
                                      trl_payload("trl-policy-v0", PROMPT, 5, 8)])
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["logprobs"] != c["choices"][0]["logprobs"]


def test_unload_and_unknown_model_never_reach_replicas(cluster, adapters):
    client = VLLMClient(cluster.url, server_timeout=30)
    client.load_lora_adapter("trl-policy-v2", adapters["trl-policy-v2"])
    for path in (adapters["trl-policy-v2"], adapters["trl-policy-v3"]):  # vLLM: 400 even for the same path
        with pytest.raises(Exception, match="400.*already been loaded"):
            client.load_lora_adapter("trl-policy-v2", path)
    client.unload_lora_adapter("trl-policy-v2")
    again = requests.post(cluster.url + "/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v2"}, timeout=30)
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"  # as vLLM
    client.unload_lora_adapter("trl-policy-v2")  # TRL's client ignores the 404
    for name in ("trl-policy-v2", "trl-policy-v9"):
        reply = requests.post(cluster.url + "/v1/completions", json=trl_payload(name, PROMPT, 1), timeout=30)
        assert reply.status_code == 404 and "does not exist" in reply.json()["error"]["message"]
    assert sum(metric(r.url, "grpo_replica_unknown_model_total") for r in cluster.replicas) == 0


def test_nccl_weight_transfer_is_refused(cluster):
    client = VLLMClient(cluster.url, server_timeout=30)
    with pytest.raises(Exception, match="adapter-only sync is required"):
        client.init_weight_transfer_engine({"master_address": "127.0.0.1"})
    with pytest.raises(Exception, match="501"):
        client.update_weights({})


def test_bad_requests_get_4xx_and_router_keeps_serving(cluster):
    url = cluster.url + "/v1/completions"
    cases = [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "must be an object"),
        (b'{"model": 3, "prompt": [1, 2]}', 400, "'model'"),
        (b'{"model": "trl-policy-v0", "prompt": [1, "x"]}', 400, "'prompt'"),
        (b'{"model": "trl-policy-v0", "prompt": [1, 2, 3], "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"model": "trl-policy-v0", "prompt": [1, 2, 3], "max_tokens": 5000}', 400, "maximum context length"),
        (b'{"model": "trl-policy-v0", "prompt": [1, 99999]}', 400, "token ids"),
        (b'{"model": "trl-policy-v0", "prompt": [1180591620717411303424, ' + b"1, " * 40 + b'1]}', 400, "64-bit"),
        (b'{"model": "trl-policy-v0", "prompt": [1, 2], "temperature": -1}', 400, "temperature"),
        (b'{"model": "trl-policy-v0", "prompt": [1, 2], "temperature": NaN}', 400, "finite"),
        (b'{"model": "trl-policy-v0", "prompt": [1, 2], "top_p": Infinity}', 400, "finite"),
    ]
    for body, status, text in cases:
        reply = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert reply.status_code == status and text in reply.text, (body, reply.status_code, reply.text)
    big = b'{"model": "trl-policy-v0", "prompt": [' + b"1, " * 600_000 + b"1]}"
    reply = requests.post(url, data=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert reply.status_code == 413 and "bytes" in reply.text
    reply = requests.post(cluster.url + "/v1/load_lora_adapter", json={"lora_name": 1}, timeout=30)
    assert reply.status_code == 400 and "lora_name" in reply.text
    assert requests.get(cluster.url + "/health", timeout=10).status_code == 200
    ok = requests.post(url, json=trl_payload("trl-policy-v0", PROMPT, 3), timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4


def test_token_is_added_upstream_and_never_leaks(cluster, token, log_lines):
    replica = cluster.replicas[0]
    assert requests.get(replica.url + "/v1/models", timeout=10).status_code == 401  # replicas demand the token
    assert requests.get(cluster.url + "/v1/models", timeout=10).status_code == 200  # so the router sends it
    seen = []
    for path in ("/v1/models", "/server_info", "/metrics", "/router/state", "/health"):
        seen.append(requests.get(cluster.url + path, timeout=10).text)
    seen.append(requests.post(cluster.url + "/v1/completions", data=b"{", timeout=10).text)
    seen.append(requests.post(cluster.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"},
                              timeout=30).text)
    assert all(token not in text for text in seen)
    assert log_lines and all(token not in line for line in log_lines)
    for r in cluster.replicas:
        assert all(token not in line for line in r.output)
    assert token not in repr(cluster.router.config)


def test_metrics_report_routing_loads_and_states(cluster):
    m = requests.get(cluster.url + "/metrics", timeout=10).text
    for name in ("grpo_router_routed_total", "grpo_router_adapter_loads_total", "grpo_router_replica_state",
                 "grpo_router_upstream_latency_seconds_bucket", "grpo_router_in_flight", "grpo_router_overhead_seconds"):
        assert name in m, name
    assert 'decision="affinity"' in m and 'state="in_service"' in m


def test_batch_of_token_id_prompts_equals_the_prompts_sent_one_by_one(cluster):
    prompts = [PROMPT, list(range(200, 240)), list(range(300, 321))]  # ids under tiny-qwen3's 512
    batch = requests.post(cluster.url + "/v1/completions",
                          json={**trl_payload("trl-policy-v0", prompts, seed=11), "prompt": prompts}, timeout=60)
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    singles = run_group(cluster.url, [trl_payload("trl-policy-v0", p, seed=11) for p in prompts])
    for choice, single in zip(choices, singles):  # vLLM gives every prompt of a batch the request's seed
        assert choice["token_ids"] == single["choices"][0]["token_ids"]
        # equal up to float noise: the second pass may reuse the first one's prefix cache
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(single["choices"][0]["logprobs"]["token_logprobs"],
                                                                     abs=1e-5)
    usage = batch.json()["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 12


def test_unload_while_completions_run_drains_them_on_real_replicas(cluster, adapters, token):
    import threading
    import time

    client = VLLMClient(cluster.url, server_timeout=30)
    client.load_lora_adapter("drain-v3", adapters["trl-policy-v3"])
    payloads = [{**trl_payload("drain-v3", list(range(100 + 40 * i, 140 + 40 * i)), seed=i, max_tokens=200),
                 "ignore_eos": True} for i in range(8)]
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(run_group(cluster.url, payloads, timeout=120)))
    runner.start()
    state = lambda: requests.get(cluster.url + "/router/state", timeout=10).json()
    deadline = time.monotonic() + 30
    while sum(r["in_flight"] for r in state()["replicas"]) < 8 and time.monotonic() < deadline:
        assert runner.is_alive(), results
        time.sleep(0.02)
    t0 = time.monotonic()
    reply = requests.post(cluster.url + "/v1/unload_lora_adapter", json={"lora_name": "drain-v3"}, timeout=30)
    assert reply.status_code == 200 and time.monotonic() - t0 < 2
    assert runner.is_alive()  # answered while the 8 were still generating
    late = requests.post(cluster.url + "/v1/completions", json=trl_payload("drain-v3", PROMPT, 1), timeout=30)
    assert late.status_code == 404
    assert "drain-v3" in state()["draining"]
    runner.join(120)
    assert len(results) == 8 and all(not isinstance(r, Exception) for r in results), results
    assert all(len(r["choices"][0]["token_ids"]) == 200 for r in results)
    deadline = time.monotonic() + 30
    while state()["draining"] and time.monotonic() < deadline:
        time.sleep(0.05)
    auth = {"Authorization": f"Bearer {token}"}
    for r in cluster.replicas:  # gone from every replica once drained
        held = {m["id"] for m in requests.get(r.url + "/v1/models", headers=auth, timeout=10).json()["data"]}
        assert "drain-v3" not in held
