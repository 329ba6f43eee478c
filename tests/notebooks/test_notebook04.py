"""Notebook 04 in the shared `grpo-lab reproduce --quick` run: the whole loop ran headless, the board updated live,
the doctor gave a verdict, the doctor's knob was turned in a second run, and each run's CSV and verdict landed in
outputs/async. (The committed notebook's form is checked in tests/async_loop/test_notebook04.py.)"""

import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from notebook_parameters import parameters_of

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "04_async_lora.ipynb"
BOUNDS = {"rollout", "train", "staleness", "balanced"}


def widget_states(nb) -> list[dict]:
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    return [{"model": v["model_name"], **v["state"]} for v in state.values()]


@pytest.mark.slow
def test_notebook04_quick_mode(reproduced):
    # the committed parameters cell is what the quick run used (reproduce sets only QUICK)
    params = parameters_of(nbformat.read(NOTEBOOK, as_version=4).cells[0].source)
    steps, follow = params["STEPS"], params["FOLLOW_STEPS"]
    nb = reproduced.executed_notebook("04_async_lora.ipynb")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert [o for o in outputs if "image/png" in o.get("data", {})], "no figure"

    # the live board: its progress bars reached the end of each run, its status line carries the loop's numbers,
    # and the doctor's verdict was written into the widget below it
    states = widget_states(nb)
    bars = [s for s in states if s["model"] == "IntProgressModel" and s.get("description") == "step"]
    assert sorted((b["value"], b["max"]) for b in bars)[-2:] in (sorted([(follow, follow), (steps, steps)]),
                                                                 [(steps, steps), (steps, steps)])
    status = [s["value"] for s in states if s["model"] == "HTMLModel" and "rollout wait" in s.get("value", "")]
    assert status and all("staleness" in v and "IS ratio" in v for v in status)
    verdicts = [s["value"] for s in states if s["model"] == "HTMLModel" and s.get("value", "").startswith(
        "<b>Doctor:")]
    assert verdicts and not any("waiting for steps" in v for v in verdicts)

    out = reproduced.outputs("async")
    first = pd.read_csv(out / "baseline.csv")
    assert sorted(first[first.metric == "reward"].step) == list(range(1, steps + 1))
    assert {"torch", "trl", "gpu_name", "date"} <= set(first.columns)  # machine and versions in every row
    ratio = first[first.metric == "ratio"].value
    assert ratio.between(0.9, 1.1).all()
    verdict = json.loads((out / "baseline_verdict.json").read_text())
    assert verdict["bound"] in BOUNDS and verdict["evidence"]["step_s"] > 0
    if verdict["bound"] in ("staleness", "rollout"):  # the doctor's knob was turned in a second run
        second = json.loads((out / "doctors_knob_verdict.json").read_text())
        if verdict["bound"] == "staleness":
            assert second["evidence"]["stale_frac"] < verdict["evidence"]["stale_frac"]
