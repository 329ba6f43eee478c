"""`python -m grpo_lab.serving.router` as a real subprocess in front of fake replicas: startup, routing, logs."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import requests

from .conftest import trl_payload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_router_cli_against_fake_replicas(token, tmp_path):
    fake = subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.fake_replica", "--ports", "0", "0",
                             "--delay-s", "0.01"], stdout=subprocess.PIPE, text=True)
    log_path = tmp_path / "router.log"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    router = None
    try:
        ports = fake.stdout.readline().split()[1:]
        assert len(ports) == 2
        port = free_port()
        with open(log_path, "w") as log:
            router = subprocess.Popen(
                [sys.executable, "-m", "grpo_lab.serving.router", "--port", str(port), "--log-level", "DEBUG",
                 "--api-key-file", str(token_file), "--health-interval", "0.2",
                 *sum((["--replica", f"http://127.0.0.1:{p}"] for p in ports), [])],
                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.1)
        else:
            raise AssertionError("router never became healthy:\n" + log_path.read_text())
        assert requests.get(url + "/server_info", params={"config_format": "json"},
                            timeout=5).json()["vllm_config"]["parallel_config"]["data_parallel_size"] == 1
        for seed in range(8):
            reply = requests.post(url + "/v1/completions", json=trl_payload("fake", list(range(64)), seed), timeout=10)
            assert reply.status_code == 200
        served = [requests.get(f"http://127.0.0.1:{p}/served", timeout=5).json()["n"] for p in ports]
        assert sorted(served) == [0, 8]
        state = requests.get(url + "/router/state", timeout=5).json()
        assert state["routing"] == {"affinity": 7, "spilled": 0, "unmatched": 1}
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=10)
        fake.terminate()
        fake.wait(timeout=10)
    text = log_path.read_text()
    assert "in service" in text and token not in text


def test_wrong_token_keeps_replica_out_with_a_clear_reason(token, adapters, monkeypatch):
    from grpo_lab.serving.processes import start_cpu_replicas
    from grpo_lab.serving.router import start_router
    from grpo_lab.serving.router_config import RouterConfig

    from .conftest import REPLICA_ARGS

    monkeypatch.setenv("GRPO_LAB_TEST_WRONG_TOKEN", "not-" + token)
    (replica,) = start_cpu_replicas(1, REPLICA_ARGS, env={"VLLM_API_KEY": token})
    router = start_router(RouterConfig(replicas=[replica.url], port=0, api_key_env="GRPO_LAB_TEST_WRONG_TOKEN",
                                       health_interval_s=0.1))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = requests.get(router.url + "/router/state", timeout=5).json()["replicas"][0]
            if state["last_error"]:
                break
            time.sleep(0.05)
        assert state["state"] != "in_service" and "401" in state["last_error"]
        assert token not in state["last_error"]
        assert requests.get(router.url + "/health", timeout=5).status_code == 503
    finally:
        router.stop()
        replica.stop()
