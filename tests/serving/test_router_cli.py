"""`python -m grpo_lab.serving.router.server` as a real subprocess in front of fake replicas: startup, routing, logs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from .conftest import served_after_same_prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fake(token: str, *ports: str) -> subprocess.Popen:
    """Fake replicas that demand `token`, as vLLM does with VLLM_API_KEY set."""
    return subprocess.Popen([sys.executable, "-m", "grpo_lab.serving.replicas.fake_replica", "--ports", *ports,
                             "--delay-s", "0.01"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "VLLM_API_KEY": token})


def test_router_cli_against_fake_replicas(token, tmp_path):
    fake = start_fake(token, "0", "0")
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
                [sys.executable, "-m", "grpo_lab.serving.router.server", "--port", str(port), "--log-level", "DEBUG",
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
        served = served_after_same_prompt(url, ports, token)
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


def test_wrong_token_keeps_replica_out_with_a_clear_reason(token, monkeypatch):
    from grpo_lab.serving.router.thread import start_router
    from grpo_lab.serving.router.config import RouterConfig

    monkeypatch.setenv("GRPO_LAB_TEST_WRONG_TOKEN", "not-" + token)
    fake = start_fake(token, "0")
    router = None
    try:
        port = fake.stdout.readline().split()[1]
        router = start_router(RouterConfig(replicas=[f"http://127.0.0.1:{port}"], port=0,
                                           api_key_env="GRPO_LAB_TEST_WRONG_TOKEN", health_interval_s=0.1))
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
        if router is not None:
            router.stop()
        fake.terminate()
        fake.wait(timeout=10)


def test_replicas_do_not_outlive_a_crashed_parent():
    """A test or notebook that dies without stopping its replicas must not leave them running."""
    script = ("import os, sys\n"
              "from grpo_lab.serving.replicas.processes import start_cpu_replicas\n"
              "(r,) = start_cpu_replicas(1)\n"
              "print(r.proc.pid, flush=True)\n"
              "os._exit(1)\n")  # crash: no stop(), no cleanup
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(parent.stdout.split()[-1])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the replica outlived its parent")


def test_python_dash_m_grpo_lab_router_is_the_router_cli():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "grpo_lab.router", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--replica" in out.stdout


ROUTER_FLAGS = """--replica --host --port --api-key-env --api-key-file --client-api-key-env --client-api-key-file
--adapter-root --insecure --admin-api-key-env --admin-api-key-file --remove-drain-timeout --no-hedge --per-try-quantile
--per-try-factor --per-try-floor --per-try-cap --routing-policy --block-size --spill-threshold --max-blocks
--health-interval --load-retry-deadline --upstream-timeout --max-body-bytes --body-read-timeout --unload-drain-timeout
--tenancy --run-lease --max-in-flight-per-replica --no-base-model --log-level""".split()


def test_generated_router_flags_keep_their_names_and_reach_the_nested_configs():
    from grpo_lab.serving.router.server import build_parser

    parser = build_parser()
    assert set(ROUTER_FLAGS) <= set(parser._option_string_actions)
    config, _ = parser.parse(["--replica", "http://127.0.0.1:9/", "--replica", "http://127.0.0.1:10", "--no-hedge",
                              "--per-try-cap", "9", "--block-size", "32", "--health-interval", "0.5", "--tenancy",
                              "--admin-api-key-env", "K", "--run-lease", "5", "--no-base-model"])
    assert config.replicas == ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    assert (config.per_try.enabled, config.per_try.cap_s, config.routing.block_size) == (False, 9.0, 32)
    assert config.health_interval_s == 0.5
    assert (config.tenancy.lease_s, config.tenancy.allow_base_model) == (5.0, False)
    assert parser.parse(["--replica", "http://127.0.0.1:9"])[0].tenancy is None


@pytest.mark.parametrize("argv, words", [
    (["--health-interval", "0"], "--health-interval: must be > 0"),
    (["--max-body-bytes", "ten"], "--max-body-bytes: 'ten' is not an integer"),
    (["--per-try-floor", "400"], "floor_s <= cap_s"),
    (["--tenancy"], "tenancy needs an admin key"),
])
def test_a_bad_router_flag_is_one_line_and_exit_2(argv, words, capsys):
    from grpo_lab.serving.router.server import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse(["--replica", "http://127.0.0.1:9", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and words in err, err
