"""The live bottleneck board: what each side of the async loop spends its time on, and the doctor's verdict.

A `TrainerCallback` that plots, per step, what docs/async_loop.md lists and shows `doctor.diagnose` on the last
steps. Core ipywidgets only (`lab.live_board.LiveBoard`), so it runs on Colab's 7.7.1 and on 8.x; redrawn at most
every `redraw_every_s` (the verdict every `verdict_every` steps), so a long run does not flood the output. Outside a
notebook it prints a line now and then.
"""

from __future__ import annotations

from transformers import TrainerCallback

from ..lab.live_board import LiveBoard, Series
from .doctor import DoctorConfig, Verdict, diagnose, replica_notes
from .recorder import router_figures, router_snapshot

SERIES = (
    Series("step_s", "step time (s)"), Series("fwd_bwd_s", "forward+backward (s)"),
    Series("rollout_wait_s", "rollout wait (s)"), Series("queue", "rollout queue (samples)"),
    Series("backpressure_s", "backpressure (s)"), Series("staleness", "staleness (versions)"),
    Series("ratio", "IS ratio"), Series("reward", "reward", rolling=5), Series("completions_per_s", "completions/s"),
    Series("affinity", "prefix affinity (share)"), Series("load_imbalance", "replica load max/mean"),
    Series("weight_sync_s", "weight sync (s)"), Series("inflight", "requests in flight (autotune: its cap)"),
)
LOG_KEYS = {"step_s": "perf/step_s", "fwd_bwd_s": "perf/fwd_bwd_s", "rollout_wait_s": "perf/rollout_wait_s",
            "queue": "sample/rollout_queue_size", "backpressure_s": "rollout/backpressure_s",
            "staleness": "sample/staleness_mean", "ratio": "ratio", "reward": "reward",
            "weight_sync_s": "perf/weight_sync_s"}


def board_values(row: dict, previous_router: dict | None) -> dict:
    """One logged row (TRL logs + the recorder's router snapshot) as the board's values."""
    values = {k: row.get(log_key) for k, log_key in LOG_KEYS.items()}
    values["inflight"] = next((row[k] for k in ("autotune/inflight", "rollout/inflight") if row.get(k) is not None),
                              None)
    if values["backpressure_s"] is None:
        values["backpressure_s"] = 0.0  # logged only when generation was held back
    samples, step_s = row.get("batch/samples_per_step"), row.get("perf/step_s")
    if samples and step_s:
        values["completions_per_s"] = samples / step_s
    router = router_figures(row.get("router") if isinstance(row.get("router"), dict) else None, previous_router)
    values["affinity"], values["load_imbalance"] = router.get("affinity_share"), router.get("load_imbalance")
    return values


class LoopBoard(TrainerCallback):
    """Live board + doctor for the async loop. `mode` "auto" is widgets in a notebook, printing elsewhere; `router_url`
    (filled in by `AsyncLoop`) gives per-replica load and affinity; `doctor` defaults to vLLM's thresholds."""

    def __init__(self, total_steps: int, max_staleness: int, max_inflight_tasks: int | None = None,
                 mode: str = "auto", redraw_every_s: float = 3.0, verdict_every: int = 5, title: str = "async loop",
                 router_url: str | None = None, doctor: DoctorConfig | None = None):
        self.router_url = router_url
        self.doctor = doctor
        self.board = LiveBoard(title, total=total_steps, series=SERIES, redraw_every_s=redraw_every_s, mode=mode,
                               ncols=4, unit="step").show()
        self.max_staleness, self.max_inflight_tasks = max_staleness, max_inflight_tasks
        self.verdict_every = max(1, verdict_every)
        self.rows: list[dict] = []
        self.autotune_changes: list[str] = []  # one line per autotune change, shown under the verdict
        self.verdict: Verdict | None = None
        self._verdict_view = None
        self._last_router = None
        self._final_png: bytes | None = None
        if self.board.mode in ("widgets", "handle"):
            self._open_verdict()

    def _open_verdict(self) -> None:
        from IPython.display import HTML, display

        if self.board.mode == "widgets":
            import ipywidgets as w

            self._verdict_view = w.HTML(value="<b>Doctor:</b> waiting for steps")
            display(self._verdict_view)
        else:
            self._verdict_view = display(HTML("<b>Doctor:</b> waiting for steps"), display_id=True)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.max_inflight_tasks is None:
            self.max_inflight_tasks = getattr(args, "max_inflight_tasks", None)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        row = dict(logs, step=state.global_step)
        snapshot = router_snapshot(self.router_url)
        if snapshot is not None:
            row["router"] = snapshot
        self.rows.append(row)
        if logs.get("autotune/changes_total"):
            self.autotune_changes.append(
                f"step {state.global_step}: in flight {logs['autotune/inflight']:.0f}, queue bound "
                f"{logs['autotune/queue_bound']:.0f} (rollout wait {100 * logs.get('autotune/rollout_wait_share', 0):.0f}%"
                f", wasted {100 * logs.get('autotune/waste_share', 0):.1f}%)")
        self.board.update(state.global_step, **board_values(row, self._last_router))
        self._last_router = row.get("router") or self._last_router
        if state.global_step % self.verdict_every == 0:
            self.refresh_verdict()

    def refresh_verdict(self) -> Verdict:
        verdict = diagnose(self.rows, self.max_staleness, self.max_inflight_tasks, self.doctor)
        verdict.notes = verdict.notes + replica_notes(self.rows)
        self.verdict = verdict
        html = verdict.html()
        if self.autotune_changes:
            html += "<br><b>Autotune:</b> " + "; ".join(self.autotune_changes[-5:])
        if self._verdict_view is not None:
            if self.board.mode == "widgets":
                self._verdict_view.value = html
            else:
                from IPython.display import HTML

                self._verdict_view.update(HTML(html))
        elif self.board.mode == "print":
            print(f"doctor: {verdict.headline}", flush=True)
        return verdict

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> bytes:
        """The final figure (PNG bytes) and verdict; drawn once (training's end closes the board already)."""
        if self._final_png is None:
            self.refresh_verdict()
            self._final_png = self.board.close()
        return self._final_png
