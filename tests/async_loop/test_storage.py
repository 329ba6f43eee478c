"""Adapter storage: atomic publishing, names never reused, manifests that prove content, on local and fsspec roots."""

import json
import uuid

import fsspec
import pytest

from grpo_lab.serving.adapters.storage import MANIFEST, AdapterStore, fetch_adapter, version_of


def adapter_dir(tmp_path, seed: int):
    d = tmp_path / f"adapter-{seed}-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 1, "seed": seed}))
    (d / "adapter_model.safetensors").write_bytes(bytes([seed]) * 64)
    return d


@pytest.fixture(params=["local", "file_url", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        yield AdapterStore(tmp_path / "root")
        return
    if request.param == "file_url":
        yield AdapterStore(f"file://{tmp_path}/root")
        return
    root = f"memory://grpo-lab-test-{uuid.uuid4().hex[:8]}"
    yield AdapterStore(root)
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_publish_then_read_back(store, tmp_path):
    published = store.publish(adapter_dir(tmp_path, 1), "trl-policy-v1", version=1, step=0)
    assert store.published_names() == ["trl-policy-v1"]
    assert store.verify("trl-policy-v1")
    assert store.manifest("trl-policy-v1").digest == published.digest
    assert store.manifest("trl-policy-v1").run_id == store.run_id
    assert store.highest_version("trl-policy") == 1
    other = store.publish(adapter_dir(tmp_path, 2), "trl-policy-v2", version=2)
    assert other.digest != published.digest  # different weights, different content identity


def test_a_name_is_never_reused(store, tmp_path):
    store.publish(adapter_dir(tmp_path, 1), "trl-policy-v7")
    with pytest.raises(FileExistsError, match="never be reused"):
        store.publish(adapter_dir(tmp_path, 2), "trl-policy-v7")
    store.delete("trl-policy-v7")
    assert store.published_names() == []
    with pytest.raises(FileExistsError):  # deleted files do not free the name: the history remembers it
        store.publish(adapter_dir(tmp_path, 2), "trl-policy-v7")
    # a second store on the same root (the resumed trainer) sees the history too
    assert AdapterStore(store.url).highest_version("trl-policy") == 7


def test_tampered_files_fail_verification(store, tmp_path):
    store.publish(adapter_dir(tmp_path, 1), "a-v1")
    store.fs.pipe_file(store._join("a-v1", "adapter_model.safetensors"), b"corrupt")
    assert not store.verify("a-v1")


def test_object_store_version_invisible_until_manifest(tmp_path):
    """Without rename, a version whose manifest is not written yet does not exist for readers."""
    store = AdapterStore(f"memory://grpo-lab-partial-{uuid.uuid4().hex[:8]}")
    store.fs.pipe_file(store._join("trl-policy-v3", "adapter_config.json"), b"{}")  # an upload cut short
    assert store.published_names() == []
    with pytest.raises(FileNotFoundError, match="No adapter found"):
        fetch_adapter(store.replica_path("trl-policy-v3"), tmp_path / "dest")
    store.publish(adapter_dir(tmp_path, 4), "trl-policy-v4")
    dest = fetch_adapter(store.replica_path("trl-policy-v4"), tmp_path / "dest")
    assert (dest / "adapter_config.json").is_file() and (dest / MANIFEST).is_file()


def test_local_publish_is_a_rename_and_crash_leftovers_are_cleaned(tmp_path):
    store = AdapterStore(tmp_path / "root")
    (tmp_path / "root" / ".trl-policy-v1.staging-dead").mkdir()  # what a crash mid-copy leaves
    assert store.published_names() == []
    assert store.clean_staging() == 1
    store.publish(adapter_dir(tmp_path, 1), "trl-policy-v1")
    assert store.replica_path("trl-policy-v1") == str(tmp_path / "root" / "trl-policy-v1")
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [".history", "trl-policy-v1"]


def test_replica_root_maps_a_mounted_bucket():
    store = AdapterStore(f"memory://bucket-{uuid.uuid4().hex[:6]}/adapters", replica_root="/mnt/bucket/adapters")
    assert store.replica_path("trl-policy-v2") == "/mnt/bucket/adapters/trl-policy-v2"


def test_refuses_a_directory_that_is_not_an_adapter(tmp_path):
    store = AdapterStore(tmp_path / "root")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        store.publish(tmp_path / "empty", "x-v1")


def test_version_of():
    assert version_of("trl-policy-v12", "trl-policy") == 12
    assert version_of("trl-policy-v0", "trl-policy") == 0
    assert version_of("other-v3", "trl-policy") is None
    assert version_of("trl-policy-vx", "trl-policy") is None


def test_cpu_replica_loads_from_an_object_store_url_and_checks_manifests(tmp_path):
    """A replica without the bucket mounted fetches the published version; a copy that does not match its
    manifest is refused rather than served."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_lab.tasks.embedded_model import embedded_model_dir
    from grpo_lab.serving.replicas.generation import Engine, RequestError
    from grpo_lab.serving.replicas.config import CPUReplicaConfig

    model_dir = str(embedded_model_dir())
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    store = AdapterStore(f"memory://bucket-{uuid.uuid4().hex[:8]}")
    store.publish(tmp_path / "adapter", "trl-policy-v1")
    engine = Engine(CPUReplicaConfig(model=model_dir, max_lora_rank=1, max_loras=3))
    with pytest.raises(RequestError, match="No adapter found"):  # not published (yet): retried by the router
        engine.load_adapter("trl-policy-v2", store.replica_path("trl-policy-v2"))
    engine.load_adapter("trl-policy-v1", store.replica_path("trl-policy-v1"))
    assert engine.adapters["trl-policy-v1"] == store.replica_path("trl-policy-v1")

    local = AdapterStore(tmp_path / "root")
    local.publish(tmp_path / "adapter", "trl-policy-v3")
    (tmp_path / "root" / "trl-policy-v3" / "adapter_model.safetensors").write_bytes(b"truncated")
    with pytest.raises(RequestError, match="does not match its manifest"):
        engine.load_adapter("trl-policy-v3", local.replica_path("trl-policy-v3"))
