"""Checkpoints published to S3 (moto, its own process) as they are saved, and a resume on a fresh machine from the
last complete one: incomplete ones skipped, no adapter name reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_lab.async_loop.checkpoint_store import CHECKPOINT_MANIFEST, CheckpointStore, pull_last_checkpoint
from grpo_lab.async_loop.checkpoints import ROLLOUT_STATE, TRAINER_STATE, last_complete_checkpoint
from grpo_lab.serving.adapters.storage import AdapterStore, tree_files, version_of

from loop_fixtures import MAX_STALENESS, no_leftover_children, replica_adapters, start_cluster  # noqa: F401


def _checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    """What TRL + transformers leave: rollout_state.json, the adapter, a nested folder, trainer_state.json last."""
    folder = root / f"checkpoint-{step}"
    (folder / "rng").mkdir(parents=True)
    (folder / ROLLOUT_STATE).write_text(json.dumps({"prompt_index": step * 2, "model_version": step}))
    (folder / "adapter_model.safetensors").write_bytes(bytes([step]) * 1024)
    (folder / "rng" / "rng_state.pth").write_bytes(b"rng")
    if complete:
        (folder / TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    return folder


def test_publish_pull_skip_replace_prune(s3_url, tmp_path):
    store = CheckpointStore(f"{s3_url}/checkpoints")
    assert store.folders() == [] and pull_last_checkpoint(store.url, tmp_path / "empty").checkpoint is None
    local = tmp_path / "run"
    for step in (2, 4):
        store.publish(_checkpoint(local, step))
    with pytest.raises(ValueError, match="trainer_state.json missing"):  # never publishes a checkpoint cut short
        store.publish(_checkpoint(local, 5, complete=False))
    # what a publisher killed between files leaves: files, no manifest
    store.fs.pipe_file(store._join("checkpoint-6", ROLLOUT_STATE), b"{}")
    assert store.folders() == ["checkpoint-6", "checkpoint-4", "checkpoint-2"]
    assert store.published() == ["checkpoint-4", "checkpoint-2"]

    warned = []
    fresh = tmp_path / "fresh"
    pulled = pull_last_checkpoint(store.url, fresh, warned.append)
    assert pulled.checkpoint == str(fresh / "checkpoint-4") and pulled.downloaded
    assert warned == ["skipping incomplete published checkpoints: checkpoint-6: no manifest (publishing cut short?)"]
    assert last_complete_checkpoint(fresh).checkpoint == str(fresh / "checkpoint-4")
    assert tree_files(fresh / "checkpoint-4") == {**tree_files(local / "checkpoint-4"),
                                                  CHECKPOINT_MANIFEST: tree_files(fresh / "checkpoint-4")[
                                                      CHECKPOINT_MANIFEST]}
    again = pull_last_checkpoint(store.url, fresh)  # already there: nothing to download
    assert again.checkpoint == str(fresh / "checkpoint-4") and not again.downloaded

    # a damaged file in the bucket: skipped with the reason, the one before it is used
    store.fs.pipe_file(store._join("checkpoint-4", "adapter_model.safetensors"), b"damaged")
    other = pull_last_checkpoint(store.url, tmp_path / "other")
    assert other.checkpoint == str(tmp_path / "other" / "checkpoint-2")
    assert other.skipped[1][0] == "checkpoint-4" and "does not match its manifest" in other.skipped[1][1]
    assert not (tmp_path / "other" / "checkpoint-4").exists()

    # a step saved again after a resume replaces the old copy whole
    (local / "checkpoint-4" / "adapter_model.safetensors").write_bytes(b"retrained")
    store.publish(local / "checkpoint-4")
    assert store.fs.cat_file(store._join("checkpoint-4", "adapter_model.safetensors")) == b"retrained"
    store.publish(_checkpoint(local, 8))
    assert store.prune(keep=2) == ["checkpoint-6", "checkpoint-2"]  # older than the 2 newest complete ones
    assert store.folders() == ["checkpoint-8", "checkpoint-4"]


@pytest.fixture(scope="module")
def s3_cluster(s3_server):
    """One CPU replica and the router, started after the S3 settings are in the environment (replicas read
    s3:// adapters themselves)."""
    import tempfile

    import psutil

    c = start_cluster(replicas=1)
    yield c
    pids = {child.pid for r in c.replicas for child in psutil.Process(r.pid).children()}  # under the watchdogs
    c.stop()
    left = [p.name for p in Path(tempfile.gettempdir()).glob("grpo-lab-adapters-*") if int(p.name.split("-")[3]) in pids]
    assert not left, f"a stopped replica left its adapter copies: {left}"


def test_checkpoints_on_s3_resume_on_a_fresh_machine(s3_cluster, s3_url, tmp_path, no_leftover_children):
    from grpo_lab.async_loop.checkpoint_store import PublishCheckpoints
    from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
    from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics

    adapters, checkpoints = f"{s3_url}/adapters", f"{s3_url}/checkpoints"

    def loop_for(out: Path, steps: int) -> AsyncLoop:
        args = embedded_trainer_args(str(out), max_steps=steps, save_steps=1, max_staleness=MAX_STALENESS,
                                     adapter_storage=adapters, checkpoint_storage=checkpoints)
        return AsyncLoop(LoopConfig(router_url=s3_cluster.url), args, progress=False)

    first = loop_for(tmp_path / "machine-a", 2)
    with first:
        first.train()
    (publisher,) = [c for c in first.trainer.callback_handler.callbacks if isinstance(c, PublishCheckpoints)]
    assert publisher.published == ["checkpoint-1", "checkpoint-2"]
    store = CheckpointStore(checkpoints)
    assert store.published() == ["checkpoint-2", "checkpoint-1"]
    files = json.loads(store.fs.cat_file(store._join("checkpoint-2", CHECKPOINT_MANIFEST)))["files"]
    assert {ROLLOUT_STATE, TRAINER_STATE, "adapter_model.safetensors", "optimizer.pt"} <= set(files)
    killed_max = first.trainer.published[-1]["version"]
    # machine A goes on and is lost while publishing checkpoint-3: its files are up, its manifest is not
    store.fs.pipe_file(store._join("checkpoint-3", ROLLOUT_STATE),
                       json.dumps({"prompt_index": 0, "model_version": killed_max}).encode())

    fresh = tmp_path / "machine-b"  # an empty disk
    warned = []
    pulled = pull_last_checkpoint(checkpoints, fresh, warned.append)
    assert pulled.checkpoint == str(fresh / "checkpoint-2") and "checkpoint-3: no manifest" in warned[0]
    second = loop_for(fresh, 3)
    with second:
        second.train(resume_from_checkpoint=True)
    assert second.trainer.state.global_step == 3
    steps = [r["step"] for r in read_metrics(fresh / METRICS_FILE) if "train_runtime" not in r]
    assert steps == [1, 2, 3]  # went on from the pulled checkpoint, with machine A's history (issue 43 #9)
    history = AdapterStore(adapters).history()
    new = [p for p in history.values() if p.run_id == second.trainer.adapter_store.run_id]
    assert new and min(version_of(p.name, "trl-policy") for p in new) == killed_max + 1  # numbering went on
    assert len({p.run_id for p in history.values()}) == 2
    held = replica_adapters(s3_cluster.replicas[0].url)  # only the resumed run's versions, fetched from the bucket
    assert held and set(held) <= {p.name for p in new} and all(r.startswith("s3://") for r in held.values())
    assert store.published()[0] == "checkpoint-3"  # re-published whole by the resumed run
    saved = json.loads(store.fs.cat_file(store._join("checkpoint-3", TRAINER_STATE)))
    assert saved["global_step"] == 3


def test_a_local_checkpoint_store_takes_nested_files(tmp_path):
    """`--checkpoint-storage <a local folder>` (issue 43): every publish failed with FileNotFoundError on the first
    file in a subfolder (a local file system makes no parent folders), so the store stayed empty."""
    store = CheckpointStore(tmp_path / "store")
    store.publish(_checkpoint(tmp_path / "run", 1))
    assert store.published() == ["checkpoint-1"]
    pulled = pull_last_checkpoint(store.url, tmp_path / "fresh")
    assert pulled.downloaded and (Path(pulled.checkpoint) / "rng" / "rng_state.pth").read_bytes() == b"rng"


def test_a_publish_the_store_keeps_refusing_stops_the_run_naming_the_store(tmp_path):
    from types import SimpleNamespace

    from grpo_lab.async_loop.checkpoint_store import CheckpointPublishError, PublishCheckpoints

    _checkpoint(tmp_path / "run", 1)
    blocked = tmp_path / "store"
    blocked.write_text("a file where the store's folder should be")
    publisher = PublishCheckpoints(CheckpointStore(blocked), retry_s=0)
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), save_total_limit=None)
    state = SimpleNamespace(is_world_process_zero=True, global_step=1)
    with pytest.raises(CheckpointPublishError) as stopped:
        publisher.on_save(args, state, None)
    assert f"could not publish checkpoint-1 to the checkpoint store {blocked} after 3 tries" in str(stopped.value)
    assert publisher.published == []


def test_the_command_keeps_every_checkpoint_or_stops_with_an_error(cluster, tmp_path, capsys, monkeypatch):
    """The issue's run: 2 steps, a save at each, `--checkpoint-storage` a local folder: exit 0 with both checkpoints
    on the store; the same run with a store that refuses every upload ends with exit 1 and one line naming it."""
    from grpo_lab.async_loop import command

    store = tmp_path / "ck"
    store.mkdir()
    run = ["--router-url", cluster.url, "--max-steps", "2", "--save-steps", "1", "--checkpoint-storage", str(store)]
    assert command.main([*run, "--output-dir", str(tmp_path / "kept")]) == 0
    assert CheckpointStore(store).published() == ["checkpoint-2", "checkpoint-1"]
    capsys.readouterr()

    def refuse(self, folder):
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(CheckpointStore, "publish", refuse)
    monkeypatch.setattr("grpo_lab.async_loop.checkpoint_store.PublishCheckpoints.__init__.__defaults__", (3, 0.0))
    assert command.main([*run, "--output-dir", str(tmp_path / "lost")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "CheckpointPublishError" in err[0] and f"checkpoint store {store}" in err[0], err
