"""The project's async loop (TRL's AsyncGRPOTrainer on the CPU, LoRA adapters on storage) training a few steps on
the two real vLLM replicas behind the router: every published version reaches vLLM itself, every sample is within
max_staleness, and the importance ratio between the trainer and vLLM's processed logprobs stays near 1."""

from __future__ import annotations

import math

from .conftest import MAX_STALENESS, served_models, unload

STEPS = 4


def test_async_loop_trains_on_vllm_replicas(cluster, model_dir, token, tmp_path):
    from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
    from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics

    args = embedded_trainer_args(str(tmp_path / "run"), max_steps=STEPS, max_staleness=MAX_STALENESS,
                                 save_strategy="no")
    loop = AsyncLoop(LoopConfig(router_url=cluster.url, model=model_dir), args, progress=False)
    try:
        with loop:
            loop.train()
        trainer = loop.trainer
        rows = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if "train_runtime" not in r]
        assert trainer.state.global_step == STEPS and [r["step"] for r in rows] == list(range(1, STEPS + 1))
        live = {f"trl-policy-v{v}" for v in trainer._live_versions}
        assert live
        for replica in cluster.replicas:  # vLLM's own list: exactly the versions samples may still use
            assert {m for m in served_models(replica, token) if m.startswith("trl-policy-v")} - {"trl-policy-v0"} \
                == live - {"trl-policy-v0"}
        versions = [p["version"] for p in trainer.published]
        for r in rows:
            assert r["sample/staleness_max"] <= MAX_STALENESS
            if "rollout/version_min" in r:
                assert versions[0] <= r["rollout/version_min"] <= r["rollout/version_max"] <= versions[-1]
            assert 0.9 <= r["ratio"] <= 1.1, r["ratio"]  # the trainer and vLLM score the same policy
            assert math.isfinite(r["reward"]) and math.isfinite(r["loss"])
    finally:  # leave the replicas holding no adapter for the tests after this one
        for replica in cluster.replicas:
            for name in served_models(replica, token):
                if name.startswith("trl-policy-v") and name != "trl-policy-v0":
                    unload(cluster, token, name)
