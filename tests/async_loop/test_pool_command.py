"""`grpo-lab serve-pool` and `grpo-lab async-loop --router-url POOL --run-name NAME` as a user meets them: bad settings
are one line naming the flag (exit 2, nothing started or written); the pool prints its URL and where its admin key
is, never the key, and stops every process it started."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from grpo_lab.async_loop import command, serve_pool
from grpo_lab.async_loop.pool import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, RUN_TOKEN_ENV
from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.tenancy.runs import TenancyConfig

from loop_fixtures import wait_gone


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def pool_router(tmp_path_factory):
    """A tenancy router with room for two default runs and one registered ('taken'); no replica needs to answer
    for these checks (its slots come from the tenancy's `adapter_slots`)."""
    key_file = tmp_path_factory.mktemp("pool") / "admin.key"
    serve_pool.write_admin_key(key_file)
    handle = start_router(RouterConfig(replicas=[_dead_url()], port=0, admin_api_key_file=str(key_file),
                                       tenancy=TenancyConfig(adapter_slots=2 * max_loras_for(4))))
    handle.register_run("taken", max_staleness=4)
    yield handle.url, str(key_file)
    handle.stop()


@pytest.fixture(autouse=True)
def no_pool_environment(monkeypatch):
    for name in (ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, RUN_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)


CASES = [
    ("key-without-router", lambda p, t: ["--pool-admin-key-file", p[1]], "--pool-admin-key-file", "--router-url"),
    ("weight-without-pool", lambda p, t: ["--run-weight", "2"], "--run-weight", "shared pool"),
    ("weight-zero", lambda p, t: ["--run-weight", "0"], "--run-weight", "> 0"),
    ("pool-without-key", lambda p, t: ["--router-url", p[0]], "--router-url", "--pool-admin-key-file"),
    ("key-file-missing", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", str(t / "nope")],
     "--pool-admin-key-file", "cannot read"),
    ("key-wrong", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", str(t / "wrong.key")],
     "--pool-admin-key-file", "refused the key"),
    ("name-with-separator", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", p[1], "--run-name", "a--b"],
     "--run-name", "single '-'"),
    ("name-taken", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", p[1], "--run-name", "taken"],
     "--run-name", "already on the pool"),
    ("pool-run-taken", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", p[1], "--run-name", "free",
                                     "--pool-run", "taken"], "--pool-run", "already on the pool"),
    ("pool-run-with-separator", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", p[1], "--pool-run",
                                              "a--b"], "--pool-run", "single '-'"),
    ("pool-run-without-router", lambda p, t: ["--pool-run", "sweep-a"], "--pool-run", "--router-url"),
    ("pool-run-without-a-pool", lambda p, t: ["--router-url", p[0], "--pool-run", "sweep-a"], "--pool-run",
     "--pool-admin-key-file"),
    ("pool-full", lambda p, t: ["--router-url", p[0], "--pool-admin-key-file", p[1], "--run-name", "big",
                                "--max-staleness", "8"], "--max-staleness", "adapter slots"),
    ("pool-dead", lambda p, t: ["--router-url", _dead_url(), "--pool-admin-key-file", p[1]], "--router-url",
     "nothing answers"),
]


@pytest.mark.parametrize("make_args, flag, word", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_pool_setting_is_one_line_naming_its_flag(make_args, flag, word, pool_router, tmp_path, capsys):
    (tmp_path / "wrong.key").write_text("not-the-key\n")
    args = make_args(pool_router, tmp_path) + ["--output-dir", str(tmp_path / "out")]
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert command.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and flag in lines[0] and word in lines[0], err
    assert "Traceback" not in err and "grpo-pool-" not in err  # the key is never echoed
    assert not (tmp_path / "out").exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


def test_a_free_name_on_a_pool_passes_the_checks(pool_router, tmp_path):
    settings = command.parse_settings(["--router-url", pool_router[0], "--pool-admin-key-file", pool_router[1],
                                       "--run-name", "sweep-a", "--output-dir", str(tmp_path / "out")])
    found = command.validate(settings)
    assert found.pool is not None and {r["name"] for r in found.pool["runs"]} == {"taken"}
    from grpo_lab.async_loop.launch import LoopConfig

    config = LoopConfig.from_settings(settings, joins_pool=found.pool is not None)
    assert config.pool_run_name == "sweep-a" and config.pool_admin_key_file == pool_router[1]
    assert not config.pool_rejoin


def test_the_pool_run_names_the_tenant_and_the_run_name_the_run(pool_router, tmp_path):
    """--pool-run is the run's name on the pool; --run-name stays the results' and the trackers' name."""
    settings = command.parse_settings(["--router-url", pool_router[0], "--pool-admin-key-file", pool_router[1],
                                       "--run-name", "lr-3e-3 seed 1", "--pool-run", "sweep-b",
                                       "--output-dir", str(tmp_path / "out")])
    found = command.validate(settings)
    from grpo_lab.async_loop.launch import LoopConfig

    config = LoopConfig.from_settings(settings, joins_pool=found.pool is not None)
    assert config.pool_run_name == "sweep-b" and settings.trainer_values()["run_name"] == "lr-3e-3 seed 1"
    plain = command.parse_settings(["--run-name", "sweep-c"])  # no pool: the name is the run's only
    assert LoopConfig.from_settings(plain).pool_run_name is None and plain.pool_name == "sweep-c"


@pytest.mark.parametrize("args, word", [(["--replicas", "0"], "--replicas"), (["--port", "70000"], "--port"),
                                        (["--adapter-slots", "2"], "--adapter-slots"),
                                        (["--replica-kind", "tpu"], "--replica-kind")])
def test_serve_pool_refuses_bad_settings_in_one_line(args, word, tmp_path, capsys):
    assert serve_pool.main(args + ["--state-dir", str(tmp_path / "pool")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and word in err and "Traceback" not in err


def test_serve_pool_help_lists_defaults_and_every_flag():
    text = serve_pool.build_parser().format_help()
    for needle in ("(default: 8000)", f"(default: {serve_pool.PoolConfig().adapter_slots})", "--no-base-model",
                   "--run-lease", "--max-in-flight-per-replica", "{cpu,vllm}", "--config FILE"):
        assert needle in text, needle


def test_serve_pool_prints_where_the_key_is_never_the_key_and_stops_what_it_started(tmp_path):
    state = tmp_path / "pool"
    proc = subprocess.Popen([sys.executable, "-m", "grpo_lab.cli", "serve-pool", "--replicas", "1", "--port", "0",
                             "--state-dir", str(state)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("join it:") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        text = "".join(lines)
        url = text.split("shared pool ready: ", 1)[1].split()[0]
        key_file = state / "admin.key"
        key = key_file.read_text().strip()
        assert f"admin key in {key_file}" in text and key not in text
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
        assert requests.get(url + "/health", timeout=5).status_code == 200
        assert requests.get(url + "/v1/models", timeout=5).status_code == 401
        runs = requests.get(url + "/router/runs", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()
        assert runs["runs"] == [] and runs["adapter_slots"] == serve_pool.PoolConfig().adapter_slots
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert children  # the replica (under its watchdog)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        rest = proc.stdout.read()
        assert "shared pool stopped" in rest and key not in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert wait_gone(children, 20) == []
    assert (state / "pool.json").exists() and (state / "logs" / "replica-0.log").exists()
