"""Parameter forms: one control per parameter, bad input shown in the form."""

from grpo_lab.lab import widgets


def test_param_form_shows_bad_input_as_a_message(monkeypatch):
    monkeypatch.setattr(widgets, "_ipython_display", lambda: (lambda *a, **k: None))
    seen = {}

    def on_run(values):
        seen.update(values)
        raise ValueError("batch sizes must be positive integers, got 'x'.")

    form = widgets.ParamForm({"model": "tiny-qwen3", "batch_sizes": [2, 4], "quick": True, "prompt_len": 8},
                             on_run=on_run)
    assert set(form.controls) == {"model", "batch_sizes", "quick", "prompt_len"}
    form.controls["batch_sizes"].value = "2,x"
    form._clicked(None)
    assert seen["batch_sizes"] == "2,x" and seen["quick"] is True and seen["prompt_len"] == 8
    assert "positive integers" in form.message.value


def test_param_form_with_output_runs_the_callback_inside_its_output_area(monkeypatch):
    """A button's callback runs outside any cell: without the form's Output area, what it displays is lost to
    JupyterLab's log console."""
    monkeypatch.setattr(widgets, "_ipython_display", lambda: (lambda *a, **k: None))
    calls = []
    form = widgets.ParamForm({"steps": 4, "autotune": False}, on_run=lambda values: calls.append(("run", values)),
                             output=True)
    assert form.output is not None and form.output in form.box.children
    assert type(form.controls["autotune"]).__name__ == "Checkbox"
    area = type(form.output)
    monkeypatch.setattr(area, "__enter__", lambda self: calls.append("enter") or self)
    monkeypatch.setattr(area, "__exit__", lambda self, *exc: calls.append("exit") or False)
    monkeypatch.setattr(area, "clear_output", lambda self, *a, **k: calls.append("clear"))
    form.controls["autotune"].value = True
    form._clicked(None)
    assert calls == ["clear", "enter", ("run", {"steps": 4, "autotune": True}), "exit"]
    assert form.message.value == "done"
    assert widgets.ParamForm({"steps": 4}, on_run=lambda v: None).output is None
