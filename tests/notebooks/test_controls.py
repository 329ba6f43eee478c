"""Controls start at exactly the parameters cell's values (notebook 03's lr came back as 0.0031622... from a log
slider), and the forms are sized so that no label or value is cut."""

import ast
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest

from grpo_lab.lab import widgets
from grpo_lab.tasks import notebook as nb03
from grpo_lab.tasks.reward_curves import EmbeddedConfig

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def parameters(name: str) -> dict:
    cell = nbformat.read(NOTEBOOKS / name, as_version=4).cells[0]
    return {n.targets[0].id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body
            if isinstance(n, ast.Assign)}


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def _by_description(box):
    return {w.description: w for w in _walk(box) if getattr(w, "description", "")}


@pytest.mark.parametrize("quick", [False, True])
def test_notebook03_controls_start_at_the_parameters(quick):
    p = parameters("03_sanity_reward_curves.ipynb")
    cfg = EmbeddedConfig(steps=p["STEPS"], learning_rate=p["LR"], lora_r=p["RANK"], num_generations=p["G"],
                         prompts_per_step=p["PROMPTS_PER_STEP"], seed=p["SEED"], backends=("trl", "grpo_lab"))
    if quick:
        cfg = nb03.quick(cfg)
    box = nb03.controls(cfg)
    c = _by_description(box)
    assert c["lr"].value == cfg.learning_rate and c["lr"].label == f"{cfg.learning_rate:g}"
    assert c["steps"].value == cfg.steps and c["LoRA rank"].value == cfg.lora_r and c["G"].value == cfg.num_generations
    assert c["backends"].value == ("trl", "grpo_lab")
    assert box.chosen() == cfg          # an untouched Run trains exactly what the parameters cell says


@pytest.mark.parametrize("lr", [3e-3, 2.5e-4, 1e-3, 4e-5, 0.0123])
def test_lr_slider_holds_any_value_exactly(lr):
    box = nb03.controls(replace(EmbeddedConfig(), learning_rate=lr))
    slider = _by_description(box)["lr"]
    assert slider.value == lr and slider.index == [v for _, v in nb03.lr_options(lr)].index(lr)
    values = [v for _, v in nb03.lr_options(lr)]
    assert values == sorted(values) and min(values) <= 1e-5 and max(values) >= 1e-1


def test_param_form_labels_and_values_fit(monkeypatch):
    monkeypatch.setattr(widgets, "_ipython_display", lambda: (lambda *a, **k: None))
    models = "Qwen3-0.6B,Qwen3-1.7B,Qwen3-4B,Qwen3-8B"
    form = widgets.ParamForm({"models": models, "loss_batch_sizes": [4, 16, 64], "completion_len": 512,
                              "rel_tol": 0.03}, on_run=lambda v: None)
    widths = {c.style.description_width for c in form.controls.values()}
    assert len(widths) == 1                                   # one aligned column of labels
    label_px = int(widths.pop().removesuffix("px"))
    assert label_px >= widgets.CHAR_PX * len("loss batch sizes")
    text_px = int(form.controls["models"].layout.width.removesuffix("px")) - label_px
    assert text_px >= widgets.CHAR_PX * len(models)
    assert form.button.layout.width == "auto"                 # "Run on this machine" whole
    assert form.values()["rel_tol"] == 0.03 and form.values()["loss_batch_sizes"] == "4,16,64"


def test_memory_plot_labels_batch_sizes_as_plain_numbers():
    """The batch axis is labelled with the measured sizes (no mathtext 2^k labels, which failed to parse in a
    JupyterLab kernel after a rerun from the form), and a dtype without points gets a note, not an empty log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from grpo_lab.memory.plots import plot_memory_vs_batch

    root = Path(__file__).resolve().parents[2]
    df = pd.read_csv(root / "results" / "memory_vs_batch" / "memory_vs_batch.csv")
    fp32 = df[(df["dtype"] == "fp32") & (df["mode"] == "step")]
    fig = plot_memory_vs_batch(fp32, mode="step")
    fig.canvas.draw()
    left, right = fig.axes[0], fig.axes[1]
    assert [t.get_text() for t in left.get_xticklabels()] == [str(b) for b in sorted(set(fp32["batch_size"]))]
    assert not any("$" in t.get_text() for ax in fig.axes for t in ax.get_xticklabels(which="both"))
    assert right.get_xscale() == "linear" and "no bf16 points" in [t.get_text() for t in right.texts]
