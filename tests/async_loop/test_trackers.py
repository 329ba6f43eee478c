"""The run in the user's tracker: `grpo-lab async-loop --report-to trackio --report-to tensorboard --report-to wandb
--autotune` logs through transformers' integrations, offline (trackio's local SQLite store under TRACKIO_DIR,
TensorBoard event files under the output folder, W&B's offline run under WANDB_DIR), with TRL's metric names, the
router's figures and the autotune knobs; `grpo-lab doctor` reads the run back from trackio or TensorBoard."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpo_lab.async_loop.doctor import main as doctor
from grpo_lab.async_loop.trackers import RouterFigures, read_run

pytest.importorskip("trackio")
pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

TRL_NAMES = ("perf/rollout_wait_s", "perf/step_s", "sample/staleness_mean", "batch/samples_per_step")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    out, trackio_dir = root / "run", root / "trackio"
    env = dict(os.environ, TRACKIO_DIR=str(trackio_dir), HF_HUB_OFFLINE="1", TRACKIO_PLOT_ORDER="",
               WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true", WANDB_PROJECT="grpo-lab-test")
    done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "async-loop", "--output-dir", str(out),
                           "--max-steps", "4", "--save-steps", "100", "--autotune", "--report-to", "trackio",
                           "--report-to", "tensorboard", "--report-to", "wandb", "--run-name", "tracked"],
                          capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, trackio_dir


def _check_rows(rows):
    steps = [r for r in rows if "perf/fwd_bwd_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for name in TRL_NAMES:
        assert any(name in r for r in steps), name
    assert all("autotune/inflight" in r for r in steps)
    assert any("router/affinity_share" in r or "router/unmatched_total" in r for r in steps)


def test_a_trackio_run_written_offline_is_read_back_by_the_doctor(tracked_run, capsys):
    out, trackio_dir = tracked_run
    dbs = list(trackio_dir.glob("*.db"))
    assert len(dbs) == 1
    rows, source = read_run(trackio_dir)
    assert "trackio" in source and "tracked" in source
    _check_rows(rows)
    assert doctor([str(trackio_dir), "--replica-kind", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "read from: trackio project" in printed and "4 logged steps" in printed
    assert "evidence:" in printed


def test_a_tensorboard_run_is_read_back_by_the_doctor(tracked_run, capsys):
    out, _ = tracked_run
    rows, source = read_run(out / "runs")
    assert "TensorBoard" in source
    _check_rows(rows)
    assert doctor([str(out / "runs"), "--replica-kind", "cpu"]) == 0
    assert "read from: TensorBoard run" in capsys.readouterr().out
    # the loop's own metrics log still works, and holds the same steps
    local, _ = read_run(out)
    assert [r["step"] for r in local if "perf/fwd_bwd_s" in r] == [1, 2, 3, 4]


def test_a_wandb_run_written_offline_holds_trls_names_and_the_routers(tracked_run):
    """W&B's offline run (what `wandb sync` uploads later) has the run's history: its records name every metric
    logged (wandb 0.31 has no public reader of an offline run, so the names are looked up in the file's bytes)."""
    out, _ = tracked_run
    runs = list((out.parent / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    data = runs[0].read_bytes()
    for name in TRL_NAMES + ("autotune/inflight", "autotune/queue_bound"):
        assert name.encode() in data, name
    assert b"router/affinity_share" in data or b"router/unmatched_total" in data


def test_doctor_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    assert doctor([str(tmp_path)]) == 2
    assert "not a run" in capsys.readouterr().err


def test_router_figures_are_per_step_deltas():
    figures = RouterFigures(None)
    first = figures.figures({"routing": {"affinity": 6, "unmatched": 2}, "in_flight": {"a": 3, "b": 1}})
    assert first["router/affinity_share"] == 0.75 and first["router/in_flight"] == 4.0
    assert first["router/load_imbalance"] == 1.5
    second = figures.figures({"routing": {"affinity": 10, "unmatched": 2}, "in_flight": {}})
    assert second["router/affinity_total"] == 4.0 and second["router/affinity_share"] == 1.0
    assert figures.figures(None) == {}
    json.dumps(second)
