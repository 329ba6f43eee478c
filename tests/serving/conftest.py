"""Shared fixtures: tiny LoRA adapters on disk, a bearer token, and real CPU replica processes on loopback."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
import types

import pytest
import requests

from grpo_lab.serving.wire.metrics import parse_text
from grpo_lab.serving.replicas.processes import start_cpu_replicas
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router

TOKEN_ENV = "GRPO_LAB_TEST_UPSTREAM_TOKEN"
REPLICA_ARGS = ["--served-model-name", "tiny-qwen3", "trl-policy-v0", "--max-loras", "6", "--max-lora-rank", "16",
                "--max-model-len", "1024"]


@pytest.fixture(scope="session")
def token():
    value = "tok-" + secrets.token_hex(16)
    old = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = value
    yield value
    if old is None:
        os.environ.pop(TOKEN_ENV, None)
    else:
        os.environ[TOKEN_ENV] = old


@pytest.fixture(scope="session")
def adapters(tmp_path_factory):
    """Three different rank-1 all-linear adapters of tiny-qwen3 with non-zero B, so they change the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from grpo_lab.models import build_model

    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for i in range(1, 4):
        base = build_model("tiny-qwen3")  # seeds torch itself: the adapter's own seed comes after
        torch.manual_seed(i)
        model = get_peft_model(base, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear",
                                                                     init_lora_weights=False))
        path = root / f"trl-policy-v{i}"
        model.save_pretrained(path)
        paths[f"trl-policy-v{i}"] = str(path)
    return paths


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it returns something truthy (returned), or fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def send_then_hang_up(port: int, path: str, body: dict, headers: dict | None = None, wait_s: float = 0.3,
                      before_hang_up=None) -> None:
    """A client killed mid-request: it sends a whole POST, waits `wait_s` (the router has it by then), calls
    `before_hang_up()` if given, and its connection closes with no answer read."""
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        time.sleep(wait_s)
        if before_hang_up is not None:
            before_hang_up()


def metrics_of(url: str) -> dict[str, float]:
    return parse_text(requests.get(url + "/metrics", timeout=10).text)


def metric(url: str, prefix: str) -> float:
    return sum(v for k, v in metrics_of(url).items() if k.split("{")[0] == prefix)


def trl_payload(model: str, prompt: list[int], seed: int, max_tokens: int = 4) -> dict:
    """Exactly the fields TRL 1.16's rollout worker sends (`_generate_one_turn`)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0,
            "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": seed}


def served_after_same_prompt(url: str, ports: list[int], token: str, times: int = 8) -> list[int]:
    """Send one 64-token prompt `times` times through the router at `url` (each answered 200), then return how many
    completions each fake replica (`fake_replica --ports`) served: what a routing policy did with identical prompts."""
    for seed in range(times):
        reply = requests.post(url + "/v1/completions", json=trl_payload("fake", list(range(64)), seed), timeout=10)
        assert reply.status_code == 200
    auth = {"Authorization": f"Bearer {token}"}
    return [requests.get(f"http://127.0.0.1:{p}/served", headers=auth, timeout=5).json()["n"] for p in ports]


async def post_like_trl(session, url: str, payload: dict, timeout: float = 60) -> dict:
    """What `AsyncRolloutWorker._post` does: POST json, raise on >= 400, parse the body."""
    import aiohttp

    async with session.post(url + "/v1/completions", json=payload,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        response.raise_for_status()
        return await response.json()


def run_group(url: str, payloads: list[dict], timeout: float = 60) -> list:
    """Send payloads concurrently (a GRPO group); returns bodies or exceptions."""
    import asyncio

    import aiohttp

    async def go():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(post_like_trl(session, url, p, timeout) for p in payloads),
                                        return_exceptions=True)

    return asyncio.run(asyncio.wait_for(go(), timeout + 10))


@pytest.fixture(scope="session")
def cluster(token, log_lines):
    """Two CPU replica processes behind an in-process router, shared by the e2e and TRL-worker tests."""
    from accelerate import PartialState

    PartialState()  # TRL's VLLMClient logs through accelerate, as inside a trainer
    replicas = start_cpu_replicas(2, REPLICA_ARGS, env={"VLLM_API_KEY": token})
    router = start_router(RouterConfig(replicas=[r.url for r in replicas], port=0, api_key_env=TOKEN_ENV,
                                       health_interval_s=0.2, load_retry_deadline_s=3, control_timeout_s=30,
                                       upstream_timeout_s=60, max_body_bytes=1024 * 1024))
    try:
        router.wait_ready(2, timeout=60)
        yield types.SimpleNamespace(router=router, replicas=replicas, url=router.url)
    finally:
        router.stop()
        for r in replicas:
            r.stop()


@pytest.fixture(scope="session")
def log_lines():
    """Capture every log record from here on (router, aiohttp, TRL) to check the token never appears."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield records
    root.removeHandler(handler)
    root.setLevel(old)
