"""A sweep of three runs on the embedded default, sharing a pool of 2 CPU replicas the sweep starts: two from the
grid, one added while they train and stopped mid-way by the test.

What a lab running a sweep needs to be true: the runs it did not stop finish every step; the stopped one is
reported stopped and its adapters leave every replica at once (not after its lease); every adapter a replica holds
is in the namespace of the run whose own store it was loaded from, so each run's completions came from its own
versions; the sweep's records say all this; no process is left.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import psutil
import requests
from loop_fixtures import descendants, wait_gone

from grpo_lab.async_loop.recorder import METRICS_FILE, read_metrics
from grpo_lab.serving.adapters.storage import AdapterStore, version_of
from grpo_lab.serving.tenancy.runs import SEPARATOR
from grpo_lab.serving.wire.metrics import parse_text
from grpo_lab.sweep import Sweep, SweepConfig

STEPS = 3
BASE = {"max_steps": STEPS, "prompts_per_step": 1, "max_staleness": 1, "save_steps": 1000}
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def held(replica_url: str) -> dict[str, str]:
    """The adapters a replica holds now, by their upstream name: their path."""
    data = requests.get(replica_url + "/v1/models", timeout=10).json()["data"]
    return {entry["id"]: entry["root"] for entry in data if entry.get("parent")}


def test_a_sweep_of_three_runs_one_stopped_shares_one_pool(tmp_path, no_leftover_children):
    config = SweepConfig(base=BASE, grid={"learning_rate": [1e-3, 3e-3]}, replicas=2, out_dir=str(tmp_path / "sweep"),
                         parallel=3, run_lease=60.0, stop_timeout_s=60.0)
    seen: dict[str, str] = {}  # every adapter seen on a replica: its path
    pids: set[int] = set()
    with Sweep(config, env=THREADS) as sweep:
        replicas = [r.url for r in sweep.pool.cluster.replicas]
        admin = {"Authorization": f"Bearer {Path(sweep.admin_key_file).read_text().strip()}"}
        victim = sweep.add({"max_steps": 100}, name="victim")
        assert [r["name"] for r in sweep.status()] == ["lr1e-3", "lr3e-3", "victim"]

        def sample():
            for url in replicas:
                seen.update(held(url))
            for run in sweep.runs.values():
                if run.pid is not None:
                    pids.update([run.pid, *descendants(run.pid)])

        deadline = time.monotonic() + 300
        while not (sweep.rows(victim) and any(n.startswith(victim + SEPARATOR) for n in seen)):
            assert sweep.runs[victim].status in ("queued", "running"), sweep.status()
            assert time.monotonic() < deadline, sweep.status()
            sample()
            time.sleep(0.5)
        assert sweep.stop(victim) == "stopped"
        # gone from the pool and from every replica now, not after its 60 s lease
        assert victim not in {r["name"] for r in requests.get(sweep.url + "/router/runs", headers=admin,
                                                             timeout=10).json()["runs"]}
        left = time.monotonic() + 20
        while any(n.startswith(victim + SEPARATOR) for url in replicas for n in held(url)):
            assert time.monotonic() < left, "the stopped run's adapters are still on a replica"
            time.sleep(0.2)

        while not sweep.wait(timeout_s=1.0):  # the other two go on
            assert time.monotonic() < deadline, sweep.status()
            sample()
        status = {r["name"]: r for r in sweep.status()}
        state = requests.get(sweep.url + "/router/state", headers=admin, timeout=10).json()
        metrics = parse_text(requests.get(sweep.url + "/metrics", headers=admin, timeout=10).text)
        replica_metrics = [parse_text(requests.get(url + "/metrics", timeout=10).text) for url in replicas]
        shares = sweep.shares()
        table = sweep.summary()

    assert {n: s["status"] for n, s in status.items()} == {"lr1e-3": "finished", "lr3e-3": "finished",
                                                           "victim": "stopped"}
    runs = {name: Path(status[name]["output_dir"]) for name in status}
    # every adapter any replica held: in a sweep run's namespace, loaded from that run's own store
    assert seen
    for upstream, root in seen.items():
        owner = upstream.split(SEPARATOR, 1)[0]
        assert owner in runs, upstream
        assert Path(root).resolve().is_relative_to(runs[owner].resolve()), (upstream, root)
    assert any(u["run"] == victim for u in state["unloads"])
    for u in state["unloads"]:  # each run's adapters unloaded by that run (the stopped one leaving on SIGTERM), or
        assert u["adapter"].startswith(u["run"] + SEPARATOR), u  # by the sweep removing it; never by its lease
        assert u["by"] in (("run", "admin") if u["run"] == victim else ("run",)), u
    for m in replica_metrics:  # no completion reached a replica naming a model it did not hold
        assert m.get("grpo_replica_unknown_model_total", 0) == 0
    # every completion a replica generated was under one run's own adapters, and as many as the router answered
    # that run (a hedged or re-sent completion may be generated twice for one answer)
    generated: dict[str, float] = {}
    for m in replica_metrics:
        for key, value in m.items():
            if key.startswith("grpo_replica_completions_total{"):
                family = key.split('model_family="', 1)[1].split('"', 1)[0]
                owner = family.split(SEPARATOR, 1)[0]
                assert SEPARATOR in family and owner in runs, family  # never the base model, never a stranger
                generated[owner] = generated.get(owner, 0) + value
    extra = sum(v for k, v in metrics.items() if k.split("{")[0] in ("grpo_router_hedges_total",
                                                                       "grpo_router_reroutes_total"))
    for name in runs:  # (the stopped run's last completions may finish on a replica after it hung up)
        answered = metrics.get(f'grpo_router_run_completions_total{{run="{name}",status="200"}}', 0)
        most = math.inf if name == victim else answered + extra
        assert answered <= generated.get(name, 0) <= most, (name, answered, generated, extra)
    for name in ("lr1e-3", "lr3e-3"):
        rows = [r for r in read_metrics(runs[name] / METRICS_FILE) if "train_runtime" not in r]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        published = [version_of(n, "trl-policy") for n in AdapterStore(runs[name] / ".vllm_lora").history()]
        for r in rows:  # every completion it trained on came from a version of its own
            assert r["sample/staleness_max"] <= BASE["max_staleness"]
            if "rollout/version_min" in r:
                assert min(published) <= r["rollout/version_min"] <= r["rollout/version_max"] <= max(published)
            assert sum(r["router"]["routing"].values()) > 0  # its own figures, through its token
        trained = sum(r["batch/samples_per_step"] for r in rows)
        served = metrics.get(f'grpo_router_run_completions_total{{run="{name}",status="200"}}', 0)
        assert served >= trained, (name, served, trained)  # the router counted them as this run's
        assert "async loop done: step 3/3" in (tmp_path / "sweep" / "logs" / f"{name}.log").read_text()
    # what the sweep shows and records
    assert set(shares) == set(runs) and all(s["granted"] > 0 for s in shares.values())
    assert math.isclose(sum(s["share"] for s in shares.values()), 1.0)
    assert set(table["run"]) == set(runs)
    ranked = table[table["status"] == "finished"]["final_reward"].tolist()
    assert ranked == sorted(ranked, reverse=True) and all(0.0 <= r <= 1.0 for r in ranked)
    record = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert record["config"]["grid"] == {"learning_rate": [0.001, 0.003]} and record["config"]["parallel"] == 3
    assert {r["name"]: r["status"] for r in record["runs"]} == {n: s["status"] for n, s in status.items()}
    assert (tmp_path / "sweep" / "summary.csv").read_text().startswith("run,status,")
    again = Sweep.load(tmp_path / "sweep")  # reopened (as a notebook opens a headless sweep): the same picture
    assert again.summary()[["run", "status", "final_reward"]].equals(table[["run", "status", "final_reward"]])
    assert set(again.shares()) == set(runs) and len(again.curves()) == len(sweep.curves())
    assert wait_gone(sorted(pids), 10) == [], [psutil.Process(p).cmdline() for p in pids if psutil.pid_exists(p)]
