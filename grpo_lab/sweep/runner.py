"""`Sweep`: the runs of a grid as tenants of one replica pool, each its own `grpo-lab async-loop` process.

    with Sweep(SweepConfig(base={"max_steps": 20}, grid={"learning_rate": [1e-3, 3e-3, 1e-2]})) as sweep:
        sweep.stop("lr1e-2")            # one run ends (its adapters leave every replica); the others go on
        sweep.add({"learning_rate": 5e-3})
        sweep.wait()
        print(sweep.summary())          # ranked by final reward, with each run's folder

The sweep starts a pool (`async_loop.serve_pool.SharedPool`) or joins one (`pool_url`), then keeps up to
`parallel` runs training: a thread starts the next queued run when one ends and records every change in
`sweep.json` (the grid, each run's settings, status, folder and log). A run is `queued`, `running`, `finished`
(exit 0), `stopped` (by `stop`) or `failed`. Closing the sweep (also on Ctrl-C or an exception in a `with` block)
stops every run it started, by process group, and the pool if it started it.

The sweep's folder: `sweep.json`, `summary.csv`, `runs/<name>/` (each run's output folder: checkpoints, its
`loop_metrics.jsonl`, `run.json`), `settings/<name>.yaml` (its exact `--config`), `logs/<name>.log`, `pool/` (the
pool's admin key and replica logs, when the sweep started it).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import math
import subprocess
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..async_loop.checks import first_line
from ..async_loop.serve_pool import PoolConfig, SharedPool
from ..lab.files import write_atomically
from ..lab.outputs import output_dir
from ..serving.adapters.slots import max_loras_for
from ..serving.router.admin_client import RouterAdminClient, RouterAdminError
from .config import SweepConfig, SweepError, as_setting_value, check_names
from .figures import CURVES, curve_points, last_line, mean_of_last, pool_shares, step_rows
from .grid import RunSpec, check_name, check_settings, expand, labels_for, run_name
from .process import kill_group, launch, reap_group, stop_process, write_settings

log = logging.getLogger(__name__)

SWEEP_FILE, SUMMARY_FILE = "sweep.json", "summary.csv"
FIGURE = "sweep"  # the default folder's name under outputs/
POLL_S = 0.5
DONE = ("finished", "stopped", "failed")


@dataclass
class RunState:
    """One run of the sweep as `sweep.json` records it."""

    name: str
    settings: dict
    varied: dict
    output_dir: str
    settings_file: str
    log_file: str
    status: str = "queued"
    pid: int | None = None
    returncode: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    stopping: bool = field(default=False, repr=False)

    def record(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("proc", "stopping")}


class Sweep:
    """Runs of a grid sharing one pool: `start()` (or `with`), `add`, `stop`, `status`, `rows`, `curves`, `shares`,
    `wait`, `summary`, `close()`; `Sweep.load(folder)` reads a sweep's folder back to look at."""

    def __init__(self, config: SweepConfig, env: dict | None = None):
        self.config = config
        self.env = dict(env or {})  # extra environment for every run (e.g. OMP_NUM_THREADS)
        self.folder = Path(config.out_dir) if config.out_dir else None
        self.runs: dict[str, RunState] = {}
        self.pool: SharedPool | None = None
        self.url, self.admin_key_file = config.pool_url, config.pool_admin_key_file
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[str, dict] = {}  # each run's last pool figures (a run that left keeps its last)
        self.read_only = False  # a folder read back (`load`): shows, never starts, stops or writes
        self._started = False  # the folder is this sweep's (start() made it): records may be written there
        for spec in expand(config.base, config.grid):
            self._queue(spec)

    @classmethod
    def load(cls, folder: str | Path) -> Sweep:
        """A sweep's folder read back (one run headless by `grpo-lab sweep`, or an earlier session's), to look at:
        `status`, `rows`, `curves`, `shares` and `summary` read its records and its runs' metrics logs as they are
        now; it starts, stops and adds nothing."""
        folder = Path(folder)
        try:
            record = json.loads((folder / SWEEP_FILE).read_text())
        except (OSError, ValueError) as error:
            raise SweepError(f"{folder} holds no readable {SWEEP_FILE}: {first_line(error)}") from None
        sweep = cls(SweepConfig(**{**record["config"], "out_dir": str(folder)}))
        sweep.folder, sweep.url = folder, record["pool"]["url"]
        sweep.runs = {r["name"]: RunState(**r) for r in record["runs"]}
        sweep._seen = record.get("pool_figures", {})
        sweep._closed.set()
        sweep.read_only = True
        return sweep

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> Sweep:
        """Make the folder, start (or check) the pool, then the runs, `parallel` at a time."""
        self.folder = self._make_folder()
        self._started = True
        for run in self.runs.values():
            self._place(run)
        try:
            if self.url is None:
                self.pool = SharedPool(self._pool_config()).start()
                self.url, self.admin_key_file = self.pool.url, self.pool.admin_key_file
            self._admin().runs()  # the pool answers and takes the key, before any run starts
        except (RouterAdminError, OSError) as error:
            self.close()
            raise SweepError(f"the pool at {self.url} refused the sweep: {first_line(error)}") from None
        except BaseException:
            self.close()
            raise
        self._record()
        atexit.register(self.close)  # an interpreter that exits without close() still stops every run
        self._thread = threading.Thread(target=self._supervise, name="sweep", daemon=True)
        self._thread.start()
        return self

    def _make_folder(self) -> Path:
        if self.folder is None:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            return output_dir(f"{FIGURE}/{stamp}")
        folder = output_dir(FIGURE, self.folder)
        if (folder / SWEEP_FILE).exists():
            raise SweepError(f"{folder} already holds a sweep ({SWEEP_FILE}): give another out_dir")
        return folder

    def _pool_config(self) -> PoolConfig:
        c = self.config
        staleness = max(check_settings(run.name, run.settings).max_staleness for run in self.runs.values())
        slots = c.adapter_slots or c.parallel * max_loras_for(staleness)  # `parallel`: runs added later fit too
        extra = {"model": c.base["model"]} if c.base.get("model") else {}
        try:
            return PoolConfig(**{**extra, **c.pool}, replicas=c.replicas, adapter_slots=slots, lease_s=c.run_lease,
                              state_dir=str(self.folder / "pool"))
        except ValueError as error:
            raise SweepError(f"pool: {first_line(error)}") from None

    def _admin(self) -> RouterAdminClient:
        try:
            return RouterAdminClient(self.url, key_file=self.admin_key_file, timeout_s=30.0)
        except ValueError as error:  # the key file is unreadable or empty: the pool cannot be asked, as if it refused
            raise RouterAdminError(str(error), 0) from None

    def close(self) -> None:
        """Stop every run still queued or training (by process group: none is left), then the pool it started."""
        if self.read_only:
            return
        self._closed.set()
        atexit.unregister(self.close)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        try:
            for name in list(self.runs):
                try:
                    self.stop(name)
                except Exception:  # one run's failed stop must not leave the others running
                    run = self.runs[name]
                    if run.proc is not None:
                        kill_group(run.proc)
                    log.exception("stopping run %s", name)
        finally:
            pool, self.pool = self.pool, None
            if pool is not None:
                pool.stop()
        if self._started:
            self._record()
            self.summary()

    def __enter__(self) -> Sweep:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- runs ---------------------------------------------------------------------------------------------------
    def _queue(self, spec: RunSpec) -> RunState:
        run = RunState(spec.name, spec.settings, spec.varied, "", "", "")
        self.runs[spec.name] = run
        if self.folder is not None:
            self._place(run)
        return run

    def _place(self, run: RunState) -> None:
        run.output_dir = str(self.folder / "runs" / run.name)
        run.settings_file = str(self.folder / "settings" / f"{run.name}.yaml")
        run.log_file = str(self.folder / "logs" / f"{run.name}.log")

    def add(self, settings: dict, name: str | None = None) -> str:
        """Queue one more run: the sweep's `base` with `settings` on top; named after the grid settings it sets
        (or `name`). Returns its name; SweepError for a setting or name it refuses."""
        self._writable("add")
        check_names("add", settings)
        settings = {key: as_setting_value(key, value) for key, value in settings.items()}
        merged = {**self.config.base, **settings}
        varied = {key: value for key, value in settings.items() if self.config.base.get(key, object()) != value}
        if name is None:
            name = run_name(varied, labels_for(varied))
            taken = [n for n in self.runs if n == name or n.startswith(name + "-")]
            name = f"{name}-{len(taken) + 1}" if taken else name
        else:
            try:
                check_name(name)
            except SweepError as error:
                raise SweepError(f"add: {error}") from None
        if name in self.runs:
            raise SweepError(f"add: the sweep already has a run named {name!r}")
        check_settings(f"run {name}", merged)
        with self._lock:
            self._queue(RunSpec(name, merged, varied))
            self._record()
        return name

    def _launch(self, run: RunState) -> None:
        settings = {**run.settings, "output_dir": run.output_dir, "run_name": run.name, "router_url": self.url,
                    "pool_admin_key_file": str(Path(self.admin_key_file).resolve())}
        run.started_at = time.time()
        try:
            write_settings(Path(run.settings_file), settings)
            run.proc = launch(Path(run.settings_file), Path(run.log_file), self.env)
        except OSError as error:  # the run fails, the sweep goes on
            run.status, run.ended_at = "failed", time.time()
            Path(run.log_file).parent.mkdir(parents=True, exist_ok=True)
            with open(run.log_file, "a") as f:
                f.write(f"grpo-lab sweep: could not start the run: {first_line(error)}\n")
            return
        run.pid, run.status = run.proc.pid, "running"

    def stop(self, name: str, timeout_s: float | None = None) -> str:
        """Stop one run (a queued one never starts): SIGTERM, SIGKILL to its process group after `timeout_s`
        (default `stop_timeout_s`); then it is removed from the pool if it is still there, so its adapters leave
        every replica. Returns its status."""
        self._writable("stop")
        with self._lock:
            run = self._run(name)
            if run.status == "queued":
                run.status, run.ended_at = "stopped", time.time()
                self._record()
                return run.status
            if run.status in DONE or run.proc is None:
                return run.status
            run.stopping = True
        stop_process(run.proc, self.config.stop_timeout_s if timeout_s is None else timeout_s)
        self._leave_pool(name)
        with self._lock:
            self._ended(run)
            self._record()
        return run.status

    def _leave_pool(self, name: str) -> None:
        """Remove the run from the pool (its adapters unloaded after their drain) if it did not leave by itself."""
        if self.url is None:
            return
        try:
            self._admin().remove_run(name)
        except (RouterAdminError, OSError):
            pass  # the pool is gone, or will reclaim the run after its lease

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise SweepError(f"{what}: this sweep was read back from {self.folder}; {what} it where it runs")

    def _run(self, name: str) -> RunState:
        if name not in self.runs:
            raise SweepError(f"no run {name!r} in this sweep; its runs: {', '.join(self.runs)}")
        return self.runs[name]

    def _ended(self, run: RunState) -> None:
        if run.status in DONE:
            return
        run.returncode = run.proc.returncode
        run.status = "stopped" if run.stopping else "finished" if run.returncode == 0 else "failed"
        run.ended_at = time.time()

    # -- the supervising thread -----------------------------------------------------------------------------------
    def _supervise(self) -> None:
        """Every `POLL_S`: notice runs that ended, start queued ones while fewer than `parallel` train, keep each
        run's pool figures; record every change."""
        last_figures = 0.0
        while not self._closed.wait(POLL_S):
            try:
                last_figures = self._supervise_once(last_figures)
            except Exception:  # logged: the runs must stay supervised
                log.exception("sweep supervision")

    def _supervise_once(self, last_figures: float) -> float:
        """One round of `_supervise`; returns when the pool figures were last read."""
        ended = []
        with self._lock:
            changed = False
            for run in self.runs.values():
                if run.status == "running" and not run.stopping and run.proc.poll() is not None:
                    self._ended(run)
                    ended.append(run)
                    changed = True
            running = sum(r.status == "running" for r in self.runs.values())
            for run in self.runs.values():
                if running >= self.config.parallel or self._closed.is_set():
                    break
                if run.status == "queued":
                    self._launch(run)
                    running += run.status == "running"
                    changed = True
            if changed:
                self._record()
        for run in ended:
            reap_group(run.proc)
        if time.monotonic() - last_figures > 2.0:
            last_figures = time.monotonic()
            self._pool_figures()
        return last_figures

    def _pool_figures(self) -> None:
        try:
            listed = self._admin().runs()["runs"]
        except (RouterAdminError, OSError, KeyError, ValueError):
            return
        with self._lock:
            for entry in listed:
                if entry.get("name") in self.runs:
                    self._seen[entry["name"]] = entry

    # -- what it shows ------------------------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """Each run: its status, steps logged, last log line, folder, pid and exit status."""
        with self._lock:
            runs = list(self.runs.values())
        out = []
        for run in runs:
            rows = step_rows(run.output_dir) if run.output_dir else []
            out.append({"name": run.name, "status": run.status, "step": rows[-1]["step"] if rows else 0,
                        "max_steps": check_settings(run.name, run.settings).max_steps,
                        "last_line": last_line(run.log_file) if run.log_file else "",
                        "output_dir": run.output_dir, "pid": run.pid, "returncode": run.returncode})
        return out

    def rows(self, name: str) -> list[dict]:
        """The run's metrics rows so far (one per step; `curve_points` picks reward, KL, staleness, waiting)."""
        return step_rows(self._run(name).output_dir)

    def curves(self):
        """Every run's curves as one long DataFrame (run, step, reward, kl, staleness, rollout_wait_s)."""
        import pandas as pd

        return pd.DataFrame([{"run": name, **point} for name in list(self.runs)
                             for point in curve_points(self.rows(name))])

    def shares(self) -> dict[str, dict]:
        """Each run's share of the pool (completions granted, of all the sweep's runs'), with its queue figures;
        a run that left keeps its last figures."""
        if not self._closed.is_set():
            self._pool_figures()
        with self._lock:
            return pool_shares(list(self._seen.values()))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until no run is queued or training (True), or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                busy = [r for r in self.runs.values() if r.status not in DONE]
            if not busy:
                self.summary()
                return True
            if self._thread is None or not self._thread.is_alive():
                raise SweepError("the sweep is not started (or was closed): call start() first")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def summary(self):
        """The runs ranked by final reward (mean of the last steps), each with its figures and folder; also
        written to `summary.csv` in the sweep's folder."""
        import pandas as pd

        shares = pool_shares(list(self._seen.values()))
        table = []
        for entry in self.status():
            rows = step_rows(entry["output_dir"]) if entry["output_dir"] else []
            run = self.runs[entry["name"]]
            table.append({
                "run": entry["name"], "status": entry["status"], "steps": entry["step"],
                "max_steps": entry["max_steps"], **run.varied,
                "final_reward": mean_of_last(rows, CURVES["reward"]),
                "kl": mean_of_last(rows, CURVES["kl"]),
                "staleness": mean_of_last(rows, CURVES["staleness"], len(rows) or 1),
                "rollout_wait_s": mean_of_last(rows, CURVES["rollout_wait_s"], len(rows) or 1),
                "pool_share": shares.get(entry["name"], {}).get("share", math.nan),
                "output_dir": entry["output_dir"]})
        frame = pd.DataFrame(table)
        if not frame.empty:
            frame = frame.sort_values("final_reward", ascending=False, na_position="last", kind="stable")
            frame = frame.reset_index(drop=True)
        if self._started:
            write_atomically(self.folder / SUMMARY_FILE, frame.to_csv(index=False))
        return frame

    def _record(self) -> None:
        """`sweep.json`: the sweep's settings, the pool, every run's settings, status, folder and log, and the
        runs' last pool figures (written whole)."""
        if not self._started:
            return
        record = {"config": {f.name: getattr(self.config, f.name) for f in fields(self.config)},
                  "pool": {"url": self.url, "admin_key_file": self.admin_key_file,
                           "started_by_sweep": self.config.pool_url is None},
                  "runs": [run.record() for run in self.runs.values()], "pool_figures": self._seen}
        write_atomically(self.folder / SWEEP_FILE, json.dumps(record, indent=1, default=str) + "\n")
