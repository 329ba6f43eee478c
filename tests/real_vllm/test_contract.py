"""TRL's own VLLMClient against two real vLLM CPU replicas behind the router: what AsyncGRPOTrainer does per sync.

Each check reads the replicas' own state (their `/v1/models`), not the router's account of it.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests
from trl.experimental.async_grpo.vllm_client import VLLMClient

from .conftest import MAX_STALENESS, SERVED_NAME, direct, served_models, trl_payload, unload

PROMPT = list(range(5, 45))  # 40 token ids inside the character vocabulary


def complete(url: str, payload: dict, **kwargs) -> requests.Response:
    return requests.post(url + "/v1/completions", json=payload, timeout=120, **kwargs)


def test_server_info_selects_adapter_only_sync(cluster):
    client = VLLMClient(cluster.url)
    client.wait_for_server_ready()
    vllm_config = client.get_server_info()
    assert vllm_config["lora_config"]["max_lora_rank"] >= 1
    assert vllm_config["lora_config"]["max_loras"] >= MAX_STALENESS + 2
    assert vllm_config["parallel_config"]["data_parallel_size"] == 1
    assert vllm_config["cache_config"]["block_size"] == 32
    assert client.get_max_model_len() == 128
    assert client.get_dtype() == "torch.float32"
    # the router hashes prefixes in vLLM's block size, read from the replicas
    assert requests.get(cluster.url + "/router/state", timeout=10).json()["block_size"] == 32


def test_sync_cycle_reaches_every_replica(cluster, adapters, token):
    """pause -> load v1 -> resume -> rollouts on v1 -> unload, as one AsyncGRPOTrainer sync does."""
    client = VLLMClient(cluster.url)
    client.pause()
    try:
        client.load_lora_adapter("trl-policy-v1", adapters["trl-policy-v1"])
    finally:
        client.resume()
    try:
        for replica in cluster.replicas:
            assert "trl-policy-v1" in served_models(replica, token)
        answers = [complete(cluster.url, trl_payload("trl-policy-v1", PROMPT, seed=s)) for s in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        choice = answers[0].json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
    finally:
        unload(cluster, token, "trl-policy-v1")
    gone = complete(cluster.url, trl_payload("trl-policy-v1", PROMPT, seed=0))
    assert gone.status_code == 404


def test_pause_holds_new_rollouts_on_every_replica_until_resume(cluster, token):
    """After the router's pause, a completion sent straight to either replica waits; resume releases both."""
    client = VLLMClient(cluster.url)
    client.pause()
    results: dict[int, int] = {}

    def send(i, replica):
        results[i] = direct(replica, token, "POST", "/v1/completions",
                            json=trl_payload(SERVED_NAME, PROMPT, seed=i)).status_code

    threads = [threading.Thread(target=send, args=(i, r)) for i, r in enumerate(cluster.replicas)]
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
        assert results == {}, "a paused replica answered a completion"
    finally:
        client.resume()
    for t in threads:
        t.join(timeout=120)
    assert results == {0: 200, 1: 200}


def test_router_forwards_vllm_answers_bit_equal(cluster, adapters, token):
    """Token ids and logprobs through the router equal the replica's own answer to the same request."""
    client = VLLMClient(cluster.url)
    client.load_lora_adapter("trl-policy-v2", adapters["trl-policy-v2"])
    try:
        for model in (SERVED_NAME, "trl-policy-v0", "trl-policy-v2"):
            payload = trl_payload(model, PROMPT, seed=7)
            routed = complete(cluster.url, payload).json()["choices"][0]
            for replica in cluster.replicas:
                own = direct(replica, token, "POST", "/v1/completions", json=payload).json()["choices"][0]
                assert own["token_ids"] == routed["token_ids"]
                assert own["logprobs"]["token_logprobs"] == routed["logprobs"]["token_logprobs"]
    finally:
        unload(cluster, token, "trl-policy-v2")


def test_an_adapter_changes_what_is_sampled(cluster, adapters, token):
    """The served model is peaked, so the same seed under another adapter samples other tokens: a request served
    by the wrong adapter would be visible (what the tests above rely on)."""
    client = VLLMClient(cluster.url)
    for name in ("trl-policy-v1", "trl-policy-v2"):
        client.load_lora_adapter(name, adapters[name])
    try:
        outs = {m: [tuple(complete(cluster.url, trl_payload(m, PROMPT, seed=s)).json()["choices"][0]["token_ids"])
                    for s in range(6)]
                for m in (SERVED_NAME, "trl-policy-v1", "trl-policy-v2")}
    finally:
        for name in ("trl-policy-v1", "trl-policy-v2"):
            unload(cluster, token, name)
    assert outs[SERVED_NAME] != outs["trl-policy-v1"] != outs["trl-policy-v2"] != outs[SERVED_NAME]


@pytest.mark.parametrize("path", ["/pause", "/resume", "/server_info", "/reset_prefix_cache"])
def test_vllm_api_key_leaves_control_endpoints_open(cluster, path):
    """vLLM's VLLM_API_KEY guards /v1/* only (docs/serving.md, "Real vLLM on a CPU"): keep replicas on loopback behind
    the router."""
    replica = cluster.replicas[0]
    assert requests.get(replica.url + "/v1/models", timeout=30).status_code == 401
    method = "GET" if path == "/server_info" else "POST"  # (resetting the cache is harmless here)
    try:
        assert requests.request(method, replica.url + path, timeout=30).status_code == 200
    finally:
        if path == "/pause":
            requests.post(replica.url + "/resume", timeout=30)


def test_vllm_tokenizes_and_detokenizes_like_the_trainer(cluster, model_dir, token):
    """vLLM loads the embedded model's tokenizer as the trainer does: the same chat-template ids (newlines and
    `\\boxed{` included) and the same text back, so rewards read what the model wrote."""
    from transformers import AutoTokenizer

    from grpo_lab.tasks.embedded_model import build_chat_tokenizer

    messages = [{"role": "user", "content": "add them:\n12+34="}]
    expected = build_chat_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    assert AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False) == expected
    replica = cluster.replicas[0]
    served = direct(replica, token, "POST", "/tokenize",
                    json={"model": SERVED_NAME, "messages": messages, "add_generation_prompt": True}).json()
    assert served["tokens"] == expected
    answer = "\\boxed{46}"
    ids = build_chat_tokenizer()(answer)["input_ids"]
    assert len(ids) == 4  # `\boxed{` is one token
    text = direct(replica, token, "POST", "/detokenize", json={"model": SERVED_NAME, "tokens": ids}).json()
    assert text["prompt"] == answer
