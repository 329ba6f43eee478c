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
