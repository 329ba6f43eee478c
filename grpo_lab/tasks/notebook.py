"""What notebook 03 calls: quick-mode settings, the committed figures, the tweak-and-rerun controls, tables."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from grpo_lab.lab.live_board import LiveBoard, Series
from grpo_lab.lab.outputs import committed_results, output_dir
from grpo_lab.loss.backends import LOSS_BACKENDS
from grpo_lab.tasks.board import BoardCallback
from grpo_lab.tasks.reward_curves import BOARD_SERIES, METRICS, EmbeddedConfig, read_summary, run_reward_curves

QUICK = dict(steps=60, prompts_per_step=16, n_candidates=1200, n_heldout=150, eval_k=8, cpu_threads=1)


def quick(cfg: EmbeddedConfig) -> EmbeddedConfig:
    """CI settings: the same pipeline, fewer steps and prompts, one torch thread (a few minutes on a shared 2-core
    CPU: with 2 threads and other jobs on the box, OpenMP oversubscription made steps ~8x slower, measured), and a
    learning rate of at least QUICK_LR (3e-3: at lower rates 60 steps do not move the reward by the margin the
    notebook's test checks)."""
    return replace(cfg, **QUICK, learning_rate=max(cfg.learning_rate, QUICK_LR))


QUICK_LR = 3e-3


def summary_table(summary: dict):
    import pandas as pd

    return pd.DataFrame.from_dict(summary["backends"], orient="index").rename_axis("backend").round(4)


def parity_table(summary: dict):
    import pandas as pd

    return pd.DataFrame([summary["parity"]]).round(6)


def committed_figures(folder: Path | None = None) -> list[dict]:
    """Every committed `<tag>.png` with its summary JSON, as {tag, png, caption, table}."""
    folder = folder or committed_results("reward_curves")
    out = []
    for png in sorted(folder.glob("*.png")):
        summary = read_summary(png)
        env = summary.get("env", {})
        cap = f"{env.get('device', '?')}, torch {env.get('torch', '?')}, trl {env.get('trl', '?')}, {env.get('date', '')}"
        if summary.get("parity"):
            cap += "; " + ", ".join(f"{k} {'none' if v is None else f'{v:.4g}'}" for k, v in summary["parity"].items())
        unfinished = [b for b in summary.get("config", {}).get("backends", []) if b not in summary.get("backends", {})]
        if unfinished:
            cap += f"; not finished: {', '.join(unfinished)}"
        table = summary_table(summary) if summary.get("backends") else None
        out.append({"tag": png.stem, "png": png.read_bytes(), "caption": cap, "table": table})
    return out


def board_callback(total_steps: int) -> BoardCallback:
    board = LiveBoard("GRPO recipe", total=total_steps, series=BOARD_SERIES, redraw_every_s=2.0,
                      unit="step").show()
    return BoardCallback(board, keys={s.key: METRICS.get(s.key, s.key) for s in BOARD_SERIES})


LR_CHOICES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


def lr_options(lr: float) -> list[tuple[str, float]]:
    """The learning-rate slider's stops: a log grid plus `lr` itself, as (label, exact value). A SelectionSlider
    sends back the chosen stop's index, so the kernel gets exactly `lr` until the user moves it (a FloatLogSlider
    snaps its value to its step grid in the browser: 3e-3 came back as 0.0031622...)."""
    return [(f"{v:g}", v) for v in sorted({*LR_CHOICES, float(lr)})]


def controls(cfg: EmbeddedConfig, out_dir: str | Path | None = None):
    """Sliders for steps / lr / rank / G / backends and a Run button that reruns the embedded default. Every control
    starts at exactly `cfg`'s value; a run writes `interactive.*` to `out_dir` (default: grpo_lab.lab.outputs)."""
    import ipywidgets as w
    from IPython.display import Image, display

    style = {"description_width": "80px"}   # room for "LoRA rank", "backends" (ipywidgets cuts long labels)
    steps = w.IntSlider(value=cfg.steps, min=min(10, cfg.steps), max=max(1000, cfg.steps), step=1,
                        description="steps", style=style)
    lr = w.SelectionSlider(options=lr_options(cfg.learning_rate), value=cfg.learning_rate, description="lr",
                           style=style)
    rank = w.Dropdown(options=sorted({1, 2, 4, 8, 16, cfg.lora_r}), value=cfg.lora_r, description="LoRA rank",
                      style=style)
    g = w.IntSlider(value=cfg.num_generations, min=2, max=max(16, cfg.num_generations), description="G",
                    style=style)
    be = w.SelectMultiple(options=list(LOSS_BACKENDS), value=tuple(cfg.backends), description="backends", style=style)
    button = w.Button(description="Run", button_style="primary")
    out = w.Output()

    def chosen() -> EmbeddedConfig:
        return replace(cfg, steps=steps.value, learning_rate=lr.value, lora_r=rank.value,
                       num_generations=g.value, backends=tuple(be.value))

    def on_click(_):
        with out:
            out.clear_output()
            new = chosen()
            print(f"training: steps {new.steps}, lr {new.learning_rate:g}, LoRA rank {new.lora_r}, "
                  f"G {new.num_generations}, backends {', '.join(new.backends)}")
            s = run_reward_curves(new, output_dir("reward_curves", out_dir), board=True, tag="interactive")
            display(Image(s["png"]))
            display(summary_table(s))

    button.on_click(on_click)
    box = w.VBox([w.HBox([steps, lr, rank]), w.HBox([g, be, button]), out])
    box.chosen = chosen          # what Run would train with (the tests read it)
    return box


__all__ = ["quick", "committed_figures", "controls", "lr_options", "summary_table", "parity_table", "board_callback",
           "Series", "LiveBoard"]
