"""What each notebook must show in a browser, and the one interaction that proves its widgets talk to the kernel.

Every notebook under notebooks/ is picked up by the browser tier; add a row here for a new one (04_async_lora ...):
the figures it shows after Run All (quick mode, and as committed for the classic/Colab check), the controls that
must render, and an interaction (edit controls, press a button, wait, assert that the output changed). A notebook
without a row still gets every generic check (no errors, widgets render, labels whole); its interaction test fails
until it has one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .frontends import NotebookView

WAIT_MS = 420_000       # an interaction's run on a busy 2-core CPU (03 as committed prepares 3000 problems first)
OUTPUT_WIDGET = ".widget-output, .jupyter-widgets-output-area"    # an Output widget in ipywidgets 8 / 7


@dataclass
class Expect:
    figures_quick: int                              # rendered PNGs after Run All with QUICK = True
    figures_committed: int                          # ... as committed (QUICK = False: the committed results)
    controls: dict[str, str] = field(default_factory=dict)   # what must render: name -> CSS selector
    interaction: Callable[[NotebookView, dict], str] | None = None   # returns what it showed (for the report)
    overrides: dict[str, str] = field(default_factory=dict)  # parameters typed in first (name -> source), in both
                                                             # frontends: keeps a long run CI-sized


# --- helpers shared by the interactions (ipywidgets 7.7 and 8.x render these the same way) --------------------------
def _labelled(scope, kind: str, label: str):
    return scope.locator(kind).filter(has=scope.page.locator(".widget-label", has_text=re.compile(f"^{label}$")))


def set_text(scope, label: str, value: str):
    box = _labelled(scope, ".widget-text", label).locator("input")
    box.fill(value)
    box.press("Enter")


def set_readout(scope, label: str, value: str):
    """Type a slider's value into its readout (editable in both ipywidgets 7 and 8), as a user can."""
    readout = _labelled(scope, ".widget-slider", label).locator(".widget-readout")
    readout.click()
    scope.page.keyboard.press("Control+a")
    scope.page.keyboard.type(value)
    scope.page.keyboard.press("Enter")


def click(scope, text: str):
    scope.locator("button.jupyter-button", has_text=text).first.click()


def board_state(cell) -> tuple[str, str]:
    """(status text, src of its plot) of the live board rendered in `cell`."""
    text = cell.locator(".jupyter-widgets").first.inner_text()
    imgs = cell.locator(".jupyter-widgets img")
    return text, (imgs.last.get_attribute("src") if imgs.count() else "")


def wait_form_done(form, button: str, timeout_ms: int = WAIT_MS) -> str:
    """The ParamForm's message (next to its button) goes from "running…" to "done"; an error fails the test."""
    row = form.locator(".widget-hbox").filter(
        has=form.page.locator("button.jupyter-button", has_text=button)).last
    message = row.locator(".widget-html").first
    form.page.wait_for_function("el => el.innerText.trim() !== '' && !el.innerText.includes('running')",
                                arg=message.element_handle(), timeout=timeout_ms)
    text = message.inner_text().strip()
    assert text == "done", f"the form reported: {text}"
    return text


def with_overrides(source: str, overrides: dict[str, str]) -> str:
    """The parameters cell with `NAME = value` lines replaced, as a user edits them."""
    for name, value in overrides.items():
        line = re.compile(rf"^{name}\s*=.*$", re.MULTILINE)
        assert line.search(source), f"no `{name} = ...` line in the parameters cell"
        source = line.sub(f"{name} = {value}", source, count=1)
    return source


# --- the interactions -------------------------------------------------------------------------------------------
def _rerun_form(nb: NotebookView, values: dict, result_name: str) -> str:
    form = nb.cell("ParamForm(")
    board = nb.cell("LiveBoard(")
    before = board_state(board)
    for label, value in values.items():
        set_text(form, label, value)
    click(form, "Run on this machine")
    wait_form_done(form, "Run on this machine")
    after = board_state(board)
    assert result_name in after[0], f"the board did not report the new run: {after[0]!r}"
    assert after != before, "the board did not change"
    assert after[1], "the board shows no plot after the run"
    return after[0]


def memory_rerun_one_point(nb: NotebookView, params: dict) -> str:
    """01: narrow the form to one CPU-sized training-step point and rerun: the board redraws with the new point.
    (Every field is set: as committed, the form holds the H200 sweep.)"""
    return _rerun_form(nb, {"model": "small-qwen3", "backends": "trl", "dtypes": "fp32", "batch sizes": "2",
                            "loss batch sizes": "2", "prompt len": "32", "completion len": "64", "modes": "step"},
                       "memory_vs_batch_here.csv")


def max_batch_rerun_one_backend(nb: NotebookView, params: dict) -> str:
    """02: one small model x one backend search under a 0.5 GiB CPU budget: the board shows its bar."""
    return _rerun_form(nb, {"models": "small-qwen3", "backends": "trl", "dtype": "fp32", "prompt len": "8",
                            "completion len": "24", "lora r": "8", "budget gib": "0.5", "start": "4", "upper": "32",
                            "rel tol": "0.25"}, "fsdp_max_batch_here.csv")


def async_loop_rerun_autotuned(nb: NotebookView, params: dict) -> str:
    """04: a 4-step rerun of the loop from the form with the autotune box ticked (CPU replicas + router + trainer
    start and stop again; with 2 steps the doctor can say "not enough steps logged yet", which the form shows as an
    error). Under the form: the run's live board, the doctor's verdict and the controller's decisions (TRL's default
    of 64 in flight is above the pipeline budget, so there is always at least the step-0 clamp) with its figure."""
    form = nb.cell("nb04.controls(")
    set_text(form, "steps", "4")
    box = form.locator(".widget-checkbox").filter(has_text="autotune").locator("input[type=checkbox]")
    box.check()
    click(form, "Run the loop")
    wait_form_done(form, "Run the loop")
    out = form.locator(OUTPUT_WIDGET).first   # the form's own area (the board's plot and table areas are inside it)
    text = out.inner_text()
    changes = re.search(r"run \d+: (\d+) autotune changes", text)
    assert changes and int(changes.group(1)) >= 1, f"no autotune decisions under the form: {text[-800:]!r}"
    assert "budget" in out.locator("table").last.inner_text(), "the decisions table lacks the step-0 clamp"
    out.locator("img").nth(1).wait_for(timeout=WAIT_MS)   # the board's figure and the knobs' figure
    return text


def reward_curves_run_ten_steps(nb: NotebookView, params: dict) -> str:
    """03: 10 steps of one backend from the Tweak-and-rerun controls; the run must use the parameters cell's lr
    (untouched controls start at exactly the parameters' values) and plot its curves."""
    controls = nb.cell("nb03.controls(")
    set_readout(controls, "steps", "10")
    controls.locator(".widget-select-multiple select").select_option("trl")
    click(controls, "Run")
    line = controls.locator(OUTPUT_WIDGET).first
    line.get_by_text(re.compile(r"^training: ")).wait_for(timeout=WAIT_MS)
    text = line.inner_text()
    lr = f"{float(params['LR']):g}"
    assert f"training: steps 10, lr {lr}, LoRA rank {params['RANK']}, G {params['G']}, backends trl" in text, text
    line.locator("img").last.wait_for(timeout=WAIT_MS)
    nb.page.wait_for_function("el => el.innerText.includes('reward_end')", arg=line.element_handle(),
                              timeout=WAIT_MS)
    return line.inner_text()


RUN_ROW = re.compile(r"^(\S+)\s+(queued|running|finished|stopped|failed)\s+(\d+)/(\d+)", re.MULTILINE)


def sweep_runs(cell) -> dict[str, tuple[str, int]]:
    """Each run's (status, step) from the sweep panel's runs table in `cell`."""
    return {m[1]: (m[2], int(m[3])) for m in RUN_ROW.finditer(cell.inner_text())}


def wait_until(page, what: str, condition, timeout_ms: int = WAIT_MS):
    """Poll `condition()` every half second until it is true; fails naming `what`."""
    for _ in range(timeout_ms // 500):
        if condition():
            return
        page.wait_for_timeout(500)
    raise AssertionError(f"timed out waiting for {what}")


def sweep_launch_then_stop_one(nb: NotebookView, params: dict) -> str:
    """05: launch 3 runs x 6 steps from the form (it returns at once: the panel redraws from a thread); once the
    live figure changed and a run logged a step, add a run from the panel (it waits: 3 train at once) and stop it
    while queued, then stop a running one, all while the others train; the others finish (the runs table says
    finished, the two stopped ones stopped) and the ranked table appears."""
    cell = nb.cell("nb05.controls(")
    plot = cell.locator(OUTPUT_WIDGET).first
    src = lambda: plot.locator("img").last.get_attribute("src") if plot.locator("img").count() else ""
    before = src()
    set_text(cell, "learning rate", "1e-3,3e-3,1e-2")
    set_text(cell, "max steps", "6")
    click(cell, "Launch the sweep")
    wait_form_done(cell, "Launch the sweep", timeout_ms=120_000)
    wait_until(nb.page, "the live figure to change and a run to log a step", lambda: src() != before and any(
        status == "running" and step >= 1 for status, step in sweep_runs(cell).values()))

    def stop(name: str):
        _labelled(cell, ".widget-dropdown", "run").locator("select").select_option(name)
        click(cell, "Stop run")

    set_text(cell, "add run", "learning_rate=2e-2")
    click(cell, "Add run")
    wait_until(nb.page, "the added run in the runs table", lambda: "lr2e-2" in sweep_runs(cell))
    assert "added lr2e-2" in cell.inner_text() and sweep_runs(cell)["lr2e-2"][0] == "queued", sweep_runs(cell)
    stop("lr2e-2")
    wait_until(nb.page, "the added run to stop", lambda: sweep_runs(cell).get("lr2e-2", ("",))[0] == "stopped")
    victim = next(name for name, (status, _) in sweep_runs(cell).items() if status == "running")
    stop(victim)
    wait_until(nb.page, "the sweep to end", lambda: re.search(r"done: \d+ ", cell.inner_text()) is not None)
    runs = sweep_runs(cell)
    assert runs[victim][0] == "stopped" and runs["lr2e-2"] == ("stopped", 0), runs
    others = {name: status for name, (status, _) in runs.items() if name not in (victim, "lr2e-2")}
    assert len(others) == 2 and set(others.values()) == {"finished"}, runs
    assert "ranked by final reward" in cell.inner_text()
    return cell.inner_text()


EXPECT: dict[str, Expect] = {
    "01_memory_vs_batch": Expect(
        figures_quick=3, figures_committed=2,
        controls={"progress bar": ".widget-hprogress", "form text boxes": ".widget-text input",
                  "Run button": "button.jupyter-button:has-text('Run on this machine')"},
        interaction=memory_rerun_one_point),
    "02_fsdp_max_batch": Expect(
        figures_quick=3, figures_committed=2,   # the board's / search's figures, and the planner panel's
        controls={"progress bar": ".widget-hprogress", "form text boxes": ".widget-text input",
                  "Run button": "button.jupyter-button:has-text('Run on this machine')",
                  "planner dropdowns": ".widget-dropdown select"},
        interaction=max_batch_rerun_one_backend),
    "03_sanity_reward_curves": Expect(
        figures_quick=5, figures_committed=3,
        controls={"sliders": ".widget-slider", "backends list": ".widget-select-multiple select",
                  "rank dropdown": ".widget-dropdown select", "Run button": "button.jupyter-button:has-text('Run')"},
        interaction=reward_curves_run_ten_steps),
    "04_async_lora": Expect(
        figures_quick=1, figures_committed=1,
        controls={"form text boxes": ".widget-text input", "autotune box": ".widget-checkbox input",
                  "Run button": "button.jupyter-button:has-text('Run the loop')"},
        interaction=async_loop_rerun_autotuned,
        overrides={"STEPS": "3", "FOLLOW_DOCTOR": "False"}),
    "05_sweep": Expect(
        figures_quick=2, figures_committed=2,   # the live panel's figure and the ranked runs' figure
        controls={"form text boxes": ".widget-text input", "pool and run dropdowns": ".widget-dropdown select",
                  "Launch button": "button.jupyter-button:has-text('Launch the sweep')",
                  "Stop button": "button.jupyter-button:has-text('Stop run')",
                  "Add button": "button.jupyter-button:has-text('Add run')"},
        interaction=sweep_launch_then_stop_one,
        # Run All's own sweep kept CI-sized: one run x 3 steps on 2 CPU replicas (the interaction launches 3)
        overrides={"MAX_STEPS": "3", "GRID": '{"learning_rate": "3e-3"}'}),
}
DEFAULT = Expect(figures_quick=1, figures_committed=0)


def expect(name: str) -> Expect:
    return EXPECT.get(name, DEFAULT)
