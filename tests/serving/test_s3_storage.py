"""Adapter storage on a real S3-compatible server (moto, its own process): atomic publish, kill -9 mid-publish,
names never reused, clear errors for a missing bucket and refused credentials, replicas that copy and verify."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from grpo_lab.serving.adapters.cache import AdapterCache, sweep_orphans
from grpo_lab.serving.adapters.storage import MANIFEST, AdapterStore, fetch_adapter, storage_reachable

from s3_fixtures import forget_s3_clients


def adapter_dir(root: Path, seed: int, files: int = 1, size: int = 64) -> Path:
    d = root / f"adapter-{seed}"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 1, "seed": seed}))
    for i in range(files):
        (d / f"shard-{i:02d}.safetensors").write_bytes(os.urandom(size))
    return d


def test_publish_list_verify_fetch_on_s3(s3_url, tmp_path):
    store = AdapterStore(f"{s3_url}/adapters")
    assert store.published_names() == [] and store.highest_version("trl-policy") == 0  # nothing written yet
    published = store.publish(adapter_dir(tmp_path, 1), "trl-policy-v1", version=1, step=0)
    store.publish(adapter_dir(tmp_path, 2), "trl-policy-v2", version=2, step=1)
    other = AdapterStore(f"{s3_url}/adapters")  # another process's view: the resumed trainer, a replica
    assert other.published_names() == ["trl-policy-v1", "trl-policy-v2"]
    assert other.verify("trl-policy-v1") and other.manifest("trl-policy-v1").digest == published.digest
    assert other.highest_version("trl-policy") == 2
    assert store.replica_path("trl-policy-v1") == f"{s3_url}/adapters/trl-policy-v1"
    dest = fetch_adapter(store.replica_path("trl-policy-v1"), tmp_path / "copy")
    assert json.loads((dest / MANIFEST).read_text())["digest"] == published.digest
    store.delete("trl-policy-v1")
    assert other.published_names() == ["trl-policy-v2"]
    with pytest.raises(FileExistsError, match="never be reused"):
        other.publish(adapter_dir(tmp_path, 3), "trl-policy-v1")


_PUBLISHER = """
import json, os, sys
from pathlib import Path
from grpo_lab.serving.adapters.storage import AdapterStore
url, name, files, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = Path(sys.argv[5])
d.mkdir()
(d / "adapter_config.json").write_text(json.dumps({"r": 1}))
for i in range(files):
    (d / f"shard-{i:02d}.safetensors").write_bytes(os.urandom(size))
print("PUBLISHING", flush=True)
AdapterStore(url).publish(d, name)
print("DONE", flush=True)
"""


def _publisher(url: str, name: str, tmp_path: Path, files: int, size: int) -> subprocess.Popen:
    """A separate process publishing an adapter of `files` shards: what a trainer is, to the store."""
    return subprocess.Popen([sys.executable, "-c", _PUBLISHER, url, name, str(files), str(size),
                             str(tmp_path / f"src-{name}")], stdout=subprocess.PIPE, text=True)


def _remote_files(url: str, name: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return [p.rsplit("/", 1)[1] for p in fs.find(f"{root}/{name}")]


def test_a_reader_never_sees_a_partial_version(s3_url, tmp_path):
    """While another process uploads a 24-shard version, every look at the store either does not list it or finds
    it whole and matching its manifest."""
    url = f"{s3_url}/adapters"
    reader = AdapterStore(url)
    proc = _publisher(url, "trl-policy-v1", tmp_path, files=24, size=256 * 1024)
    partial_seen = listed_seen = 0
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None or listed_seen == 0:
            assert time.monotonic() < deadline, "the publisher took over a minute"
            files = _remote_files(url, "trl-policy-v1")
            listed = "trl-policy-v1" in reader.published_names()
            if listed:
                listed_seen += 1
                assert reader.verify("trl-policy-v1")
                fetch_adapter(reader.replica_path("trl-policy-v1"), tmp_path / f"copy-{listed_seen}")
            elif files:  # uploading: a fetch finds no manifest, or (it landed meanwhile) the whole version
                partial_seen += 1
                attempt = tmp_path / f"attempt-{partial_seen}"
                try:
                    fetch_adapter(reader.replica_path("trl-policy-v1"), attempt)
                except FileNotFoundError as error:
                    assert "No adapter found" in str(error) and not attempt.exists()
                else:
                    assert len(list(attempt.iterdir())) == 26 and reader.verify("trl-policy-v1")
            if listed_seen > 2:
                break
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0 and listed_seen and partial_seen, (listed_seen, partial_seen)


def test_kill_9_mid_publish_is_never_served_and_the_name_stays_used(s3_url, tmp_path):
    url = f"{s3_url}/adapters"
    proc = _publisher(url, "trl-policy-v4", tmp_path, files=24, size=256 * 1024)
    try:
        deadline = time.monotonic() + 60
        while True:  # freeze it once some shards are up and the manifest is not, then kill it there
            files = _remote_files(url, "trl-policy-v4")
            if sum(f.startswith("shard-") for f in files) >= 2 and MANIFEST not in files:
                os.kill(proc.pid, signal.SIGSTOP)
                time.sleep(0.3)  # a request already sent still lands
                if MANIFEST not in _remote_files(url, "trl-policy-v4"):
                    break
                os.kill(proc.pid, signal.SIGCONT)
                pytest.fail("the publisher finished before it could be stopped mid-way (raise files/size)")
            assert proc.poll() is None and time.monotonic() < deadline, "publisher ended early"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    left = _remote_files(url, "trl-policy-v4")
    assert left and MANIFEST not in left and len(left) < 25  # files of it are there, but no manifest

    store = AdapterStore(url)
    assert "trl-policy-v4" not in store.published_names()
    assert not store.verify("trl-policy-v4")
    with pytest.raises(FileNotFoundError, match="No adapter found"):
        fetch_adapter(store.replica_path("trl-policy-v4"), tmp_path / "copy")
    with pytest.raises(FileNotFoundError, match="No adapter found"):
        AdapterCache(tmp_path / "cache").materialize("trl-policy-v4", store.replica_path("trl-policy-v4"))
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-copied left on the node
    # the name is spent: never published again; the resumed trainer numbers on from it
    assert store.highest_version("trl-policy") == 4
    with pytest.raises(FileExistsError):
        store.publish(adapter_dir(tmp_path, 4), "trl-policy-v4")
    assert store.clean_staging() == 1 and _remote_files(url, "trl-policy-v4") == []  # the leftovers go
    store.publish(adapter_dir(tmp_path, 5), "trl-policy-v5")
    assert store.published_names() == ["trl-policy-v5"] and store.verify("trl-policy-v5")


@pytest.fixture
def s3_env(monkeypatch):
    """Change AWS_* variables for one test; s3fs clients made before are dropped on both sides of it."""
    forget_s3_clients()
    yield monkeypatch
    monkeypatch.undo()
    forget_s3_clients()


def test_missing_bucket_and_refused_credentials_are_clear(s3_url, s3_env, tmp_path):
    from grpo_lab.async_loop.checks import UsageError, check_storage

    missing = f"s3://grpo-lab-no-such-bucket-{os.getpid()}/run"
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        storage_reachable(missing)
    with pytest.raises(UsageError) as refused:
        check_storage("--adapter-storage", missing)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--adapter-storage: ") and "bucket does not exist" in message
    with pytest.raises(FileNotFoundError):  # publishing never creates a bucket that is not there
        AdapterStore(missing).publish(adapter_dir(tmp_path, 1), "trl-policy-v1")
    with pytest.raises(FileNotFoundError):
        storage_reachable(missing)

    storage_reachable(s3_url)  # the right credentials: fine
    for variable, value, says in [("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0", "Access Key Id you provided"),
                                  ("AWS_SECRET_ACCESS_KEY", "wrong-secret", "signature")]:
        s3_env.setenv(variable, value)
        forget_s3_clients()
        with pytest.raises(PermissionError, match=says):
            storage_reachable(s3_url)
        with pytest.raises(UsageError) as refused:
            check_storage("--adapter-storage", s3_url)
        assert "\n" not in str(refused.value) and says in str(refused.value)
        s3_env.undo()
        forget_s3_clients()


def test_describe_storage_error_names_the_cause(s3_url, s3_env):
    from grpo_lab.async_loop.checks import describe_storage_error

    try:
        storage_reachable(f"s3://grpo-lab-no-such-bucket-{os.getpid()}/run")
    except FileNotFoundError as error:
        assert "no such bucket" in describe_storage_error(error)
    s3_env.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    forget_s3_clients()
    try:
        storage_reachable(s3_url)
    except PermissionError as error:
        assert "refused the credentials" in describe_storage_error(error)


def test_adapter_cache_reuses_a_verified_copy_and_cleans_up(s3_url, tmp_path):
    store = AdapterStore(f"{s3_url}/adapters")
    store.publish(adapter_dir(tmp_path, 1, files=2), "trl-policy-v1")
    cache = AdapterCache(tmp_path / "cache")
    first = cache.materialize("trl-policy-v1", store.replica_path("trl-policy-v1"))
    stamp = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    again = AdapterCache(tmp_path / "cache").materialize("trl-policy-v1", store.replica_path("trl-policy-v1"))
    assert again == first and {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == stamp  # not downloaded
    (first / "shard-00.safetensors").write_bytes(b"damaged on the node")  # a damaged local copy is replaced
    fixed = cache.materialize("trl-policy-v1", store.replica_path("trl-policy-v1"))
    assert fixed == first and AdapterStore(f"file://{tmp_path}/cache").fs.exists(str(fixed / MANIFEST))
    assert (fixed / "shard-00.safetensors").read_bytes() != b"damaged on the node"
    store.fs.pipe_file(store._join("trl-policy-v1", "shard-01.safetensors"), b"tampered in the bucket")
    with pytest.raises(ValueError, match="does not match its manifest"):
        AdapterCache(tmp_path / "other").materialize("trl-policy-v1", store.replica_path("trl-policy-v1"))
    assert list((tmp_path / "other").iterdir()) == []
    assert cache.release("trl-policy-v1") and not first.exists()
    owned = AdapterCache()  # the default: a temporary folder of this process, gone on close
    assert owned.root.is_dir() and str(os.getpid()) in owned.root.name
    owned.close()
    assert not owned.root.exists()
    dead = Path(owned.root.parent, f"grpo-lab-adapters-{2 ** 22 + 7}-x")  # a pid above pid_max: never running
    dead.mkdir()
    assert str(dead) in sweep_orphans()


def test_cpu_replica_engine_loads_s3_through_its_cache(s3_url, adapters, tmp_path):
    """The CPU replica copies an s3:// version into its cache, loads the verified copy, answers "No adapter found"
    (the router's retry signal) while there is no manifest, and removes the copy on unload."""
    from grpo_lab.serving.replicas.generation import Engine, RequestError, SamplingParams
    from grpo_lab.serving.replicas.config import CPUReplicaConfig

    store = AdapterStore(f"{s3_url}/adapters")
    store.publish(adapters["trl-policy-v1"], "trl-policy-v1")
    engine = Engine(CPUReplicaConfig(model="tiny-qwen3", max_lora_rank=16, max_loras=3,
                                     adapter_cache_dir=str(tmp_path / "cache")))
    with pytest.raises(RequestError, match="No adapter found") as missing:
        engine.load_adapter("trl-policy-v2", store.replica_path("trl-policy-v2"))
    assert missing.value.status == 404
    engine.load_adapter("trl-policy-v1", store.replica_path("trl-policy-v1"))
    assert engine.adapters["trl-policy-v1"] == store.replica_path("trl-policy-v1")  # /v1/models reports the URL
    (copy,) = (tmp_path / "cache").iterdir()
    assert json.loads((copy / MANIFEST).read_text())["digest"] == store.manifest("trl-policy-v1").digest
    out = engine.generate("trl-policy-v1", [1, 2, 3], SamplingParams(max_tokens=2, seed=0))
    assert len(out["token_ids"]) == 2
    engine.unload_adapter("trl-policy-v1")
    assert list((tmp_path / "cache").iterdir()) == []
