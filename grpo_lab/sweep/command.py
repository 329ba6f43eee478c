"""`grpo-lab sweep GRID.yaml`: the runs of a grid as tenants of one pool, from a terminal, with a line per run
whenever its status or step changes and the ranked table at the end.

    grpo-lab sweep grid.yaml                         # the pool, runs and folder the file describes
    grpo-lab sweep grid.yaml --max-steps 5 --parallel 2 --out-dir outputs/sweep/quick

A bad grid file (not YAML, an unknown key or setting, an empty grid, a value a setting's rule refuses) is one line
on stderr and exit status 2, before anything starts. Ctrl-C (or SIGTERM) stops every run and the pool.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .config import SweepConfig, SweepError
from .grid import expand

PROG = "grpo-lab sweep"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command's few flags: everything else is in the grid file (`SweepConfig`'s keys)."""
    ap = _Parser(prog=PROG, description=(
        "Run every combination of a YAML grid's loop settings as `grpo-lab async-loop` runs sharing one replica "
        "pool (keys: " + ", ".join(SweepConfig.__dataclass_fields__) + "); see docs/shared_pool.md, Sweeps."))
    ap.add_argument("grid", metavar="GRID.yaml", help="the sweep: base settings, grid, pool, out_dir, parallel")
    ap.add_argument("--max-steps", type=int, default=None, help="every run's max_steps (overrides the file's base)")
    ap.add_argument("--parallel", type=int, default=None, help="runs training at once (overrides the file)")
    ap.add_argument("--out-dir", default=None, help="the sweep's folder (overrides the file)")
    return ap


def progress_line(entry: dict) -> str:
    return (f"{entry['name']}: {entry['status']} step {entry['step']}/{entry['max_steps']}"
            + (f" | {entry['last_line'][:100]}" if entry["last_line"] else ""))


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    overrides = {key: value for key, value in (("parallel", a.parallel), ("out_dir", a.out_dir)) if value is not None}
    if a.max_steps is not None:
        overrides["base"] = {"max_steps": a.max_steps}
    try:
        config = SweepConfig.from_yaml(a.grid, **overrides)
        expand(config.base, config.grid)  # every run's settings checked before the runner's heavier imports
        from .runner import Sweep

        sweep = Sweep(config)
    except SweepError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    shown: dict[str, tuple] = {}
    try:
        sweep.start()
        print(f"sweep: {len(sweep.runs)} runs on {sweep.url}, {config.parallel} at a time; folder {sweep.folder}",
              flush=True)
        while True:
            done = sweep.wait(timeout_s=2.0)
            for entry in sweep.status():
                key = (entry["status"], entry["step"])
                if shown.get(entry["name"]) != key:
                    shown[entry["name"]] = key
                    print(progress_line(entry), flush=True)
            if done:
                break
    except KeyboardInterrupt:
        print("interrupted: stopping every run and the pool", file=sys.stderr)
        return 130
    except SweepError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    finally:
        sweep.close()
    table = sweep.summary()
    columns = [c for c in ("run", "status", "steps", "final_reward", "kl", "pool_share") if c in table]
    print(table[columns].to_string(index=False), flush=True)
    print(f"summary: {sweep.folder / 'summary.csv'}; each run's folder under {sweep.folder / 'runs'}", flush=True)
    return 0 if all(entry["status"] in ("finished", "stopped") for entry in sweep.status()) else 1
