"""The whole loop with real processes: TRL's AsyncGRPOTrainer -> adapters on storage -> router -> 2 CPU replicas.

What a user would check after a run: every published version reached every replica, every completion came from a
version this trainer published and within max_staleness, the importance ratio stayed near 1, and no process was left
behind; after a kill -9 and a resume, no adapter name was reused and nothing stale is served; faults end in a clear
error within bounded time.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from grpo_lab.async_loop.launch import AsyncLoop, LoopConfig, embedded_trainer_args
from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.serving.clusters.local import LocalCluster
from grpo_lab.tasks.embedded_model import embedded_model_dir
from grpo_lab.serving.adapters.storage import MANIFEST, AdapterStore, version_of

from loop_fixtures import (MAX_STALENESS, descendants, replica_adapters, router_metric, start_cluster,
                           wait_gone)

G = 8


def loop_for(url: str, out: Path, **overrides) -> AsyncLoop:
    args = embedded_trainer_args(str(out), max_staleness=MAX_STALENESS, save_strategy="no", **overrides)
    return AsyncLoop(LoopConfig(router_url=url), args, progress=False)


def test_twenty_steps_on_two_replicas(cluster, tmp_path, no_leftover_children):
    url = cluster.url
    loads_ok = router_metric(url, "grpo_router_adapter_loads_total", result="ok")
    routed_before = requests.get(url + "/router/state", timeout=10).json()["routing"]
    loop = loop_for(url, tmp_path / "run", max_steps=20)
    pids = []
    loop.callbacks.append(_At(1, lambda: pids.append(loop.trainer.rollout_worker.pid)))
    t0 = time.perf_counter()
    with loop:
        loop.train()
    wall = time.perf_counter() - t0
    trainer = loop.trainer
    rows = [r for r in read_metrics(tmp_path / "run" / METRICS_FILE) if "train_runtime" not in r]
    assert trainer.state.global_step == 20 and [r["step"] for r in rows] == list(range(1, 21))

    # every published version was loaded on every replica: all-or-nothing loads, none failed, no replica dropped
    versions = [p["version"] for p in trainer.published]
    assert versions == list(range(versions[0], versions[0] + 21))  # the cold sync + one per step, never reused
    assert router_metric(url, "grpo_router_adapter_loads_total", result="ok") - loads_ok == 21
    assert router_metric(url, "grpo_router_adapter_loads_total", result="failed") == 0
    assert router_metric(url, "grpo_router_replica_failures_total") == 0
    live = {f"trl-policy-v{v}" for v in trainer._live_versions}
    assert len(live) == MAX_STALENESS + 1
    for replica in cluster.replicas:  # holding exactly the versions samples may still use; older ones unloaded
        assert set(replica_adapters(replica.url)) == live

    # every completion trained on came from a version this trainer published, within max_staleness
    for r in rows:
        assert r["sample/staleness_max"] <= MAX_STALENESS
        if "rollout/version_min" in r:
            assert versions[0] <= r["rollout/version_min"] <= r["rollout/version_max"] <= versions[-1]
        assert 0.9 <= r["ratio"] <= 1.1, r["ratio"]  # replicas and trainer score the same policy
        assert math.isfinite(r["reward"]) and math.isfinite(r["loss"])

    # group-consistent versions: a group's G rollouts name one adapter, so only its first misses the prefix
    routed = requests.get(url + "/router/state", timeout=10).json()["routing"]
    delta = {k: routed.get(k, 0) - routed_before.get(k, 0) for k in routed}
    assert delta["unmatched"] / sum(delta.values()) <= 1 / G + 0.05, delta
    assert pids and wait_gone(pids, 10) == []
    print(f"20 steps in {wall:.1f}s ({20 / wall:.2f} steps/s), routing {delta}")


class _At(TrainerCallback):
    """Run `action` once, at the end of optimizer step `step`."""

    def __init__(self, step: int, action):
        self.step, self.action, self.done_at = step, action, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.done_at is None:
            self.action()
            self.done_at = time.monotonic()


def test_dead_rollout_worker_is_a_clear_error_in_bounded_time(cluster, tmp_path, no_leftover_children):
    loop = loop_for(cluster.url, tmp_path / "run", max_steps=200)
    kill = _At(2, lambda: os.kill(loop.trainer.rollout_worker.pid, signal.SIGKILL))
    loop.callbacks.append(kill)
    with loop, pytest.raises(RuntimeError, match=r"rollout worker process \(pid \d+\) exited"):
        loop.train()
    assert time.monotonic() - kill.done_at < 90  # it trains on what was queued, then stops: never hangs


@pytest.mark.parametrize("fault", ["replicas", "router"])
def test_lost_rollout_server_is_a_clear_error_in_bounded_time(tmp_path, fault, no_leftover_children):
    c = start_cluster()
    try:
        loop = loop_for(c.url, tmp_path / "run", max_steps=200, rollout_failure_timeout_s=10, control_timeout_s=10)
        if fault == "replicas":
            action, message = lambda: [r.kill() for r in c.replicas], r"answered 503|kept failing"
        else:
            action, message = c.router.stop, r"cannot connect|kept failing"
        fault_at = _At(2, action)
        loop.callbacks.append(fault_at)
        with loop, pytest.raises(Exception, match=message):
            loop.train()
        assert time.monotonic() - fault_at.done_at < 60
    finally:
        c.stop()


def _logged_steps(out: Path) -> int:
    path = out / METRICS_FILE
    return len([r for r in read_metrics(path) if "train_runtime" not in r]) if path.exists() else 0


def _wait(predicate, proc, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _freeze_when(predicate, proc, timeout: float, what: str):
    """Wait for `predicate`, then SIGSTOP the process group and check it again: the trainer cannot save a checkpoint
    or publish between the check and what the test does next (a kill), so the state the test saw is the state the
    kill leaves. The group stays stopped; the caller kills it or sends SIGCONT."""
    deadline = time.monotonic() + timeout
    while True:
        _wait(predicate, proc, max(deadline - time.monotonic(), 0.0), what)
        os.killpg(proc.pid, signal.SIGSTOP)
        if predicate():
            return
        os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.5)


def _published_past_checkpoint(out: Path) -> bool:
    """Whether the run has published an adapter newer than its last checkpoint's policy version (what a kill must
    leave behind for the resume to prove it skips it); False while either is still being written."""
    try:
        checkpoint = get_last_checkpoint(str(out))
        if checkpoint is None:
            return False
        saved = json.loads(Path(checkpoint, "rollout_state.json").read_text())["model_version"]
        return max(version_of(n, "trl-policy") for n in AdapterStore(out / ".vllm_lora").history()) > saved
    except (OSError, ValueError, KeyError):
        return False


def _continue_group(pgid: int):
    """SIGCONT what is left of a frozen process group (rollout worker, multiprocessing's resource tracker), so that
    it meets the trainer's death as running processes would; a stopped process never would, and never exits."""
    try:
        os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:  # nothing left
        pass


def _group_members(pgid: int) -> list[int]:
    """Processes now in process group `pgid` (what a kill of its leader leaves, e.g. a resource tracker)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _default_sigint():
    """A terminal's foreground command gets Ctrl-C; a child of a background shell inherits SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_kill_9_then_resume_reuses_no_name_and_serves_nothing_stale(cluster, tmp_path, no_leftover_children):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo_lab.async_loop.command", "--router-url", cluster.url, "--output-dir", str(out),
           "--save-steps", "3"]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(cmd + ["--max-steps", "100"], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        _freeze_when(lambda: (out / "checkpoint-3").is_dir() and _logged_steps(out) >= 5
                     and _published_past_checkpoint(out),
                     first, 400, "checkpoint-3, 5 logged steps and an adapter newer than the last checkpoint")
        children = descendants(first.pid)
        assert children, "the trainer should have a rollout worker child"
        os.kill(first.pid, signal.SIGKILL)  # the trainer alone, as an OOM killer would; its children must follow
        first.wait(timeout=10)
        _continue_group(first.pid)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    group = _group_members(first.pid)
    assert wait_gone(children, 20) == [], "the rollout worker outlived its SIGKILLed trainer"
    assert wait_gone(group, 20) == [], "processes of the killed trainer's group (e.g. a stopped one) outlived it"

    killed = AdapterStore(out / ".vllm_lora").history()
    killed_max = max(version_of(n, "trl-policy") for n in killed)
    checkpoint = get_last_checkpoint(str(out))
    ckpt_step = int(checkpoint.rsplit("-", 1)[1])
    ckpt_version = json.loads(Path(checkpoint, "rollout_state.json").read_text())["model_version"]
    assert killed_max > ckpt_version  # the killed run published weights the checkpoint does not have
    assert max(r["step"] for r in read_metrics(out / METRICS_FILE)) > ckpt_step  # steps the resume will redo
    # and what a kill while saving leaves: TRL's rollout_state.json and the adapter, not transformers' trainer state
    cut = out / f"checkpoint-{ckpt_step + 1}"
    cut.mkdir()
    (cut / "rollout_state.json").write_text(json.dumps({"prompt_index": 0, "model_version": killed_max}))
    (cut / "adapter_model.safetensors").write_bytes(b"")

    target = ckpt_step + 4
    resumed = subprocess.run(cmd + ["--max-steps", str(target), "--resume"], capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"skipping incomplete checkpoints: {cut.name}: trainer_state.json missing" in resumed.stderr
    assert f"resuming from {checkpoint}" in resumed.stderr

    history = AdapterStore(out / ".vllm_lora").history()
    new = {n: p for n, p in history.items() if n not in killed}
    assert new and min(version_of(n, "trl-policy") for n in new) == killed_max + 1  # numbering went on
    assert len({p.run_id for p in new.values()}) == 1 and not {p.run_id for p in new.values()} & {
        p.run_id for p in killed.values()}
    for replica in cluster.replicas:  # only the resumed run's adapters are served, with exactly its content
        held = replica_adapters(replica.url)
        assert held and set(held) <= set(new), held
        for name, path in held.items():
            assert json.loads(Path(path, MANIFEST).read_text())["digest"] == new[name].digest

    all_rows = read_metrics(out / METRICS_FILE)
    steps = [r["step"] for r in all_rows if "train_runtime" not in r]
    assert steps == list(range(1, target + 1))  # every step logged once: the killed run's later steps were dropped
    assert [r["step"] for r in all_rows if "train_runtime" in r] == [target]  # one summary, the resumed run's
    assert f"({target - ckpt_step} steps in this run, resumed from checkpoint-{ckpt_step})" in resumed.stdout
    rows = [r for r in all_rows if r["step"] > ckpt_step]  # the resumed run's
    first_new = killed_max + 1
    used = [r for r in rows if "rollout/version_min" in r]
    assert used and all(r["rollout/version_min"] >= first_new for r in used)  # nothing generated by stale weights
    assert all(r["sample/staleness_max"] <= MAX_STALENESS for r in rows if "sample/staleness_max" in r)


def test_ctrl_c_on_the_command_stops_every_process_it_started(tmp_path, no_leftover_children):
    """`grpo-lab async-loop` started its own replicas, router and rollout worker: Ctrl-C (SIGINT) mid-run ends the
    command with status 130 and takes all of them down."""
    out = tmp_path / "run"
    log = open(tmp_path / "cli.log", "w")
    cli = subprocess.Popen([sys.executable, "-m", "grpo_lab.cli", "async-loop", "--output-dir", str(out),
                            "--max-steps", "200", "--save-steps", "1000"], stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True, preexec_fn=_default_sigint)
    try:
        _wait(lambda: _logged_steps(out) >= 2, cli, 400, "2 logged steps")
        children = descendants(cli.pid)
        assert len(children) >= 3  # two replicas and the rollout worker (and their helpers)
        cli.send_signal(signal.SIGINT)
        assert cli.wait(timeout=90) == 130
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert wait_gone(children, 20) == [], "processes outlived the interrupted command"
    assert "stopped" in (tmp_path / "cli.log").read_text()
    for i in range(2):  # each replica's output is kept where a failing run's error message points
        assert "READY" in (out / "logs" / f"replica-{i}.log").read_text()


def test_the_command_routes_to_replicas_started_elsewhere_and_ends_with_a_verdict(tmp_path, no_leftover_children):
    """`--replica-url` (repeated): the command starts only a router in front of replicas it did not start, trains,
    prints both step counts and the doctor's verdict, records its settings, and leaves the replicas running."""
    from grpo_lab.serving.replicas.processes import start_cpu_replicas

    elsewhere = LocalCluster(replicas=2, model=str(embedded_model_dir()), max_staleness=MAX_STALENESS,
                             max_lora_rank=1, replica_args=["--max-model-len", "128", "--torch-threads", "1"])
    replicas = start_cpu_replicas(2, elsewhere.args)  # replicas alone, no router of this process in front
    try:
        _command_on(replicas, tmp_path / "run")
        assert all(r.alive() for r in replicas)  # replicas it did not start are not its to stop
    finally:
        for r in replicas:
            r.stop()


def _command_on(replicas, out):
    urls = [r.url for r in replicas]
    done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "async-loop", "--output-dir", str(out),
                           "--max-steps", "3", "--save-steps", "100", "--replica-kind", "cpu",
                           *[a for url in urls for a in ("--replica-url", url)]],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "async loop done: step 3/3 (3 steps in this run)" in done.stdout
    assert "\ndoctor: " in done.stdout and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("step ")]
    assert len(lines) == 3  # not a terminal: a plain line per step, no progress bar
    record = json.loads((out / "run.json").read_text())
    assert record["replica_urls"] == urls and record["replica_kind"] == "cpu" and record["block_size"] == 16
    assert record["max_inflight_tasks"] == 64 and record["prompt_tokens_median"] > 2
    assert record["command"][:2] == ["grpo-lab", "async-loop"]
