"""Issue 43 #11: a run name already on a shared pool is refused before the slow imports. The refusal took 22 s, all
of it importing torch, transformers and TRL for the settings' parser; now the pool is asked first (0.7-0.9 s
measured on the 2-core VM at load 10). No timing is asserted: the proof is that the refusal (one line, exit 2) comes
from a process that never imported torch, transformers or TRL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.async_loop import serve_pool
from grpo_lab.async_loop.pool import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, DEFAULT_RUN_NAME, RUN_TOKEN_ENV
from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.tenancy.runs import TenancyConfig

HEAVY = ("torch", "transformers", "trl", "peft")
PROBE = """
import json, sys
from grpo_lab.async_loop import command
code = command.main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A tenancy router with the runs 'taken' and the default name registered (no replica needs to answer)."""
    key_file = tmp_path_factory.mktemp("pool") / "admin.key"
    serve_pool.write_admin_key(key_file)
    handle = start_router(RouterConfig(replicas=["http://127.0.0.1:9"], port=0, admin_api_key_file=str(key_file),
                                       tenancy=TenancyConfig(adapter_slots=3 * max_loras_for(4))))
    handle.register_run("taken", max_staleness=4)
    handle.register_run(DEFAULT_RUN_NAME, max_staleness=4)
    yield handle.url, str(key_file)
    handle.stop()


def _run(args: list[str], tmp_path: Path, env: dict | None = None) -> tuple[dict, list[str]]:
    base = {k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, RUN_TOKEN_ENV)}
    done = subprocess.run([sys.executable, "-c", PROBE, *args, "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, env={**base, **(env or {})}, timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return json.loads(done.stdout.strip().splitlines()[-1]), lines


@pytest.mark.parametrize("how", ["run-name", "pool-run", "default-name-key-in-environment"])
def test_a_name_taken_on_the_pool_is_refused_before_the_slow_imports(pool, tmp_path, how):
    url, key_file = pool
    args, env, flag, name = {
        "run-name": (["--router-url", url, "--pool-admin-key-file", key_file, "--run-name", "taken"], None,
                     "--run-name", "taken"),
        "pool-run": (["--router-url", url, "--pool-admin-key-file", key_file, "--run-name", "free",
                      "--pool-run=taken"], None, "--pool-run", "taken"),
        "default-name-key-in-environment": (["--router-url", url], {ADMIN_KEY_FILE_ENV: key_file}, "--run-name",
                                            DEFAULT_RUN_NAME),
    }[how]
    answer, err = _run(args, tmp_path, env)
    assert answer == {"code": 2, "heavy": []}, (answer, err)
    assert err == [f"grpo-lab async-loop: error: {flag}: run '{name}' is already on the pool at {url} (another "
                   "process uses that name?): pick another name, or --resume it"]
    assert not (tmp_path / "out").exists()


def test_a_free_name_goes_on_to_the_full_checks(pool, tmp_path):
    """The quick question lets a free name through: the full checks then run (and refuse the bad --max-steps)."""
    url, key_file = pool
    answer, err = _run(["--router-url", url, "--pool-admin-key-file", key_file, "--run-name", "free",
                        "--max-steps", "0"], tmp_path)
    assert answer["code"] == 2 and len(err) == 1 and "--max-steps" in err[0], (answer, err)
