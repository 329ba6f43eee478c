"""Every place that sizes adapter slots takes the number from `adapter_slots`: the vLLM launcher, LocalCluster,
the trainer's preflight and the doctor; and the default `max_staleness` is TRL's."""

from __future__ import annotations

import re
import types

import pytest

from grpo_lab.serving.adapters.slots import DEFAULT_MAX_STALENESS, max_loras_for, min_max_loras

STALENESS = (0, 1, 4, 7, 16)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_two_numbers():
    """TRL's minimum (max_staleness + 1 versions in flight, one more while a sync loads before it unloads) and the
    router's drain slot on top."""
    assert [min_max_loras(s) for s in STALENESS] == [s + 2 for s in STALENESS]
    assert [max_loras_for(s) for s in STALENESS] == [s + 3 for s in STALENESS]
    with pytest.raises(ValueError):
        max_loras_for(-1)


def test_default_max_staleness_is_trls():
    from trl.experimental.async_grpo import AsyncGRPOConfig

    assert DEFAULT_MAX_STALENESS == AsyncGRPOConfig.__dataclass_fields__["max_staleness"].default


def test_serving_defaults_use_it():
    from grpo_lab.serving.clusters.local import LocalCluster
    from grpo_lab.serving.replicas.vllm_spec import VLLMReplicaSpec

    assert VLLMReplicaSpec(model="m").max_staleness == DEFAULT_MAX_STALENESS
    assert flag(LocalCluster().args, "--max-loras") == str(max_loras_for(DEFAULT_MAX_STALENESS))


@pytest.mark.parametrize("staleness", STALENESS)
def test_vllm_launcher_starts_replicas_with_max_loras_for(staleness, capsys):
    from grpo_lab.serving.replicas.vllm_launcher import main
    from grpo_lab.serving.replicas.vllm_spec import VLLMReplicaSpec, replica_specs

    for device in ("cuda", "cpu"):
        spec = VLLMReplicaSpec(model="m", max_staleness=staleness, device=device, python="/p")
        assert flag(spec.command(), "--max-loras") == str(max_loras_for(staleness))
    assert {flag(s.command(), "--max-loras") for s in replica_specs("m", 2, max_staleness=staleness)} == \
        {str(max_loras_for(staleness))}
    main(["--model", "m", "--max-staleness", str(staleness), "--replicas", "2"])
    replica_lines = capsys.readouterr().out.strip().splitlines()[:-1]  # the last one is the router's
    assert [re.search(r"--max-loras (\d+)", line).group(1) for line in replica_lines] == \
        [str(max_loras_for(staleness))] * 2


@pytest.mark.parametrize("staleness", STALENESS)
def test_local_cluster_starts_replicas_with_max_loras_for(staleness):
    from grpo_lab.serving.clusters.local import LocalCluster

    cluster = LocalCluster(max_staleness=staleness)  # not started: its replica arguments are fixed already
    assert flag(cluster.args, "--max-loras") == str(max_loras_for(staleness))


class _Server:
    """What preflight's `check_server` reads from TRL's VLLMClient."""

    server_url = "http://127.0.0.1:1"

    def __init__(self, lora_config):
        self.lora_config = lora_config

    def wait_for_server_ready(self):
        pass

    def get_server_info(self):
        return {"lora_config": self.lora_config}


@pytest.mark.parametrize("staleness", STALENESS)
def test_preflight_requires_trls_minimum_and_advises_max_loras_for(staleness):
    from grpo_lab.async_loop.preflight import PreflightError, check_server

    peft = types.SimpleNamespace(r=1, rank_pattern={})
    lowest = min_max_loras(staleness)
    check_server(_Server({"max_lora_rank": 8, "max_loras": lowest}), peft, staleness)
    with pytest.raises(PreflightError) as caught:
        check_server(_Server({"max_lora_rank": 8, "max_loras": lowest - 1}), peft, staleness)
    assert f"needs {lowest}" in str(caught.value)
    assert f"--max-loras {max_loras_for(staleness)} " in str(caught.value)
    with pytest.raises(PreflightError) as caught:
        check_server(_Server(None), peft, staleness)  # started without --enable-lora
    assert str(caught.value).endswith(f"--max-loras {max_loras_for(staleness)})")


@pytest.mark.parametrize("staleness", STALENESS)
def test_doctors_advice_names_max_loras_for(staleness):
    from grpo_lab.async_loop.doctor import diagnose

    # samples going stale (a quarter of each step's dropped): the doctor suggests a larger max_staleness
    rows = [{"step": i + 1, "perf/step_s": 2.0, "perf/rollout_wait_s": 0.0, "perf/fwd_bwd_s": 1.5,
             "perf/weight_sync_s": 0.2, "sample/rollout_queue_size": 60.0, "batch/samples_per_step": 16.0,
             "batch/groups_per_step": 2.0, "sample/staleness_mean": 0.9 * staleness, "ratio": 1.0, "reward": 0.5,
             "sample/dropped_stale_total": 4.0} for i in range(12)]
    verdict = diagnose(rows, max_staleness=staleness)
    advice = [k for k in verdict.knobs if "larger max_staleness" in k]
    assert advice, verdict
    assert f"--max-loras {max_loras_for(staleness + 1)} for max_staleness {staleness + 1}" in advice[0]
