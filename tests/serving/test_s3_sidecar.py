"""The adapter sidecar: a vLLM-shaped server that can only load local paths gets versions published on S3, through
the router's all-or-nothing fan-out, with every copy verified and removed again on unload."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests

from grpo_lab.serving.adapters.sidecar import start_sidecar
from grpo_lab.serving.replicas.processes import SidecarProcess, start_cpu_replicas
from grpo_lab.serving.router.config import RouterConfig
from grpo_lab.serving.router.thread import start_router
from grpo_lab.serving.adapters.storage import MANIFEST, AdapterStore

from .conftest import REPLICA_ARGS, metric
from .fake_vllm import FakeCluster, FakeVLLM

TOKEN_ENV = "GRPO_LAB_TEST_SIDECAR_TOKEN"


def _adapter(root: Path, seed: int) -> Path:
    d = root / f"adapter-{seed}"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 1, "seed": seed}))
    (d / "adapter_model.safetensors").write_bytes(bytes([seed]) * 4096)
    return d


def _post(url: str, path: str, body: dict, token: str | None = None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(url + path, json=body, headers=headers, timeout=60)


def _copies(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def test_router_fans_out_s3_loads_through_sidecars(s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "sidecar-token")
    store = AdapterStore(f"{s3_url}/adapters")
    fakes = [FakeVLLM(max_loras=4), FakeVLLM(max_loras=4)]
    caches = [tmp_path / "node-0", tmp_path / "node-1"]
    with FakeCluster(*fakes):
        sidecars = [start_sidecar(f.url, cache_dir=str(c), api_key_env=TOKEN_ENV) for f, c in zip(fakes, caches)]
        router = start_router(RouterConfig(replicas=[s.url for s in sidecars], port=0, api_key_env=TOKEN_ENV,
                                           health_interval_s=0.2, load_retry_deadline_s=5, control_timeout_s=30,
                                           upstream_timeout_s=30))
        try:
            router.wait_ready(2, timeout=30)
            v1 = store.replica_path("trl-policy-v1")
            store.publish(_adapter(tmp_path, 1), "trl-policy-v1")
            answer = _post(router.url, "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": v1})
            assert answer.status_code == 200, answer.text
            for fake, cache, sidecar in zip(fakes, caches, sidecars):
                local = Path(fake.adapters["trl-policy-v1"])  # vLLM got a path on its own disk ...
                assert local.parent == cache and (local / "adapter_config.json").is_file()
                assert json.loads((local / MANIFEST).read_text())["digest"] == store.manifest("trl-policy-v1").digest
                listed = requests.get(sidecar.url + "/v1/models", timeout=10).json()["data"]
                assert {c["id"]: c["root"] for c in listed if c["parent"]}["trl-policy-v1"] == v1  # ... and says v1
            done = _post(router.url, "/v1/completions", {"model": "trl-policy-v1", "prompt": [1, 2, 3],
                                                         "max_tokens": 1})
            assert done.status_code == 200, done.text

            # published while the load is already retrying: "No adapter found" until the manifest lands
            v2 = store.replica_path("trl-policy-v2")
            late = []
            loader = threading.Thread(target=lambda: late.append(_post(
                router.url, "/v1/load_lora_adapter", {"lora_name": "trl-policy-v2", "lora_path": v2})))
            loader.start()
            time.sleep(0.8)
            store.publish(_adapter(tmp_path, 2), "trl-policy-v2")
            loader.join(30)
            assert late and late[0].status_code == 200, late and late[0].text
            assert all("trl-policy-v2" in f.adapters for f in fakes)
            assert metric(router.url, "grpo_router_adapter_load_retries_total") > 0  # it did wait for the manifest

            # a file changed in the bucket after publishing: refused everywhere, nothing copied is left behind
            store.publish(_adapter(tmp_path, 3), "trl-policy-v3")
            store.fs.pipe_file(store._join("trl-policy-v3", "adapter_model.safetensors"), b"tampered")
            bad = _post(router.url, "/v1/load_lora_adapter",
                        {"lora_name": "trl-policy-v3", "lora_path": store.replica_path("trl-policy-v3")})
            assert bad.status_code == 400 and "does not match its manifest" in bad.text
            assert not any("trl-policy-v3" in f.adapters for f in fakes)

            # unload: the copies go with the adapter
            assert _post(router.url, "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}).status_code == 200
            deadline = time.monotonic() + 20  # the router drains it first
            while any(any(n.startswith("trl-policy-v1-") for n in _copies(c)) for c in caches):
                assert time.monotonic() < deadline, [_copies(c) for c in caches]
                time.sleep(0.1)
            assert all(any(n.startswith("trl-policy-v2-") for n in _copies(c)) for c in caches)
            assert not any(n.startswith("trl-policy-v3-") or n.startswith(".") for c in caches for n in _copies(c))

            # a mounted bucket or shared disk: the path goes through untouched
            mounted = str(_adapter(tmp_path / "mnt", 4))
            assert _post(router.url, "/v1/load_lora_adapter",
                         {"lora_name": "local-v4", "lora_path": mounted}).status_code == 200
            assert all(f.adapters["local-v4"] == mounted for f in fakes)

            # the sidecar downloads nothing for a caller the server would refuse
            store.publish(_adapter(tmp_path, 5), "trl-policy-v5")
            refused = _post(sidecars[0].url, "/v1/load_lora_adapter",
                            {"lora_name": "trl-policy-v5", "lora_path": store.replica_path("trl-policy-v5")},
                            token="wrong")
            assert refused.status_code == 401 and not any(n.startswith("trl-policy-v5") for n in _copies(caches[0]))
        finally:
            router.stop()
            for sidecar in sidecars:
                sidecar.stop()
    assert all(_copies(c) == [] for c in caches)  # a stopped sidecar removes the copies it made


@pytest.mark.timeout(180)
def test_sidecar_process_in_front_of_a_cpu_replica(s3_url, adapters, tmp_path):
    """`python -m grpo_lab.serving.adapters.sidecar` as a managed child process, in front of a real replica that is
    given local paths only: the replica generates with the adapter published on S3."""
    store = AdapterStore(f"{s3_url}/adapters")
    store.publish(adapters["trl-policy-v1"], "trl-policy-v1")
    (replica,) = start_cpu_replicas(1, REPLICA_ARGS)
    sidecar = None
    try:
        sidecar = SidecarProcess(replica.url, cache_dir=tmp_path / "cache").wait_ready()
        url = store.replica_path("trl-policy-v1")
        loaded = _post(sidecar.url, "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": url})
        assert loaded.status_code == 200, loaded.text
        held = {c["id"]: c["root"] for c in requests.get(replica.url + "/v1/models", timeout=10).json()["data"]}
        assert Path(held["trl-policy-v1"]).parent == tmp_path / "cache"  # the replica read a local copy
        body = {"model": "trl-policy-v1", "prompt": [1, 2, 3, 4], "max_tokens": 3, "seed": 0, "logprobs": 0,
                "return_token_ids": True}
        via_sidecar = _post(sidecar.url, "/v1/completions", body)
        assert via_sidecar.status_code == 200 and len(via_sidecar.json()["choices"][0]["token_ids"]) == 3
        assert via_sidecar.json() ["choices"][0]["token_ids"] == _post(replica.url, "/v1/completions", body).json()[
            "choices"][0]["token_ids"]  # the same adapter, the same seed: the same tokens
        missing = _post(sidecar.url, "/v1/load_lora_adapter",
                        {"lora_name": "trl-policy-v9", "lora_path": store.replica_path("trl-policy-v9")})
        assert missing.status_code == 404 and "No adapter found" in missing.text  # what the router retries
        assert _post(sidecar.url, "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}).status_code == 200
        assert _copies(tmp_path / "cache") == []
    finally:
        if sidecar is not None:
            sidecar.stop()
        replica.stop()
    assert not sidecar.alive() and not replica.alive()
