"""What notebook 05 computes, kept in the package so the tests check it: the form's grid (comma lists) as a
`SweepConfig`, the live panels of a running sweep (curves, pool shares, status) with its Stop and Add controls, the
ranked table, and the files a refresh writes to results/sweep.

The panel draws from a thread while a sweep launched from the form runs, so the kernel stays free for the Stop and
Add buttons (a button's callback runs in the kernel: one that waited for the sweep would hold every other click);
`watch()` draws from the calling cell instead, for a Run All or a headless run that must wait for the end.
"""

from __future__ import annotations

import html
import io
import math
import threading
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..async_loop.loop_settings import REPLICA_KINDS, LoopSettings
from ..lab.settings import without_none
from .config import SweepConfig, SweepError, check_names
from .figures import CURVES
from .grid import expand
from .runner import DONE, Sweep

GRID_FIELDS = ("learning_rate", "num_generations", "lora_rank", "max_staleness", "seed")  # the form's grid boxes
START, JOIN = "start a pool", "join pool_url"   # the form's pool choice
FIGURE_FILE = "sweep.png"  # in the sweep's folder, beside summary.csv
RESULTS_SUMMARY, RESULTS_FIGURE = "notebook_summary.csv", "notebook_sweep.png"  # in results/sweep (a refresh)
TABLE_STYLE = ("<style>table.grpo-sweep td, table.grpo-sweep th {padding: 2px 10px; text-align: left} "
               "table.grpo-sweep {border-collapse: collapse}</style>")
TITLES = {"reward": "reward", "kl": "KL", "staleness": "staleness (versions)", "rollout_wait_s": "rollout wait (s)"}
PANELS = tuple((key, TITLES[key]) for key in CURVES)  # a panel per curve `Sweep.curves()` has


@dataclass(frozen=True)
class Mode:
    """A mode's starting values for the form: its grid (setting -> comma list), steps, pool and runs' environment."""

    grid: dict
    max_steps: int
    prompts_per_step: int
    replicas: int
    replica_kind: str
    parallel: int = SweepConfig.parallel
    env: dict = field(default_factory=dict)   # extra environment of every run


# quick: 3 runs on the embedded default, 2 CPU replicas, one torch thread per process (2 cores, a few minutes);
# full: a 12-run grid for a GPU machine, vLLM replicas
QUICK = Mode(grid={"learning_rate": "1e-3,3e-3,1e-2", "num_generations": "8", "lora_rank": "1", "max_staleness": "1",
                   "seed": "0"}, max_steps=6, prompts_per_step=1, replicas=SweepConfig.replicas, replica_kind="cpu",
             env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
FULL = Mode(grid={"learning_rate": "1e-3,3e-3,1e-2", "num_generations": "8", "lora_rank": "1,4", "max_staleness": "1,4",
                  "seed": "0"}, max_steps=50, prompts_per_step=2, replicas=2, replica_kind="vllm", parallel=4)


def form_values(mode: Mode, grid: dict | None = None, max_steps: int | None = None, replicas: int | None = None,
                parallel: int | None = None, model: str | None = None, replica_kind: str | None = None,
                pool_url: str | None = None, admin_key_file: str | None = None) -> dict:
    """The form's starting values: the mode's, with the parameters cell's choices (None: the mode's) on top. A
    `grid` entry outside the form's boxes goes to `more_grid`."""
    grid = {**mode.grid, **{k: ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)
                            for k, v in (grid or {}).items()}}
    more = "; ".join(f"{k}={v}" for k, v in grid.items() if k not in GRID_FIELDS)
    return {**{k: grid.get(k, "") for k in GRID_FIELDS}, "more_grid": more,
            "max_steps": max_steps or mode.max_steps, "prompts_per_step": mode.prompts_per_step,
            "replicas": replicas or mode.replicas, "parallel": parallel or mode.parallel,
            "pool": JOIN if pool_url else START, "pool_url": pool_url or "", "admin_key_file": admin_key_file or "",
            "replica_kind": replica_kind or mode.replica_kind, "model": model or ""}


def parse_value(name: str, text: str):
    """One value of the loop setting `name` from its text (`3e-3`, `8`, `true`), by the setting's type."""
    kind = without_none(typing.get_type_hints(LoopSettings)[name])
    text = text.strip()
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise SweepError(f"{name}: {text!r} is not true or false")
        return text.lower() == "true"
    for number, what in ((int, "a whole number"), (float, "a number")):
        if kind is number:
            try:
                return number(text)
            except ValueError:
                raise SweepError(f"{name}: {text!r} is not {what}") from None
    return [text] if typing.get_origin(kind) is list else text   # report_to: one tracker a value


def parse_values(name: str, text: str) -> list:
    """A comma list of values of the setting `name` (`1e-3, 3e-3`)."""
    check_names("grid", [name])
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise SweepError(f"{name}: give at least one value (a comma list, e.g. 1e-3,3e-3)")
    return [parse_value(name, item) for item in items]


def parse_assignments(text: str, lists: bool) -> dict:
    """`name=v1,v2; name=v` (lists) or `name=v, name=v` (one value each) as {setting: value(s)}."""
    parts = [p for p in text.replace("\n", ";").split(";" if lists else ",") if p.strip()]
    if not lists:  # "a=1; b=2" reads as well as "a=1, b=2"
        parts = [q for p in parts for q in p.split(";") if q.strip()]
    out = {}
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise SweepError(f"{part.strip()!r}: write setting=value" + (",value" if lists else ""))
        name = name.strip()
        out[name] = parse_values(name, value) if lists else parse_values(name, value)[0]
    return out


def sweep_config(values: dict, out_dir: str | None = None) -> SweepConfig:
    """The sweep the form's `values` describe (SweepError naming the box for a value it refuses)."""
    grid = {name: parse_values(name, values[name]) for name in GRID_FIELDS if str(values.get(name, "")).strip()}
    more = parse_assignments(values.get("more_grid", ""), lists=True)
    twice = set(grid) & set(more)
    if twice:
        raise SweepError(f"more grid: {', '.join(sorted(twice))} already has its own box")
    base = {"max_steps": values["max_steps"], "prompts_per_step": values["prompts_per_step"]}
    if values.get("model"):
        base["model"] = values["model"]
    join = values.get("pool") == JOIN
    if join and not (values.get("pool_url") and values.get("admin_key_file")):
        raise SweepError("join pool_url: give the pool's URL and its admin key file (grpo-lab serve-pool writes it)")
    if values.get("replica_kind", "cpu") not in REPLICA_KINDS:
        raise SweepError(f"replica kind must be one of {', '.join(REPLICA_KINDS)}")
    config = SweepConfig(base=base, grid={**grid, **more}, replicas=values["replicas"], parallel=values["parallel"],
                         pool={} if join else {"replica_kind": values.get("replica_kind", "cpu")},
                         pool_url=values["pool_url"] if join else None,
                         pool_admin_key_file=values["admin_key_file"] if join else None, out_dir=out_dir)
    expand(config.base, config.grid)  # every run's settings by the loop's rules, before anything starts
    return config


def controls(values: dict, on_launch):
    """The grid form (one box per `form_values` key, the grid's as comma lists) and its Launch button."""
    from ..lab.widgets import ParamForm

    return ParamForm(values, on_run=on_launch, button="Launch the sweep",
                     choices={"pool": (START, JOIN), "replica_kind": REPLICA_KINDS})


def grid_yaml(config: SweepConfig) -> str:
    """The sweep as a `grpo-lab sweep` grid file: the same runs headless, reopened here with `Sweep.load`."""
    import yaml

    keys = ("base", "grid", "replicas", "pool", "pool_url", "pool_admin_key_file", "parallel")
    return yaml.safe_dump({k: getattr(config, k) for k in keys if getattr(config, k) not in (None, {})},
                          sort_keys=False, default_flow_style=None)


def committed():
    """The committed results/sweep of this notebook (its ranked table and figure), or (None, None)."""
    import pandas as pd

    from ..lab.outputs import committed_results

    root = committed_results("sweep")
    table, figure = root / RESULTS_SUMMARY, root / RESULTS_FIGURE
    return (pd.read_csv(table) if table.is_file() else None, figure.read_bytes() if figure.is_file() else None)


# -- what the panels show -----------------------------------------------------------------------------------------
def sweep_png(curves, shares: dict, runs: list[str], dpi: int = 72) -> bytes:
    """Reward, KL, staleness and rollout wait per run, and each run's share of the pool, side by side."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = {name: f"C{i % 10}" for i, name in enumerate(runs)}
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(3.2 * (len(PANELS) + 1), 2.8))
    for ax, (key, title) in zip(axes, PANELS):
        for name in runs:
            points = curves[curves["run"] == name] if len(curves) else curves
            points = points[points[key].notna()] if len(points) else points
            if len(points):
                ax.plot(points["step"], points[key], marker=".", lw=1.2, color=colors[name], label=name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if len(curves):
        axes[0].legend(fontsize=7)
    ax = axes[-1]
    named = [n for n in runs if not math.isnan(shares.get(n, {}).get("share", math.nan))]
    ax.barh(named, [100 * shares[n]["share"] for n in named], color=[colors[n] for n in named])
    ax.set_title("share of the pool (% completions)", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def status_html(status: list[dict], shares: dict) -> str:
    """One row per run: status, steps, pool share, completions queued at the router, its log's last line."""
    rows = []
    for e in status:
        share = shares.get(e["name"], {})
        pct = "" if math.isnan(share.get("share", math.nan)) else f"{100 * share['share']:.0f}%"
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            e["name"], e["status"], f"{e['step']}/{e['max_steps']}", pct, share.get("queued", ""),
            e["last_line"][-90:])) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("run", "status", "step", "pool share", "queued", "last line"))
    return f"{TABLE_STYLE}<table class='grpo-sweep'><tr>{head}</tr>{''.join(rows)}</table>"


def counts(status: list[dict]) -> str:
    by = {}
    for e in status:
        by[e["status"]] = by.get(e["status"], 0) + 1
    return ", ".join(f"{n} {s}" for s, n in by.items())


def ranked(sweep):
    """`Sweep.summary()` with a rank (finished runs first), and each run's tracker run where its settings log to
    one."""
    import pandas as pd

    table = sweep.summary()
    if not len(table):
        return table
    # finished runs first (a run stopped after 2 steps is not the sweep's best however high its last reward)
    table = table.sort_values("status", key=lambda s: s != "finished", kind="stable").reset_index(drop=True)
    table.index = pd.RangeIndex(1, len(table) + 1, name="rank")
    trackers = {name: ", ".join(f"{t}: {name}" for t in LoopSettings(**run.settings).trackers)
                for name, run in sweep.runs.items()}
    if any(trackers.values()):
        table["tracker"] = [trackers.get(name, "") for name in table["run"]]
    return table


def write_results(table, png: bytes, folder: str | Path, device: str = "auto") -> Path:
    """The ranked table (with the machine, versions and date) and the figure, for results/sweep; returns the CSV."""
    from ..lab.records import run_record

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    frame = table.reset_index()
    for key, value in run_record(device).items():
        frame[key] = value
    path = folder / RESULTS_SUMMARY
    frame.to_csv(path, index=False)
    (folder / RESULTS_FIGURE).write_bytes(png)
    return path


# -- the panel ----------------------------------------------------------------------------------------------------
class SweepPanel:
    """The live view of one sweep at a time: a status line, the figure, the runs' table, a Stop control (a run and
    its button) and an Add control (`setting=value, ...`), and at the end the ranked table. Without a widget
    frontend it prints a line per run whenever its status or step changes, and shows the last figure."""

    def __init__(self, env: dict | None = None, refresh_s: float = 2.0, title: str = "sweep"):
        from ..lab.live_board import display_frontend

        self.env, self.refresh_s, self.title = dict(env or {}), refresh_s, title
        self.sweep = None
        self.png: bytes | None = None
        self.table = None
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._shown: dict[str, tuple] = {}
        self.widgets = display_frontend() == "widgets"
        if self.widgets:
            self._build()

    def _build(self) -> None:
        import ipywidgets as w

        self.header = w.HTML(value=f"<b>{html.escape(self.title)}</b>: launch a sweep")
        self.plot = w.Output()
        self.runs_table = w.HTML(value="")
        self.run_choice = w.Dropdown(options=[], description="run", layout=w.Layout(width="320px"))
        self.stop_button = w.Button(description="Stop run", button_style="warning", layout=w.Layout(width="auto"))
        self.add_text = w.Text(value="", description="add run", placeholder="learning_rate=5e-3, max_steps=8",
                               layout=w.Layout(width="420px"))
        self.add_button = w.Button(description="Add run", layout=w.Layout(width="auto"))
        self.message = w.HTML(value="")
        self.summary_area = w.HTML(value="")
        self.stop_button.on_click(lambda _: self._in_thread(self.stop, self.run_choice.value))
        self.add_button.on_click(lambda _: self._in_thread(self.add, self.add_text.value))
        self.box = w.VBox([self.header, self.plot, self.runs_table,
                           w.HBox([self.run_choice, self.stop_button]), w.HBox([self.add_text, self.add_button]),
                           self.message, self.summary_area])

    def show(self) -> SweepPanel:
        if self.widgets:
            from IPython.display import display

            display(self.box)
        return self

    def _say(self, text: str, error: bool = False) -> None:
        if self.widgets:
            style = " style='color:#b00'" if error else ""
            self.message.value = f"<span{style}>{html.escape(text)}</span>"
        else:
            print(text, flush=True)

    def _in_thread(self, action, arg) -> None:
        """A button's action away from the kernel's message loop (a stop waits for its run to leave the pool)."""
        threading.Thread(target=action, args=(arg,), daemon=True).start()

    # -- the sweep ------------------------------------------------------------------------------------------------
    def launch(self, config: SweepConfig, live: bool = True):
        """Start `config`'s sweep (one at a time); `live`: redraw from a thread until it ends, and return at once."""
        with self._lock:
            if self.sweep is not None and not self.ended():
                raise SweepError("a sweep is still running here: stop its runs first (or wait for it)")
            self.table, self.png, self._shown = None, None, {}
            if self.widgets:
                self.summary_area.value = ""
            self.sweep = Sweep(config, env=self.env).start()
        self._say(f"{len(self.sweep.runs)} runs on {self.sweep.url}; folder {self.sweep.folder}")
        self.refresh()
        if live:
            self._thread = threading.Thread(target=self._live, name="sweep-panel", daemon=True)
            self._thread.start()
        return self.sweep

    def ended(self) -> bool:
        return self.sweep is not None and all(e["status"] in DONE for e in self.sweep.status())

    def _live(self) -> None:
        try:
            self.watch()
        except Exception as error:  # noqa: BLE001 - shown in the panel: a thread has no cell for a traceback
            self._say(f"the live panel stopped: {type(error).__name__}: {error}", error=True)

    def watch(self, timeout_s: float | None = None):
        """Redraw every `refresh_s` until every run ended (or `timeout_s`), then `finish()`; returns the ranked
        table (None on a timeout)."""
        import time

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.sweep.wait(timeout_s=self.refresh_s):
            self.refresh()
            if deadline is not None and time.monotonic() > deadline:
                return None
        return self.finish()

    def refresh(self) -> None:
        """Redraw the figure, the runs' table and the status line from the sweep's files and the pool."""
        with self._lock:
            sweep = self.sweep
            status, shares, curves = sweep.status(), sweep.shares(), sweep.curves()
            self.png = sweep_png(curves, shares, list(sweep.runs))
            head = f"<b>{html.escape(self.title)}</b>: {counts(status)} | folder {html.escape(str(sweep.folder))}"
            if not self.widgets:
                for e in status:
                    key = (e["status"], e["step"])
                    if self._shown.get(e["name"]) != key:
                        self._shown[e["name"]] = key
                        print(f"{e['name']}: {e['status']} step {e['step']}/{e['max_steps']}", flush=True)
                return
            self.header.value = head
            self.runs_table.value = status_html(status, shares)
            self._put_png(self.png)
            running = [e["name"] for e in status if e["status"] not in DONE]
            if list(self.run_choice.options) != running:
                self.run_choice.options = running

    def _put_png(self, png: bytes) -> None:
        """The figure into the plot area: its outputs set directly, which a thread may do in ipywidgets 7 and 8."""
        import base64

        self.plot.outputs = ({"output_type": "display_data", "metadata": {},
                              "data": {"image/png": base64.b64encode(png).decode(), "text/plain": "sweep figure"}},)

    def finish(self):
        """The end: the last figure (also `sweep.png` in the sweep's folder), the pool stopped, the ranked table."""
        with self._lock:
            self.refresh()
            self.sweep.close()
            self.table = ranked(self.sweep)
            (self.sweep.folder / FIGURE_FILE).write_bytes(self.png)
            if self.widgets:
                self.summary_area.value = ("<b>ranked by final reward</b> (finished runs first)" + TABLE_STYLE
                                           + self.table.reset_index().to_html(index=False, classes="grpo-sweep"))
                self.run_choice.options = []
        self._say(f"done: {counts(self.sweep.status())}; summary {self.sweep.folder / 'summary.csv'}")
        return self.table

    def stop(self, name: str | None) -> str:
        """Stop one run while the others go on."""
        if self.sweep is None or not name:
            self._say("no run to stop", error=True)
            return ""
        self._say(f"stopping {name}…")
        try:
            status = self.sweep.stop(name)
        except SweepError as error:
            self._say(str(error), error=True)
            return ""
        self._say(f"{name}: {status}")
        self.refresh()
        return status

    def add(self, text: str) -> str:
        """Queue one more run (`setting=value, ...` over the sweep's base); it trains when a place frees."""
        try:
            if self.sweep is None or self.ended():
                raise SweepError("no sweep running: launch one from the form")
            settings = parse_assignments(text, lists=False)
            if not settings:
                raise SweepError("add run: write the settings that differ, e.g. learning_rate=5e-3")
            name = self.sweep.add(settings)
        except SweepError as error:
            self._say(str(error), error=True)
            return ""
        self._say(f"added {name}")
        self.refresh()
        return name

