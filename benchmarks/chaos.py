"""The chaos run: `grpo-lab async-loop` over a two-host Ray cluster, adapters and checkpoints on an S3 server, while
faults are injected one at a time and then overlapping; one row per scenario in `results/reliability/chaos.csv`.

    sudo .venv/bin/python benchmarks/chaos.py                       # every scenario (~15-20 min on 2 busy cores)
    sudo .venv/bin/python benchmarks/chaos.py --scenarios replica_server_kill9,worker_partition --max-steps 8

**The hosts** are the Ray tier's (`tests/netns.py`, `tests/ray/two_nodes.py`, `tests/s3_fixtures.py`): a head and a
worker node, each a network namespace with its own address on a bridge, and moto (S3, authentication on) as a third
host. The command runs on the head (this process's main thread enters the head's namespace, so the command and the
router it starts live there), `--launcher ray --ray-address <head>:6379`, `--adapter-storage s3://<bucket>/<scenario>/
adapters --checkpoint-storage s3://<bucket>/<scenario>/ck`, the embedded CPU model, 2 CPU replica actors (placed by
Ray; both landed on the worker node in every run measured), a fresh output folder per scenario. Needs root (namespaces) and the `ray`, `s3`
extras.

**Faults** (`FAULTS`): each is injected when the run has logged `--inject-at` steps; a scenario with several injects
them together. What each does is in its function's docstring and in docs/reliability.md.

**Measures**, from what the run records (`measure`): the metrics log `loop_metrics.jsonl`, the router's `/metrics` and
`/router/state` and the replicas' `/metrics` (polled every 0.5 s, counters summed across restarts), the adapter store's
history (the versions published, by which run):

- `steps_done`: distinct steps logged; `run_finished`: the command exited 0 with every step logged;
- `rollouts_lost`: requested completions that never returned nor were retried successfully: requests for a version
  still inside the staleness window answered "adapter gone" and dropped (`rollout/stale_adapter_total`) plus samples
  a step trained short of its batch; a retired version's group ends by design (`abandoned_groups`);
- `misrouted`: completions sent to a replica that did not hold the adapter they named when they came (the replicas'
  `grpo_replica_unknown_model_total`, and the router's re-sends for a lost adapter); beside it `cut_by_unload` (held
  on arrival, unloaded before they finished) and `client_gone` (stopped unrun: the router had cut them);
- `stale_served`: steps that trained on a sample older than `max_staleness` or made by a version the trainer never
  published (after a resume: by a version of the killed run);
- `duplicate_steps`: steps logged more than once in the final metrics log;
- `recovered_s`: from the end of the fault (the kill; the SIGCONT, heal or proxy removal) until the router has every
  replica in service again for good (at every poll up to the run's last step) and the trainer has logged a new step.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ray")]  # the namespace harness of the Ray tier

import netns  # noqa: E402
import s3_fixtures  # noqa: E402
from two_nodes import HEAD, MARKER, WORKER, TwoNodeCluster  # noqa: E402

from grpo_lab.async_loop.recorder import METRICS_FILE  # noqa: E402
from grpo_lab.serving.adapters.storage import AdapterStore, version_of  # noqa: E402
from grpo_lab.serving.wire.metrics import parse_text  # noqa: E402

CSV_PATH = ROOT / "results" / "reliability" / "chaos.csv"
COLUMNS = ("scenario", "injected_at_step", "recovered_s", "steps_done", "rollouts_lost", "misrouted", "stale_served",
           "duplicate_steps", "run_finished", "faults", "fault_s", "max_steps", "hedges", "reroutes", "retries",
           "abandoned_groups", "cut_by_unload", "client_gone", "wall_s", "note")
MAX_STALENESS = 4
PROMPTS_PER_STEP, GENERATIONS = 2, 8
ROUTER_PORT = 18000  # the head's namespace has its ports to itself
POLL_S = 0.5
REPLICA_COUNTERS = {"unknown_model": "grpo_replica_unknown_model_total",  # sent for an adapter not held: misrouted
                    "cut_by_unload": "grpo_replica_unloaded_under_completion_total",  # held on arrival, unloaded after
                    "client_gone": "grpo_replica_abandoned_total"}  # stopped unrun: the router had cut it
RUN_TIMEOUT_S = 600.0
SERVER_NEEDLE = "grpo_lab.serving.replicas.cpu_replica"
ROUTER_NEEDLE = "grpo_lab.serving.router"
HANG_S, PARTITION_S, LATENCY_S, S3_STOP_S = 20.0, 10.0, 30.0, 20.0
DELAY_MS = 200.0

# scenario -> the faults injected together at step `--inject-at` (the trainer kill waits for a checkpoint)
SCENARIOS: dict[str, tuple[str, ...]] = {
    "replica_server_kill9": ("server_kill9",),
    "replica_actor_kill": ("actor_kill",),
    "router_kill9": ("router_kill9",),
    "trainer_kill9_resume": ("trainer_kill9",),
    "replica_hang": ("hang",),
    "worker_partition": ("partition",),
    "worker_latency_200ms": ("latency",),
    "s3_stopped_20s": ("s3_stop",),
    "overlap_server_kill9+s3_stopped": ("server_kill9", "s3_stop"),
    "overlap_partition+hang_other+s3_stopped": ("partition", "hang_other", "s3_stop"),
}
SHORT = ("replica_server_kill9", "worker_partition", "trainer_kill9_resume")
# a duration fault needs a run that outlives it: the latency swap waits out a 30 s drain, then 30 s of delay
MIN_STEPS = {"worker_latency_200ms": 40}


# -- the hosts -----------------------------------------------------------------------------------------------------
@dataclass
class Hosts:
    """Where the run happens: the network, the Ray cluster (address, its processes' marker), the S3 server."""

    network: netns.Network
    address: str
    marker: str
    s3: s3_fixtures.S3Server
    bucket: str
    work: Path

    @property
    def worker_ip(self) -> str:
        return self.network.address(WORKER)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{ROUTER_PORT}"


@contextlib.contextmanager
def hosts(work: Path):
    """The network, moto on its host (credentials in this process's environment), the two Ray nodes; this thread in
    the head's namespace while they live. Everything is stopped by PID at the end."""
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(netns.shared_network())
        s3 = s3_fixtures.start_moto(work, network=network)
        stack.callback(s3_fixtures.stop_moto, s3)
        s3_fixtures.enforce_auth(s3)
        os.environ.update(s3.env())
        cluster = _start_cluster(network)
        stack.callback(cluster.stop)
        home = network.enter(HEAD)
        stack.callback(network.leave, home)
        yield Hosts(network, cluster.address, cluster.marker, s3, s3.new_bucket(), work)


def _start_cluster(network: netns.Network, tries: int = 3) -> TwoNodeCluster:
    """The two Ray nodes; tried again from scratch where a busy machine made a node miss Ray's start-up deadlines
    (`two_nodes` already retries each node once)."""
    for attempt in range(tries):
        cluster = TwoNodeCluster(network)
        try:
            return cluster.start()
        except (RuntimeError, TimeoutError) as error:
            cluster.stop()
            if attempt == tries - 1:
                raise
            print(f"the Ray cluster did not start ({str(error).splitlines()[0]}); trying again", file=sys.stderr)
    raise AssertionError("unreachable")


# -- finding the processes -----------------------------------------------------------------------------------------
def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def listening_ports(pid: int) -> list[int]:
    """TCP ports `pid` listens on, read from its own namespace's tables (psutil reads this process's `/proc/net`,
    which shows the sockets of the namespace this process lives in, not the server's)."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                sockets.add(link[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in sockets:  # 0A: LISTEN
                    ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def replica_servers(h: Hosts) -> list[dict]:
    """The Ray session's CPU replica servers now: pid, the host they live on, their URL."""
    inodes = {os.stat(f"/run/netns/{host.netns}").st_ino: role for role, host in h.network.hosts.items()}
    found = []
    for proc in psutil.process_iter():
        try:
            if SERVER_NEEDLE not in " ".join(proc.cmdline()) or proc.environ().get(MARKER) != h.marker:
                continue
            role = inodes.get(_netns_inode(proc.pid))
            ports = listening_ports(proc.pid)
        except (psutil.Error, OSError):
            continue
        if role and ports and proc.status() != psutil.STATUS_ZOMBIE:
            found.append({"pid": proc.pid, "role": role, "url": f"http://{h.network.address(role)}:{ports[0]}"})
    return sorted(found, key=lambda s: s["role"] != WORKER)  # the worker's first: faults cross the link


def actor_of(server_pid: int) -> int:
    """The Ray worker process hosting the server's `ReplicaServer` actor (server <- guard <- watchdog <- actor)."""
    proc = psutil.Process(server_pid)
    while proc is not None:
        if "ray::" in " ".join(proc.cmdline()):
            return proc.pid
        proc = proc.parent()
    raise LookupError(f"no Ray actor above server {server_pid}")


def router_processes(cli_pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(cli_pid).children(recursive=True)
                if ROUTER_NEEDLE in " ".join(c.cmdline())]
    except psutil.Error:
        return []


# -- watching a run ------------------------------------------------------------------------------------------------
def read_steps(out: Path) -> list[dict]:
    """The metrics log's step rows (the summary row aside); a line still being written is skipped."""
    rows = []
    try:
        lines = (out / METRICS_FILE).read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if "train_runtime" not in row and "step" in row:
                rows.append(row)
    return rows


class Counters:
    """Counters scraped from servers that may restart (and reset them): each source's increases are summed."""

    def __init__(self):
        self.total: Counter = Counter()
        self._last: dict = {}

    def observe(self, source: str, name: str, value: float) -> None:
        last = self._last.get((source, name), 0.0)
        self.total[name] += value - last if value >= last else value
        self._last[(source, name)] = value


@dataclass
class Watch:
    """Polls one run's metrics log, router and replicas from a thread until `stop()`."""

    h: Hosts
    out: Path
    aliases: dict = field(default_factory=dict)  # a proxy's URL -> the replica's own
    counters: Counters = field(default_factory=Counters)
    in_service: list = field(default_factory=list)  # (time, replicas in service)
    step_times: list = field(default_factory=list)  # (time, last logged step)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._poll()

    def last_step(self) -> int:
        return self.step_times[-1][1] if self.step_times else 0

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self) -> None:
        now = time.monotonic()
        rows = read_steps(self.out)
        if not rows and self.step_times:  # the log being rewritten (a resume cuts it back): read it next time
            return
        step = rows[-1]["step"] if rows else 0
        if not self.step_times or step != self.step_times[-1][1]:
            self.step_times.append((now, step))
        try:
            state = requests.get(self.h.router_url + "/router/state", timeout=2).json()
            metrics = parse_text(requests.get(self.h.router_url + "/metrics", timeout=2).text)
        except (requests.RequestException, ValueError):
            self.in_service.append((now, 0))
            return
        replicas = state.get("replicas", [])
        self.in_service.append((now, sum(r["state"] == "in_service" for r in replicas)))
        for key, value in metrics.items():
            name = key.split("{")[0]
            if name in ("grpo_router_hedges_total", "grpo_router_reroutes_total"):
                self.counters.observe("router", name, value)
            if name == "grpo_router_reroutes_total" and 'reason="lost_adapter"' in key:
                self.counters.observe("router", "lost_adapter_reroutes", value)
        for r in replicas:
            url = self.aliases.get(r["url"], r["url"])
            with contextlib.suppress(requests.RequestException, ValueError):
                values = parse_text(requests.get(url + "/metrics", timeout=2).text)
                for counter, metric_name in REPLICA_COUNTERS.items():
                    self.counters.observe(url, counter, sum(
                        v for k, v in values.items() if k.split("{")[0] == metric_name))

    def recovered_at(self, since: float, replicas: int) -> float | None:
        """When, after `since`, the pool was whole for good (every replica in service at every poll from then until
        the last step) and a step had been logged since `since`; None if either never happened."""
        new_steps = [t for (t, s), (_, before) in zip(self.step_times[1:], self.step_times) if s > before]
        if not new_steps:
            return None
        end = new_steps[-1]  # the last step's first sighting: after it the command shuts its router down
        window = [(t, n) for t, n in self.in_service if since <= t <= end]
        degraded = [t for t, n in window if n < replicas]
        whole = next((t for t, _ in window if not degraded or t > degraded[-1]), None)
        stepped = next((t for t in new_steps if t > since), None)  # a new step, not the log cut back by a resume
        if whole is None or stepped is None:
            return None
        return max(whole, stepped)


# -- the faults ----------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One scenario's command, while it runs: the faults see it here."""

    h: Hosts
    name: str
    out: Path
    cmd: list
    max_steps: int
    proc: subprocess.Popen | None = None
    watch: Watch | None = None
    notes: list = field(default_factory=list)
    resumed: bool = False
    killed_max_version: int | None = None

    def start(self, extra: tuple = ()) -> subprocess.Popen:
        log = open(self.out.parent / f"{self.name}{'-resume' if extra else ''}.log", "w")
        self.proc = subprocess.Popen(self.cmd + list(extra), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self.proc


def _server(run: Run, which: int = 0) -> dict:
    servers = replica_servers(run.h)
    if len(servers) <= which:
        raise LookupError(f"{len(servers)} replica server(s) found, wanted #{which}")
    return servers[which]


def server_kill9(run: Run, which: int = 0) -> float:
    """SIGKILL of a replica's server process (what an OOM kill does), one on the worker node if any; Ray's actor is
    left to notice."""
    os.kill(_server(run, which)["pid"], signal.SIGKILL)
    return time.monotonic()


def actor_kill(run: Run, which: int = 0) -> float:
    """The replica's Ray actor killed: its worker process SIGKILLed (what `ray.kill` does; the handle is the
    command's, not reachable from here), so Ray restarts it (`max_restarts`)."""
    os.kill(actor_of(_server(run, which)["pid"]), signal.SIGKILL)
    return time.monotonic()


def router_kill9(run: Run) -> float | None:
    """SIGKILL of the router process the command started; None (not injected) when the router is no process of its
    own."""
    pids = router_processes(run.proc.pid)
    if not pids:
        run.notes.append("not injectable: the router is a thread of the trainer's process (launcher.Cluster."
                         "start -> start_router), so kill -9 of the router is kill -9 of the trainer; the loop "
                         "restarting its router has not landed")
        return None
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def trainer_kill9(run: Run) -> float:
    """SIGKILL of the trainer (the command) after its first checkpoint reached the store, then `--resume` in the same
    output folder; Ray kills the actors its dead driver owned, the resumed command starts new ones."""
    os.kill(run.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run.proc.wait(30)
    with contextlib.suppress(ProcessLookupError):  # what is left of its group (the rollout worker follows it anyway)
        os.killpg(run.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while replica_servers(run.h) and time.monotonic() < deadline:
        time.sleep(0.5)
    published = AdapterStore(f"s3://{run.h.bucket}/{run.name}/adapters").history()
    run.killed_max_version = max(version_of(n, "trl-policy") for n in published)
    run.resumed = True
    run.start(("--resume",))
    return killed_at


def hang(run: Run, which: int = 0, duration: float = HANG_S) -> float:
    """SIGSTOP of a replica's server for `duration` (it holds its connections and answers nothing, `/health`
    included), then SIGCONT."""
    pid = _server(run, which)["pid"]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(duration)
    os.kill(pid, signal.SIGCONT)
    return time.monotonic()


def partition(run: Run, duration: float = PARTITION_S) -> float:
    """The worker node's cable pulled (its veth down: packets dropped, nothing refused) for `duration`, longer than
    the router's per-try deadline once latencies are known, shorter than Ray's node timeout; then healed."""
    run.h.network.partition(WORKER)
    try:
        time.sleep(duration)
    finally:
        run.h.network.heal(WORKER)
    return time.monotonic()


def latency(run: Run, duration: float = LATENCY_S) -> float:
    """200 ms each way between the router and a replica on the worker for `duration`: the router's membership is changed
    through its admin API (loopback) to reach that replica through `netns.DelayProxy` (on the head); then back. The
    kernel has no netem and the namespaces no iptables, so Ray's own traffic and the replica's S3 reads are not
    delayed."""
    direct = next(s["url"] for s in replica_servers(run.h) if s["role"] == WORKER)
    host, port = direct.rsplit("//", 1)[1].rsplit(":", 1)
    with netns.DelayProxy((host, int(port)), DELAY_MS) as proxy:
        proxied = f"http://127.0.0.1:{proxy.port}"
        run.watch.aliases[proxied] = direct
        _membership(run, "DELETE", direct)
        _membership(run, "POST", proxied)
        time.sleep(duration)
        _membership(run, "DELETE", proxied)
        _membership(run, "POST", direct)
    return time.monotonic()


def _membership(run: Run, method: str, url: str, tries: int = 3) -> None:
    body = {"url": url, "wait_s": 120} if method == "POST" else {"url": url, "drain_s": 30}
    for attempt in range(tries):
        try:
            answer = requests.request(method, run.h.router_url + "/router/replicas", json=body, timeout=180)
            break
        except requests.ConnectionError as error:
            run.notes.append(f"{method} /router/replicas try {attempt + 1}: {type(error).__name__} (netns inode "
                             f"{os.stat('/proc/thread-self/ns/net').st_ino}, command alive "
                             f"{run.proc.poll() is None})")
            if attempt == tries - 1:
                raise
            time.sleep(1.0)
    if answer.status_code >= 300:
        run.notes.append(f"{method} /router/replicas {url}: {answer.status_code} {answer.text[:200]}")


def s3_stop(run: Run, duration: float = S3_STOP_S) -> float:
    """The S3 server SIGSTOPped for `duration` (connections hang, nothing refused), then SIGCONT."""
    pids = [run.h.s3.pid] + [c.pid for c in psutil.Process(run.h.s3.pid).children(recursive=True)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(duration)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return time.monotonic()


FAULTS = {
    "server_kill9": server_kill9, "actor_kill": actor_kill, "router_kill9": router_kill9,
    "trainer_kill9": trainer_kill9, "hang": hang, "partition": partition, "latency": latency, "s3_stop": s3_stop,
    "hang_other": lambda run: hang(run, which=1, duration=HANG_S),
    "actor_kill_other": lambda run: actor_kill(run, which=1),
}
FAULT_SECONDS = {"hang": HANG_S, "hang_other": HANG_S, "partition": PARTITION_S, "latency": LATENCY_S,
                 "s3_stop": S3_STOP_S}


# -- one scenario --------------------------------------------------------------------------------------------------
def command(h: Hosts, name: str, out: Path, max_steps: int, save_steps: int) -> list[str]:
    return [sys.executable, "-m", "grpo_lab.cli", "async-loop", "--launcher", "ray", "--ray-address", h.address,
            "--adapter-storage", f"s3://{h.bucket}/{name}/adapters", "--checkpoint-storage",
            f"s3://{h.bucket}/{name}/ck", "--output-dir", str(out), "--max-steps", str(max_steps), "--save-steps",
            str(save_steps), "--max-staleness", str(MAX_STALENESS), "--prompts-per-step", str(PROMPTS_PER_STEP),
            "--num-generations", str(GENERATIONS), "--port", str(ROUTER_PORT)]


def run_scenario(h: Hosts, name: str, max_steps: int = 10, inject_at: int = 3, save_steps: int = 3) -> dict:
    faults = SCENARIOS[name]
    out = h.work / name / "run"
    out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(h, name, out, command(h, name, out, max_steps, save_steps), max_steps)
    t0 = time.monotonic()
    run.start()
    run.watch = watch = Watch(h, out).start()
    injected_at_step, fault_end, injected = None, None, False
    try:
        # a trainer kill waits for the first checkpoint on the store, so that the resume has one
        wait_for = max(inject_at, save_steps + 1) if "trainer_kill9" in faults else inject_at
        while watch.last_step() < wait_for:
            if run.proc.poll() is not None:
                run.notes.append(f"the command exited ({run.proc.returncode}) before step {wait_for}")
                break
            if time.monotonic() - t0 > RUN_TIMEOUT_S:
                run.notes.append(f"step {wait_for} not reached within {RUN_TIMEOUT_S:.0f} s")
                break
            time.sleep(0.2)
        else:
            baseline = len(replica_servers(h))
            injected_at_step = watch.last_step()
            ends = _inject_together(run, faults)
            injected = all(e is not None for e in ends)
            fault_end = max((e for e in ends if e is not None), default=None)
        if not injected and "router_kill9" in faults:  # nothing to measure: end the run now
            run.proc.send_signal(signal.SIGINT)
        _wait(run, t0)
    finally:
        watch.stop()
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    row = measure(run, faults, injected_at_step if injected else None,
                  watch.recovered_at(fault_end, baseline) if injected and fault_end else None, fault_end)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    _settle(h)
    return row


def _inject_together(run: Run, faults: tuple[str, ...]) -> list:
    ends: list = [None] * len(faults)

    def one(i, fault):
        try:
            ends[i] = FAULTS[fault](run)
        except Exception as error:  # a fault that could not be injected is a note, never a crash of the benchmark
            run.notes.append(f"{fault}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=one, args=(i, f)) for i, f in enumerate(faults)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ends


def _wait(run: Run, t0: float) -> None:
    try:
        run.proc.wait(max(RUN_TIMEOUT_S - (time.monotonic() - t0), 30))
    except subprocess.TimeoutExpired:
        run.notes.append(f"still running after {RUN_TIMEOUT_S:.0f} s: killed")
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(30)


def _settle(h: Hosts, timeout: float = 60.0) -> None:
    """Between scenarios: the previous run's replica actors gone, so the next placement starts clean."""
    deadline = time.monotonic() + timeout
    while replica_servers(h) and time.monotonic() < deadline:
        time.sleep(0.5)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])[:300]
    except OSError:
        return ""


# -- the measures --------------------------------------------------------------------------------------------------
def measure(run: Run, faults, injected_at_step, recovered_at, fault_end) -> dict:
    rows = read_steps(run.out)
    steps = [r["step"] for r in rows]
    published = AdapterStore(f"s3://{run.h.bucket}/{run.name}/adapters").history()
    versions = {version_of(n, "trl-policy"): p for n, p in published.items()}
    versions.pop(None, None)
    first_resumed = None
    if run.resumed and run.killed_max_version is not None:
        later = [v for v in versions if v > run.killed_max_version]
        first_resumed = min(later) if later else None
    resume_step = _resume_step(run)
    stale = 0
    for r in rows:
        used = {int(r[k]) for k in ("rollout/version_min", "rollout/version_max") if k in r}
        too_old = r.get("sample/staleness_max", 0) > MAX_STALENESS
        unpublished = any(v not in versions and v != 0 for v in used)
        killed_runs = first_resumed is not None and resume_step is not None and r["step"] > resume_step and any(
            v < first_resumed for v in used)
        stale += bool(too_old or unpublished or killed_runs)
    short = sum(max(0, PROMPTS_PER_STEP * GENERATIONS - int(r.get("batch/samples_per_step", 0))) for r in rows)
    c = run.watch.counters.total
    finished = run.proc.returncode == 0 and len(set(steps)) == run.max_steps
    if run.proc.returncode != 0:
        run.notes.append(f"exit {run.proc.returncode}: {_tail(run.out.parent / (run.name + ('-resume' if run.resumed else '') + '.log'))}")
    return {
        "scenario": run.name, "injected_at_step": injected_at_step if injected_at_step is not None else "",
        "recovered_s": round(recovered_at - fault_end, 1) if recovered_at is not None else "",
        "steps_done": len(set(steps)),
        "rollouts_lost": int(sum(r.get("rollout/stale_adapter_total", 0) for r in rows) + short),
        "misrouted": int(c["unknown_model"] + c["lost_adapter_reroutes"]),
        "stale_served": stale, "duplicate_steps": sum(n - 1 for n in Counter(steps).values() if n > 1),
        "run_finished": finished, "faults": "+".join(faults),
        "fault_s": max(FAULT_SECONDS.get(f, 0.0) for f in faults),
        "max_steps": run.max_steps, "hedges": int(c["grpo_router_hedges_total"]),
        "reroutes": int(c["grpo_router_reroutes_total"]),
        "retries": int(sum(r.get("rollout/vllm_retry_total", 0) for r in rows)),
        "abandoned_groups": int(sum(r.get("rollout/abandoned_groups_total", 0) for r in rows)),
        "cut_by_unload": int(c["cut_by_unload"]), "client_gone": int(c["client_gone"]),
        "note": "; ".join(run.notes),
    }


def _resume_step(run: Run) -> int | None:
    """The checkpoint step the resumed command went on from (its log says `resumed from checkpoint-N`)."""
    if not run.resumed:
        return None
    text = (run.out.parent / f"{run.name}-resume.log").read_text(errors="replace")
    marker = "resuming from "
    for line in text.splitlines():
        if marker in line and "checkpoint-" in line:
            with contextlib.suppress(ValueError):
                return int(line.rsplit("checkpoint-", 1)[1].split()[0].strip(".,)"))
    return None


# -- the benchmark -------------------------------------------------------------------------------------------------
def write_rows(rows: list[dict], path: Path) -> None:
    from grpo_lab.lab.records import run_record

    record = run_record("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *record])
        writer.writeheader()
        for row in rows:  # rows read back from an earlier run keep their own machine columns
            writer.writerow({**record, **row})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--inject-at", type=int, default=3)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--csv", type=Path, default=CSV_PATH)
    parser.add_argument("--append", action="store_true", help="add the rows to those already in --csv (a scenario "
                        "measured again, e.g. with more steps, replaces its row)")
    parser.add_argument("--work", type=Path, default=None, help="keep every run's folder and log here (default: a new "
                        "temporary folder, kept)")
    args = parser.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"chaos.py needs network namespaces: {reason}", file=sys.stderr)
        return 2
    earlier = []
    if args.append and args.csv.exists():
        with open(args.csv, newline="") as f:
            earlier = [r for r in csv.DictReader(f) if r["scenario"] not in names]
    rows = []
    work = args.work or Path(tempfile.mkdtemp(prefix="grpo-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"chaos run: runs and logs in {work}", flush=True)
    with hosts(work) as h:
        for name in names:
            row = run_scenario(h, name, max(args.max_steps, MIN_STEPS.get(name, 0)), args.inject_at, args.save_steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_rows(earlier + rows, args.csv)  # after every scenario: a run that dies keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
