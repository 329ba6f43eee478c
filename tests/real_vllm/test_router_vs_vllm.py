"""The router answers like vLLM: the same requests, in the same order, to a real replica and to a router in front of
the other replica, compared answer by answer (status code, error body shape, the fields TRL reads).

This module has its own router (one replica behind it) and talks to the other replica directly, so neither sees the
other's adapters. Steps where the router still differs from vLLM are expected failures (strict: once the router
answers like vLLM they pass, and the mark must go); each reason says what differs. Deliberate, documented
differences not compared here: the router answers an unload at once and each replica unloads once its completions
using the adapter have finished (vLLM unloads before answering).
"""

from __future__ import annotations

import time
import types

import pytest
import requests

from .conftest import SERVED_NAME, direct, trl_payload

PROMPT = list(range(5, 45))


def steps(adapters: dict, missing: str) -> list[tuple[str, str, str, dict]]:
    """(step id, method, path, requests kwargs), applied in this order to both sides."""
    v1 = adapters["trl-policy-v1"]
    return [
        ("load", "POST", "/v1/load_lora_adapter", {"json": {"lora_name": "trl-policy-v1", "lora_path": v1}}),
        ("load_again_same_path", "POST", "/v1/load_lora_adapter",
         {"json": {"lora_name": "trl-policy-v1", "lora_path": v1}}),
        ("load_missing_path", "POST", "/v1/load_lora_adapter",
         {"json": {"lora_name": "trl-policy-v9", "lora_path": missing}}),
        ("load_without_path", "POST", "/v1/load_lora_adapter", {"json": {"lora_name": "trl-policy-v8"}}),
        ("complete_adapter", "POST", "/v1/completions", {"json": trl_payload("trl-policy-v1", PROMPT, seed=3)}),
        ("complete_alias_v0", "POST", "/v1/completions", {"json": trl_payload("trl-policy-v0", PROMPT, seed=3)}),
        ("complete_unknown_model", "POST", "/v1/completions", {"json": trl_payload("trl-policy-v7", PROMPT, seed=3)}),
        ("complete_batch_of_token_prompts", "POST", "/v1/completions",
         {"json": {**trl_payload(SERVED_NAME, PROMPT, seed=3), "prompt": [PROMPT[:10], PROMPT[10:30]]}}),
        ("complete_negative_token", "POST", "/v1/completions",
         {"json": trl_payload(SERVED_NAME, [5, -1, 7], seed=3)}),
        ("complete_too_long", "POST", "/v1/completions",
         {"json": trl_payload(SERVED_NAME, [5] * 200, seed=3)}),
        ("models", "GET", "/v1/models", {}),
        ("pause_bogus_mode", "POST", "/pause", {"params": {"mode": "bogus"}}),
        ("is_paused_after_bogus", "GET", "/is_paused", {}),
        ("pause_keep", "POST", "/pause", {"params": {"mode": "keep"}}),
        ("is_paused", "GET", "/is_paused", {}),
        ("resume", "POST", "/resume", {}),
        ("resume_again", "POST", "/resume", {}),
        ("unload", "POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "trl-policy-v1"}}),
        ("unload_again", "POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "trl-policy-v1"}}),
        ("unload_never_loaded", "POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "trl-policy-v5"}}),
    ]


def body_of(response: requests.Response):
    try:
        return response.json()
    except ValueError:
        return response.text


LOAD_RETRY_DEADLINE_S = 3


@pytest.fixture(scope="module")
def transcript(replicas, adapters, token, tmp_path_factory):
    """Every step's answer from vLLM (replica 0, directly) and from the router (in front of replica 1)."""
    from grpo_lab.serving.router.thread import start_router
    from grpo_lab.serving.router.config import RouterConfig

    from .conftest import TOKEN_ENV

    vllm_side, routed_side = replicas
    missing = str(tmp_path_factory.mktemp("nothing") / "no-such-adapter")
    router = start_router(RouterConfig(replicas=[routed_side.url], port=0, api_key_env=TOKEN_ENV,
                                       health_interval_s=0.5, load_retry_deadline_s=LOAD_RETRY_DEADLINE_S,
                                       control_timeout_s=120, upstream_timeout_s=120))
    answers = {}
    try:
        router.wait_ready(1, timeout=120)
        for name, method, path, kwargs in steps(adapters, missing):
            t0 = time.monotonic()
            mine = direct(vllm_side, token, method, path, **kwargs)
            t1 = time.monotonic()
            theirs = requests.request(method, router.url + path, timeout=120, **kwargs)
            t2 = time.monotonic()
            answers[name] = types.SimpleNamespace(
                vllm=(mine.status_code, body_of(mine)), router=(theirs.status_code, body_of(theirs)),
                vllm_s=t1 - t0, router_s=t2 - t1, router_state=requests.get(router.url + "/router/state",
                                                                               timeout=30).json())
    finally:
        for side in (vllm_side, routed_side):  # leave both replicas as the session found them
            requests.post(side.url + "/resume", timeout=60)
            for name in ("trl-policy-v1", "trl-policy-v9", "trl-policy-v8"):
                direct(side, token, "POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        router.stop()
    return answers


def error_shape(body) -> tuple | None:
    """What a client can rely on in vLLM's error answers: the keys of `error`, its type and code (the message and
    `param` may word the same problem differently)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return tuple(sorted(body["error"])), body["error"].get("type"), body["error"].get("code")
    return None


def same_answer(step: str, vllm, router) -> bool:
    (vs, vb), (rs, rb) = vllm, router
    if vs != rs:
        return False
    if vs != 200:
        return error_shape(vb) == error_shape(rb)
    if step.startswith("complete"):
        return ([c["token_ids"] for c in vb["choices"]] == [c["token_ids"] for c in rb["choices"]]
                and [c["logprobs"]["token_logprobs"] for c in vb["choices"]]
                == [c["logprobs"]["token_logprobs"] for c in rb["choices"]])
    if step == "models":
        return {m["id"] for m in vb["data"]} == {m["id"] for m in rb["data"]}
    return vb == rb


def differs(reason: str):
    return pytest.mark.xfail(strict=True, reason=f"router differs from vLLM: {reason}")


STEP_IDS = [
    "load", "load_again_same_path", "complete_adapter", "complete_alias_v0", "complete_unknown_model",
    "complete_batch_of_token_prompts", "complete_too_long", "models", "pause_bogus_mode", "pause_keep", "resume",
    "resume_again", "unload", "unload_again", "unload_never_loaded",
    pytest.param("load_missing_path", marks=differs(
        "vLLM 404 NotFoundError at once; the router 400 after its retry deadline (load_retry_deadline_s)")),
    "load_without_path", "complete_negative_token",
    "is_paused_after_bogus", "is_paused",
]


@pytest.mark.parametrize("step", STEP_IDS)
def test_router_answers_like_vllm(transcript, step):
    answer = transcript[step]
    assert same_answer(step, answer.vllm, answer.router), (answer.vllm, answer.router)


def test_transcript_for_the_report(transcript, capsys):
    """Prints the whole comparison (run with -s): the record the closing note quotes."""
    with capsys.disabled():
        for name, a in transcript.items():
            print(f"\n{name}: vLLM {a.vllm[0]} {str(a.vllm[1])[:300]} ({a.vllm_s:.2f}s)\n"
                  f"{' ' * len(name)}  router {a.router[0]} {str(a.router[1])[:300]} ({a.router_s:.2f}s) "
                  f"paused={a.router_state['paused']}")
    assert set(transcript) == {s[0] for s in steps({"trl-policy-v1": ""}, "")}


def test_a_refused_pause_leaves_the_router_running(transcript):
    assert transcript["pause_bogus_mode"].vllm[0] == 400
    assert transcript["pause_bogus_mode"].router_state["paused"] is False


def test_missing_adapter_path_waits_for_the_retry_deadline(transcript):
    """Deliberate: the router retries "No adapter found" until its deadline (a lagging shared mount), vLLM answers
    at once; both refuse the load."""
    answer = transcript["load_missing_path"]
    assert answer.vllm[0] == 404 and answer.router[0] >= 400
    # vLLM's answer takes what the machine's load makes it (0.34 s seen on a busy 2-core CI machine); the router's
    # adds the retry deadline on top, so the gap is what is asserted, not a ratio.
    assert answer.router_s - answer.vllm_s > 0.6 * LOAD_RETRY_DEADLINE_S
    assert answer.vllm_s < 0.6 * LOAD_RETRY_DEADLINE_S
