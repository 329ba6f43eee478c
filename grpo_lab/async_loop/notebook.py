"""What notebook 04 computes, kept in the package so the tests check it: runs, the doctor's follow-up, figures,
the recipe's commands and the committed H200 results."""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

from ..lab.outputs import committed_results as committed_folder
from ..serving.adapters.slots import DEFAULT_MAX_STALENESS
from .board import LoopBoard
from .doctor import DoctorConfig, Verdict, training_rows
from .loop_settings import REPLICA_KINDS, TRACKERS, LoopSettings


@dataclass
class QuickSettings:
    """The knobs of a quick run (the embedded task on CPU replicas). Every field is a notebook control; each is a
    `LoopSettings` field (`steps` is `max_steps`, `report_to` one tracker), whose default, rule and meaning it takes
    (`loop_settings()`)."""

    steps: int = LoopSettings.max_steps
    replicas: int = LoopSettings.replicas
    prompts_per_step: int = LoopSettings.prompts_per_step
    num_generations: int = LoopSettings.num_generations
    learning_rate: float = LoopSettings.learning_rate
    max_staleness: int = LoopSettings.max_staleness
    max_inflight_tasks: int = LoopSettings.max_inflight_tasks
    queue_maxsize: int = LoopSettings.queue_maxsize
    seed: int = LoopSettings.seed
    replica_kind: str = LoopSettings.replica_kind
    autotune: bool = LoopSettings.autotune
    report_to: str = TRACKERS[0]

    def doctor_config(self) -> DoctorConfig:
        """The doctor's thresholds for these replicas (the CPU replica serves one request at a time)."""
        return DoctorConfig.for_replicas(self.replica_kind)

    def loop_settings(self, **fixed) -> LoopSettings:
        """These knobs as the loop's settings (their rules checked there: ValueError naming the field), with `fixed`
        (`output_dir`, `run_name`, `loss_backend`) on top."""
        same = {name: value for name, value in asdict(self).items() if name not in ("steps", "report_to")}
        return LoopSettings(max_steps=self.steps, report_to=[self.report_to], **same, **fixed)

    def validate(self) -> "QuickSettings":
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2 for a quick run (the board compares steps), got {self.steps}")
        self.loop_settings()
        return self


@dataclass
class LoopRun:
    """One finished run: its settings, logged rows, verdict, board figure and wall time."""

    name: str
    settings: QuickSettings
    rows: list[dict]
    verdict: Verdict
    png: bytes
    seconds: float
    output_dir: str
    published: list[dict] = field(default_factory=list)


def run_quick(settings: QuickSettings, output_dir: str | None = None, name: str = LoopSettings.run_name,
              board: str = "auto", loss_backend: str = LoopSettings.loss_backend) -> LoopRun:
    """Start 2 CPU replicas + router + trainer on the embedded task, train with the live board, tear down."""
    from .launch import AsyncLoop, LoopConfig, embedded_trainer_args

    s = settings.validate()
    output_dir = output_dir or tempfile.mkdtemp(prefix=f"grpo-lab-async-{name}-")
    loop_settings = s.loop_settings(output_dir=output_dir, run_name=name, loss_backend=loss_backend)
    args = embedded_trainer_args(output_dir, settings=loop_settings, save_strategy="no")
    live = LoopBoard(s.steps, s.max_staleness, loop_settings.inflight, mode=board, title=f"async loop: {name}",
                     doctor=s.doctor_config())
    t0 = time.perf_counter()
    with AsyncLoop(LoopConfig.from_settings(loop_settings), args, callbacks=[live], progress=False) as loop:
        loop.train()
        published = list(loop.trainer.published)
    seconds = time.perf_counter() - t0
    png = live.close()
    return LoopRun(name, s, loop.recorder.rows, live.verdict, png, seconds, output_dir, published)


def autotune_table(run: LoopRun):
    """The controller's decisions over a run: one row per change, with the evidence it acted on."""
    import pandas as pd

    records = [{"step": d["step"], "knob": d["knob"], "from": d["old"], "to": d["new"], "regime": d["regime"],
                "why": d["reason"], **d["evidence"]} for r in run.rows for d in r.get("autotune", [])]
    return pd.DataFrame.from_records(records)


def show_autotune(run: LoopRun) -> None:
    """Display an autotuned run's decisions (a table with their evidence) and its knobs over the steps; nothing for
    a run without autotune."""
    if not run.settings.autotune:
        return
    from IPython.display import Image, Markdown, display

    decisions = autotune_table(run)
    display(Markdown(f"**{run.name}**: {len(decisions)} autotune changes"))
    if len(decisions):
        display(decisions)
    display(Image(autotune_png(run)))


def autotune_png(run: LoopRun, dpi: int = 90) -> bytes:
    """Requests in flight and the queue bound at every step of an autotuned run, each change marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..lab.live_board import fig_to_png

    steps = [r for r in training_rows(run.rows) if "autotune/inflight" in r]
    fig, ax = plt.subplots(figsize=(7, 3))
    x = [r["step"] for r in steps]
    ax.step(x, [r["autotune/inflight"] for r in steps], where="post", label="requests in flight")
    ax.step(x, [r["autotune/queue_bound"] for r in steps], where="post", label="queue bound")
    for r in steps:
        for d in r.get("autotune", []):
            ax.annotate(d["regime"], (r["step"], d["new"]), fontsize=7, textcoords="offset points", xytext=(2, 4))
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_title(f"autotune: {run.name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = fig_to_png(fig, dpi)
    plt.close(fig)
    return png


def follow_doctor(run: LoopRun) -> tuple[QuickSettings, str]:
    """The settings of the next run with the verdict's first knob turned (what the recipe's author did by hand), and
    a sentence saying what changed (or why nothing did)."""
    s, v, loop = run.settings, run.verdict, run.settings.loop_settings()
    if v.bound == "staleness" and not (v.knobs and "replicas" in v.knobs[0]):
        return (replace(s, max_inflight_tasks=loop.samples_per_step, queue_maxsize=loop.samples_per_step),
                f"max_inflight_tasks and queue_maxsize -> {loop.samples_per_step} (one step's worth)")
    if v.bound == "rollout" and "max_inflight_tasks" in v.knobs[0]:
        return replace(s, max_inflight_tasks=2 * loop.inflight), f"max_inflight_tasks -> {2 * loop.inflight}"
    if v.bound in ("staleness", "rollout"):  # the first knob is more replicas
        return replace(s, replicas=s.replicas + 1), f"replicas {s.replicas} -> {s.replicas + 1}"
    return s, f"nothing to turn for a {v.bound} loop on the embedded task (the knobs are: {'; '.join(v.knobs)})"


def summary(runs: list[LoopRun]):
    """One row per run: the numbers the doctor reads, plus reward and throughput."""
    import pandas as pd

    out = []
    for r in runs:
        steps = training_rows(r.rows)
        last = steps[-5:]
        mean = lambda k, rows=steps: sum(x.get(k, 0.0) or 0.0 for x in rows) / max(len(rows), 1)  # noqa: E731
        out.append({"run": r.name, "verdict": r.verdict.bound, "steps": len(steps), "wall_s": round(r.seconds, 1),
                    "step_s": round(r.verdict.evidence.get("step_s", float("nan")), 2),
                    "rollout_wait_frac": round(r.verdict.evidence.get("rollout_wait_frac", float("nan")), 3),
                    "staleness": round(mean("sample/staleness_mean"), 2),
                    "wasted_frac": round(r.verdict.evidence.get("stale_frac", float("nan")), 3),
                    "ratio": round(mean("ratio"), 4), "reward_first5": round(mean("reward", steps[:5]), 3),
                    "reward_last5": round(mean("reward", last), 3)})
    return pd.DataFrame(out)


def curves_png(runs: list[LoopRun], dpi: int = 90) -> bytes:
    """Reward (rolling mean), staleness, IS ratio and step time of each run, side by side."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from ..lab.live_board import fig_to_png, rolling_mean

    panels = (("reward", "reward (rolling 5)"), ("sample/staleness_mean", "staleness (versions)"),
              ("ratio", "IS ratio"), ("perf/step_s", "step time (s)"))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    for ax, (key, title) in zip(axes, panels):
        for r in runs:
            pts = [(x["step"], x[key]) for x in training_rows(r.rows) if isinstance(x.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, rolling_mean(ys, 5) if key == "reward" else ys, label=r.name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    png = fig_to_png(fig, dpi)
    plt.close(fig)
    return png


def verdict_markdown(run: LoopRun) -> str:
    v = run.verdict
    lines = [f"**{run.name}: {v.headline}**", ""]
    lines += [f"{i}. {k}" for i, k in enumerate(v.knobs, 1)]
    lines += [f"- {n}" for n in v.notes]
    return "\n".join(lines)


def recipe_commands(replicas: int = LoopSettings.replicas, max_staleness: int = DEFAULT_MAX_STALENESS,
                    lora_rank: int = LoopSettings.lora_rank) -> str:
    """The commands of the Sanity recipe on GPUs: one `vllm serve` per GPU, the router, then the trainer."""
    from ..serving.replicas.vllm_launcher import router_command
    from ..serving.replicas.vllm_spec import replica_specs

    specs = replica_specs("Qwen/Qwen2.5-Math-1.5B", replicas, lora_rank=lora_rank, max_staleness=max_staleness,
                          max_model_len=4096)
    lines = [s.shell_line() + " &" for s in specs]
    lines.append(router_command(specs) + " &")
    lines.append("# then, in Python: grpo_lab.async_loop.recipe.sanity_loop(router_url='http://127.0.0.1:8000')")
    return "\n".join(lines)


def committed_results(folder: str = "async"):
    """The committed results/async CSVs (installed as `grpo_lab.reference_results`), as {name: DataFrame}."""
    import pandas as pd

    return {p.stem: pd.read_csv(p) for p in committed_folder(folder).glob("*.csv")}


def committed_figure(name: str, folder: str = "async") -> bytes | None:
    """A committed benchmark figure (e.g. results/async/autotune.png, shared_pool.png), or None when it is not
    there."""
    figure = committed_folder(folder) / name
    return figure.read_bytes() if figure.is_file() else None


def committed_loop_runs(folder: str = "async"):
    """One row per committed loop run (a long-format CSV with its `_verdict.json`): the doctor's verdict and first
    knob beside the numbers it read, sorted by run name."""
    import json

    import pandas as pd

    root, out = committed_folder(folder), []
    for verdict_file in root.glob("*_verdict.json"):  # none when the folder is not there
        run = verdict_file.name[: -len("_verdict.json")]
        csv = root / f"{run}.csv"
        if not csv.is_file():
            continue
        verdict = json.loads(verdict_file.read_text())
        frame = pd.read_csv(csv)
        wide = frame.pivot_table(index="step", columns="metric", values="value")
        col = lambda name: wide[name] if name in wide else pd.Series(dtype=float)  # noqa: E731
        out.append({"run": run, "date": frame["date"].iloc[0] if "date" in frame else "",
                    "verdict": verdict["bound"], "first knob": (verdict["knobs"] or ["-"])[0],
                    "wall_s": frame["wall_s"].iloc[0] if "wall_s" in frame else float("nan"),
                    "median step_s": round(col("perf/step_s").median(), 2),
                    "rollout wait": f"{100 * verdict['evidence'].get('rollout_wait_frac', float('nan')):.0f}%",
                    "staleness": round(col("sample/staleness_mean").mean(), 2),
                    "completions/s": round(col("completions_per_s").median(), 1),
                    "reward first5 -> last5": f"{col('reward').head(5).mean():.2f} -> {col('reward').tail(5).mean():.2f}"})
    return pd.DataFrame(out).sort_values("run").reset_index(drop=True) if out else pd.DataFrame()


def controls(settings: QuickSettings, on_run):
    """A form with one control per `QuickSettings` field, starting at exactly the current values, and a Run button."""
    from ..lab.widgets import ParamForm

    return ParamForm(asdict(settings), on_run=on_run, button="Run the loop", output=True,
                     choices={"replica_kind": REPLICA_KINDS, "report_to": TRACKERS})
