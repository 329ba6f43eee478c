"""The sweep: one CSV row per point, machine/version columns, OOM skipping, the CLI's messages."""

import pandas as pd

from grpo_lab.memory import sweep
from grpo_lab.memory.results import COLUMNS, savings_table


def test_sweep_cli_writes_one_row_per_point(tmp_path):
    rc = sweep.main(["--model", "tiny-qwen3", "--backends", "trl,naive", "--dtypes", "fp32", "--batch-sizes", "2,4",
                     "--loss-batch-sizes", "2", "--prompt-len", "8", "--completion-len", "8", "--device", "cpu",
                     "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    df = pd.read_csv(tmp_path / "t.csv")
    assert list(df.columns) == COLUMNS
    assert len(df) == 2 * 2 + 2 * 1
    assert (df["status"] == "ok").all()
    assert (df["peak_gib"] > 0).all() and (df["peak_gib"] < 8).all()
    assert df["torch"].notna().all() and df["trl"].notna().all() and df["date"].notna().all()
    assert (tmp_path / "t.png").is_file() and (tmp_path / "t_loss_only.png").is_file()


def test_larger_batches_after_oom_are_recorded_not_run(monkeypatch):
    calls = []

    def fake_run_point(spec):
        calls.append(spec.batch_size)
        if spec.batch_size >= 8:
            return {"status": "oom", "message": "CUDA out of memory", "wall_s": 0.0}
        return {"status": "ok", "peak_bytes": spec.batch_size * 2**30, "base_bytes": 0, "memory_kind": "cuda_allocated",
                "wall_s": 0.0}

    monkeypatch.setattr(sweep, "run_point", fake_run_point)
    specs = sweep.build_specs(model="tiny-qwen3", backends="naive", batch_sizes="2,4,8,16,32")
    df = sweep.run_sweep(specs)
    assert calls == [2, 4, 8]
    assert list(df["status"]) == ["ok", "ok", "oom", "oom", "oom"]
    assert df["message"].iloc[-1].startswith("not run")


def test_savings_table():
    df = pd.DataFrame({"mode": "step", "dtype": "bf16", "batch_size": [4, 4], "backend": ["naive", "trl"],
                       "status": "ok", "peak_gib": [10.0, 6.0]})
    t = savings_table(df, "naive")
    assert t["trl vs naive %"].iloc[0] == 40.0


def test_bad_input_is_one_line_not_a_traceback(capsys):
    assert sweep.main(["--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown model 'nope'") and "Traceback" not in err
    assert sweep.main(["--batch-sizes", "4,0"]) == 2
    assert "positive integer" in capsys.readouterr().err


def test_full_command_runs_on_cpu_in_a_tiny_setting(tmp_path):
    """`--full` as the integrator runs it (4 backends, fp32 + bf16, step + loss), shrunk to a tiny model on CPU."""
    rc = sweep.main(["--full", "--model", "tiny-qwen3", "--batch-sizes", "2", "--loss-batch-sizes", "2",
                     "--prompt-len", "8", "--completion-len", "8", "--device", "cpu", "--out", str(tmp_path),
                     "--keep-going"])
    df = pd.read_csv(tmp_path / "memory_vs_batch.csv")
    assert rc == 0, df[["backend", "status", "message"]]
    full = sweep.PRESETS["full"]
    assert len(df) == len(full["backends"]) * len(full["dtypes"]) * 2
    assert set(df["backend"]) == set(full["backends"]) and (df["status"] == "ok").all()
    # a split run: --append keeps the other rows
    rc = sweep.main(["--full", "--model", "tiny-qwen3", "--backends", "trl", "--dtypes", "fp32", "--batch-sizes", "4",
                     "--modes", "step", "--prompt-len", "8", "--completion-len", "8", "--device", "cpu",
                     "--out", str(tmp_path), "--append"])
    assert rc == 0
    assert len(pd.read_csv(tmp_path / "memory_vs_batch.csv")) == len(df) + 1


def test_replot_from_a_csv(tmp_path):
    rc = sweep.main(["--model", "tiny-qwen3", "--batch-sizes", "2", "--modes", "loss", "--loss-batch-sizes", "2",
                     "--completion-len", "8", "--device", "cpu", "--out", str(tmp_path), "--name", "r"])
    assert rc == 0
    (tmp_path / "r_loss_only.png").unlink()
    assert sweep.main(["--replot", str(tmp_path / "r.csv")]) == 0
    assert (tmp_path / "r_loss_only.png").is_file()
    assert sweep.main(["--replot", str(tmp_path / "missing.csv")]) == 2


def test_memory_closing_note_on_the_committed_h200_sweep():
    """The note reads the committed CSV: savings where naive ran, naive's OOM point, and what was not measured."""
    from grpo_lab.memory import notebook as nb

    df = nb.reference_memory_vs_batch()
    note = nb.closing_note_memory(df)
    step = df[df["mode"] == "step"]
    for dtype in ("bf16", "fp32"):
        naive = step[(step["backend"] == "naive") & (step["dtype"] == dtype)]
        first_oom = int(naive[naive["status"] == "oom"]["batch_size"].min())
        assert f"{dtype}: `naive` is out of memory from B={first_oom}" in note
        assert f"| {dtype} | {first_oom} |" not in note  # no empty row where naive did not run
        for b in naive[naive["status"] == "ok"]["batch_size"]:
            assert f"| {dtype} | {b} |" in note
    for _, r in df[df["status"] == "skipped"].iterrows():
        assert f"{r['mode']} {r['dtype']} {r['backend']} B={r['batch_size']} (skipped)" in note


def test_resume_measures_only_what_a_cut_sweep_left(tmp_path, monkeypatch, fake_clock):
    """A sweep stopped by its time limit, rerun with resume: the points already ok/oom are not measured again, an
    OOM already recorded still stops its series, and the CSV ends with one row per point."""
    calls = []

    def fake_run_point(spec):
        calls.append((spec.loss_backend, spec.batch_size))
        fake_clock.advance(10.0)
        if spec.loss_backend == "naive" and spec.batch_size >= 8:
            return {"status": "oom", "message": "CUDA out of memory", "wall_s": 10.0}
        return {"status": "ok", "peak_bytes": spec.batch_size * 2**30, "base_bytes": 0,
                "memory_kind": "cuda_allocated", "wall_s": 10.0}

    monkeypatch.setattr(sweep, "run_point", fake_run_point)
    monkeypatch.setattr(sweep, "time", fake_clock)
    specs = sweep.build_specs(model="tiny-qwen3", backends="naive,trl", batch_sizes="2,4,8,16", modes="step",
                              dtypes="fp32")
    csv = tmp_path / "m.csv"
    df = sweep.run_sweep(specs, out_csv=csv, max_seconds=25.0)
    assert calls == [("naive", 2), ("naive", 4), ("naive", 8)]
    assert list(df["status"]) == ["ok", "ok", "oom", "oom", "skipped", "skipped", "skipped", "skipped"]
    calls.clear()
    df = sweep.run_sweep(specs, out_csv=csv, resume=True)
    assert calls == [("trl", 2), ("trl", 4), ("trl", 8), ("trl", 16)]
    df = pd.read_csv(csv)
    assert len(df) == 8 and not df.duplicated(["backend", "batch_size"]).any()
    # loss-alone points are recorded with prompt_len 0: a resume finds them too
    loss = sweep.build_specs(model="tiny-qwen3", backends="trl", loss_batch_sizes="2,4", modes="loss", dtypes="fp32")
    sweep.run_sweep(loss, out_csv=csv, resume=True)
    calls.clear()
    sweep.run_sweep(loss, out_csv=csv, resume=True)
    assert calls == []
    step = df[df["mode"] == "step"]
    assert (step[step["backend"] == "trl"]["status"] == "ok").all()
    assert list(step[step["backend"] == "naive"]["status"]) == ["ok", "ok", "oom", "oom"]


def test_an_existing_csv_is_not_replaced_unasked(tmp_path, capsys):
    (tmp_path / "memory_vs_batch_quick.csv").write_text("committed,results\n")
    rc = sweep.main(["--model", "tiny-qwen3", "--backends", "trl", "--dtypes", "fp32", "--batch-sizes", "2",
                     "--modes", "loss", "--out", str(tmp_path)])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "memory_vs_batch_quick.csv").read_text() == "committed,results\n"
    (tmp_path / "afile").write_text("")
    assert sweep.main(["--out", str(tmp_path / "afile")]) == 2 and "is a file" in capsys.readouterr().err


def test_inputs_of_the_wrong_kind_are_clear_errors():
    import numpy as np
    import pytest

    for kwargs, match in ((dict(model=None), "model must be a name"), (dict(batch_sizes=None), "batch sizes"),
                          (dict(modes=""), "modes: give at least one"), (dict(backends=[]), "backends")):
        with pytest.raises(ValueError, match=match):
            sweep.build_specs(**kwargs)
    specs = sweep.build_specs(batch_sizes=[np.int64(4)], modes="step")
    assert [s.batch_size for s in specs] == [4] and type(specs[0].batch_size) is int


def test_batch_sizes_alone_apply_to_loss_points_too(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(sweep, "run_point", lambda spec: seen.append((spec.mode, spec.batch_size)) or
                        {"status": "ok", "peak_bytes": 2**30, "base_bytes": 0, "memory_kind": "cpu_rss", "wall_s": 0})
    assert sweep.main(["--model", "tiny-qwen3", "--backends", "trl", "--dtypes", "fp32", "--batch-sizes", "2",
                       "--modes", "loss", "--out", str(tmp_path)]) == 0
    assert seen == [("loss", 2)]
