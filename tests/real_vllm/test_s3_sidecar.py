"""Real vLLM loads an adapter published on S3 (moto, its own process) through the adapter sidecar: vLLM is given a
verified local copy, and samples exactly what the same adapter loaded from a local path samples."""

from __future__ import annotations

from pathlib import Path

from grpo_lab.serving.adapters.sidecar import start_sidecar
from grpo_lab.serving.adapters.storage import AdapterStore

from .conftest import TOKEN_ENV, direct, served_models, trl_payload


def test_vllm_behind_the_sidecar_serves_an_s3_adapter(replicas, adapters, token, s3_url, tmp_path):
    store = AdapterStore(f"{s3_url}/adapters")
    store.publish(adapters["trl-policy-v1"], "s3-policy-v1")
    url = store.replica_path("s3-policy-v1")
    sidecar = start_sidecar(replicas[0].url, cache_dir=str(tmp_path / "cache"), api_key_env=TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"}
    try:
        import requests

        loaded = requests.post(sidecar.url + "/v1/load_lora_adapter", headers=headers, timeout=120,
                               json={"lora_name": "s3-policy-v1", "lora_path": url})
        assert loaded.status_code == 200, loaded.text
        roots = {m["id"]: m["root"] for m in direct(replicas[0], token, "GET", "/v1/models").json()["data"]}
        assert Path(roots["s3-policy-v1"]).parent == tmp_path / "cache"  # vLLM read the node-local copy
        via_sidecar = {m["id"]: m["root"] for m in requests.get(sidecar.url + "/v1/models", headers=headers,
                                                                 timeout=30).json()["data"]}
        assert via_sidecar["s3-policy-v1"] == url
        assert direct(replicas[1], token, "POST", "/v1/load_lora_adapter", json={
            "lora_name": "local-policy-v1", "lora_path": adapters["trl-policy-v1"]}).status_code == 200
        payload = trl_payload("s3-policy-v1", [10, 11, 12, 13], seed=3)
        from_s3 = requests.post(sidecar.url + "/v1/completions", headers=headers, json=payload, timeout=120)
        from_disk = direct(replicas[1], token, "POST", "/v1/completions",
                           json={**payload, "model": "local-policy-v1"})
        assert from_s3.status_code == 200 and from_disk.status_code == 200
        assert from_s3.json()["choices"][0]["token_ids"] == from_disk.json()["choices"][0]["token_ids"]
        assert requests.post(sidecar.url + "/v1/unload_lora_adapter", headers=headers, timeout=120,
                             json={"lora_name": "s3-policy-v1"}).status_code == 200
        assert list((tmp_path / "cache").iterdir()) == []
    finally:  # the replicas are the tier's: leave them as they were
        for replica, name in ((replicas[0], "s3-policy-v1"), (replicas[1], "local-policy-v1")):
            if name in served_models(replica, token):
                direct(replica, token, "POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        sidecar.stop()
