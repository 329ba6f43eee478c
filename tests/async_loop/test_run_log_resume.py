"""Issue 43 #9: a resume on a new machine from `--checkpoint-storage` brings the run's metrics history (and its
`run.json`) back with the checkpoint, cut to the checkpoint's step, so the doctor judges the whole run instead of
saying "not enough steps logged yet". On a local folder store and on S3 (moto)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_lab.async_loop.checkpoint_store import CheckpointStore, PublishCheckpoints, pull_last_checkpoint
from grpo_lab.async_loop.checkpoints import ROLLOUT_STATE, TRAINER_STATE
from grpo_lab.async_loop.doctor import diagnose_run
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.async_loop.run_dir import RUN_LOG_DIR, RUN_RECORD, read_run_record

from loop_fixtures import cluster, no_leftover_children  # noqa: F401 - pytest fixtures


def _row(step: int) -> dict:
    return {"step": step, "perf/step_s": 2.0, "perf/fwd_bwd_s": 1.5, "perf/rollout_wait_s": 0.1,
            "batch/samples_per_step": 16, "sample/rollout_queue_size": 2}


def _run_with_checkpoints(run: Path, steps: int) -> None:
    """A run folder as the loop leaves it after `steps` steps: metrics rows, run.json, checkpoint-<each step>."""
    run.mkdir(parents=True)
    (run / METRICS_FILE).write_text("".join(json.dumps(_row(s)) + "\n" for s in range(1, steps + 1)))
    (run / RUN_RECORD).write_text(json.dumps({"replica_kind": "cpu", "max_staleness": 2}))
    for step in range(1, steps + 1):
        folder = run / f"checkpoint-{step}"
        folder.mkdir()
        (folder / ROLLOUT_STATE).write_text(json.dumps({"prompt_index": step, "model_version": step}))
        (folder / TRAINER_STATE).write_text(json.dumps({"global_step": step}))


def _publish(store: CheckpointStore, run: Path, step: int) -> None:
    args = SimpleNamespace(output_dir=str(run), save_total_limit=None)
    PublishCheckpoints(store, retry_s=0).on_save(args, SimpleNamespace(is_world_process_zero=True,
                                                                       global_step=step), None)


@pytest.fixture(params=["folder", "s3"])
def store_url(request, tmp_path):
    if request.param == "folder":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_url") + "/checkpoints"


def test_a_pull_on_a_fresh_machine_brings_the_history_back_cut_to_the_checkpoint(store_url, tmp_path):
    machine_a = tmp_path / "machine-a"
    _run_with_checkpoints(machine_a, 4)
    store = CheckpointStore(store_url)
    _publish(store, machine_a, 3)  # published while steps 1-3 were logged ... but the log already has step 4 here
    _publish(store, machine_a, 4)
    with store.fs.open(store._join("checkpoint-3", RUN_LOG_DIR, METRICS_FILE), "r") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]  # each copy is cut to its own step

    fresh = tmp_path / "machine-b"
    pulled = pull_last_checkpoint(store_url, fresh)
    assert pulled.checkpoint == str(fresh / "checkpoint-4")
    assert sorted(pulled.restored) == sorted([METRICS_FILE, RUN_RECORD])
    assert [r["step"] for r in read_metrics(fresh / METRICS_FILE)] == [1, 2, 3, 4]
    assert read_run_record(fresh) == {"replica_kind": "cpu", "max_staleness": 2}
    verdict = diagnose_run(read_metrics(fresh / METRICS_FILE), read_run_record(fresh))
    assert verdict.bound != "unknown", verdict.headline  # was "not enough steps logged yet"


def test_a_machine_with_its_own_longer_history_keeps_it(tmp_path):
    """Only a missing or shorter log is replaced: a folder that logged further keeps its rows."""
    run = tmp_path / "run"
    _run_with_checkpoints(run, 2)
    store = CheckpointStore(tmp_path / "store")
    _publish(store, run, 2)
    other = tmp_path / "other"
    other.mkdir()
    (other / METRICS_FILE).write_text("".join(json.dumps(_row(s)) + "\n" for s in range(1, 6)))
    (other / RUN_RECORD).write_text(json.dumps({"replica_kind": "vllm"}))
    pulled = pull_last_checkpoint(store.url, other)
    assert pulled.downloaded and pulled.restored == []
    assert len(read_metrics(other / METRICS_FILE)) == 5 and read_run_record(other) == {"replica_kind": "vllm"}


def test_the_command_resumed_on_a_fresh_folder_has_the_whole_history(cluster, tmp_path, capsys):  # noqa: F811
    """The issue's case end to end: 3 steps published to a local store, then `--resume` with a new output dir: the
    metrics log holds steps 1-4 and the final verdict is not "not enough steps logged yet" (the first step of each
    process has no step time, so the resumed process alone has none to judge)."""
    from grpo_lab.async_loop import command

    store = tmp_path / "ck"
    store.mkdir()
    run = ["--router-url", cluster.url, "--save-steps", "3", "--checkpoint-storage", str(store)]
    assert command.main([*run, "--max-steps", "3", "--output-dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    fresh = tmp_path / "b"
    assert command.main([*run, "--max-steps", "4", "--output-dir", str(fresh), "--resume"]) == 0
    out = capsys.readouterr().out
    steps = [r["step"] for r in read_metrics(fresh / METRICS_FILE) if "train_runtime" not in r]
    assert steps == [1, 2, 3, 4]
    record = read_run_record(fresh)
    assert record["resumed_from"].endswith("checkpoint-3") and "started_at" in record  # machine A's record, added to
    assert "not enough steps logged yet" not in out, out


def test_the_doctor_names_the_replicas_logs(tmp_path, capsys):
    """Issue 43 #11: the doctor points at `<run>/logs`, where local replicas write and Ray replicas' output is
    copied back (`ray-replica-<i>.log`)."""
    from grpo_lab.async_loop.doctor import main
    from grpo_lab.async_loop.run_dir import REPLICA_LOGS

    run = tmp_path / "run"
    _run_with_checkpoints(run, 3)
    assert main([str(run)]) == 0
    assert "replica logs:" not in capsys.readouterr().out  # none written: nothing named
    (run / REPLICA_LOGS).mkdir()
    for name in ("ray-replica-1.log", "ray-replica-0.log"):
        (run / REPLICA_LOGS / name).write_text("READY 8001\n")
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert f"replica logs: {run / REPLICA_LOGS} (ray-replica-0.log, ray-replica-1.log)" in out, out
