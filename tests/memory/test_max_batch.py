"""The max-batch search finds the right answer against a known memory model; the CLI validates its input."""

import numpy as np
import pandas as pd
import pytest

from grpo_lab.memory import max_batch
from grpo_lab.memory.max_batch import build_searches, run_searches, search_max_batch

GiB = 2**30


def known_model(limit, setup=100.0, per=10.0, noise=0.0):
    """peak(B) = setup + per·B (+ a small non-linear term): fits iff B ≤ limit."""
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit, {"peak_bytes": setup + per * b + noise * b * b, "setup_bytes": setup, "base_bytes": 0}

    return fits, calls


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 7, 8, 9, 31, 100, 129, 1000])
@pytest.mark.parametrize("guess", [True, False])
def test_exact_answer_against_known_memory_model(limit, guess):
    fits, calls = known_model(limit, noise=0.05)
    res = search_max_batch(fits, start=8, upper=1024, budget=100 + 10 * limit + 5, guess=guess)
    assert res.max_batch == limit
    assert res.first_oom == limit + 1
    assert not res.capped
    assert len(calls) == len(set(calls)), "no batch size is probed twice"
    if guess and limit >= 9:
        assert len(calls) <= 10  # vs ~2·log2(limit) for plain doubling + bisection


@pytest.mark.parametrize("per_seq_gib", [0.09, 0.43, 1.2, 14.0])
def test_reserved_footprint_finds_the_limit_in_a_few_probes(per_seq_gib):
    """As on the H200: the reserved peak (what must fit) sits ~15 % above the allocated one and moves in 2 GiB
    segments. The search reads it and needs a handful of probes, where the earlier gallop from an allocated-peak
    guess took 9-11 (Qwen3-1.7B/8B, trl/grpo_lab)."""
    import math

    setup, budget, seg = 18.5 * GiB, 140.4 * GiB, 2 * GiB
    calls = []

    def reserved(b):
        return math.ceil((setup + per_seq_gib * GiB * b) / seg) * seg

    def fits(b):
        calls.append(b)
        r = reserved(b)
        return r <= budget, {"peak_bytes": setup + 0.87 * per_seq_gib * GiB * b, "reserved_bytes": r,
                             "setup_bytes": setup - 1.3 * GiB, "base_bytes": 0}

    limit = max(b for b in range(1, 5000) if reserved(b) <= budget)
    res = search_max_batch(fits, start=8, upper=4096, rel_tol=0.03, budget=budget)
    assert res.max_batch <= limit < res.first_oom
    assert res.first_oom - res.max_batch <= max(1, 0.03 * res.max_batch)
    assert len(calls) <= 6, res.probes
    assert len(calls) == len(set(calls))


@pytest.mark.parametrize("limit", [3, 50, 300])
def test_a_misleading_memory_reading_still_gives_the_exact_answer(limit):
    """Peaks that say nothing true about the limit (flat, or growing much faster than it): the guided probes are
    bounded and bisection finishes the job."""
    for peak in (lambda b: 1.0, lambda b: 100.0 * b * b):
        calls = []

        def fits(b, peak=peak):
            calls.append(b)
            return b <= limit, {"peak_bytes": peak(b), "setup_bytes": 0.5, "base_bytes": 0}

        res = search_max_batch(fits, start=8, upper=1024, budget=1e4)
        assert (res.max_batch, res.first_oom) == (limit, limit + 1)
        assert len(calls) <= 2 * 11 + 3


def test_capped_and_tolerance():
    fits, _ = known_model(5000)
    res = search_max_batch(fits, start=8, upper=256, budget=1e9)
    assert res.capped and res.max_batch == 256 and res.first_oom is None
    fits, _ = known_model(300)
    res = search_max_batch(fits, start=8, upper=1024, rel_tol=0.05, guess=False)
    assert res.max_batch <= 300 < res.first_oom and res.first_oom - res.max_batch <= 0.05 * res.max_batch + 1


def test_budget_so_that_a_known_batch_fits_and_the_next_does_not(monkeypatch):
    """Through the probe pipeline: a fake probe whose peak is 1 GiB + B × 0.25 GiB, against a 5.1 GiB budget."""
    def fake_run_point(spec):
        peak = (1 + 0.25 * spec.batch_size) * GiB
        ok = peak <= spec.budget_bytes
        return {"status": "ok" if ok else "oom", "peak_bytes": peak if ok else None, "base_bytes": 0,
                "setup_bytes": 1 * GiB, "memory_kind": "cuda_allocated", "wall_s": 0.0,
                "message": "" if ok else "CUDA out of memory"}

    monkeypatch.setattr(max_batch, "run_point", fake_run_point)
    searches = build_searches(models="tiny-qwen3", backends="trl,naive", dtype="bf16", prompt_len=8,
                              completion_len=8, lora_r=4, budget_gib=5.1, start=2, upper=512, device="cpu")
    df = run_searches(searches)
    assert list(df["max_batch"]) == [16, 16]
    assert list(df["first_oom"]) == [17, 17]
    assert (df["budget_gib"].round(2) == 5.1).all()


def test_real_probes_on_cpu_find_a_limit(tmp_path):
    """Real FSDP2 + LoRA probes (1-process gloo group): the largest fitting batch fits, the next one does not."""
    searches = build_searches(models="tiny-qwen3", backends="trl", dtype="fp32", prompt_len=8, completion_len=8,
                              lora_r=4, budget_gib=0.5, start=4, upper=8, device="cpu", world_size=1)
    df = run_searches(searches, out_csv=tmp_path / "mb.csv")
    row = df.iloc[0]
    assert row["status"] == "ok" and 1 <= row["max_batch"] <= 8
    probes = pd.read_csv(tmp_path / "mb_probes.csv")
    assert len(probes) == row["n_probes"] and (probes["fsdp"]).all()


def test_cli_bad_input(capsys):
    assert max_batch.main(["--models", "Qwen3-99B"]) == 2
    assert "Unknown model 'Qwen3-99B'" in capsys.readouterr().err
    assert max_batch.main(["--backends", "trl,fastest"]) == 2
    assert "Unknown loss_backend 'fastest'" in capsys.readouterr().err
    assert max_batch.main(["--start", "0"]) == 2
    assert "positive integer" in capsys.readouterr().err
    with pytest.raises(ValueError, match="budget"):
        build_searches(models="tiny-qwen3", device="cpu")


def test_full_command_runs_on_cpu_in_a_tiny_setting(tmp_path):
    """`--full` as the integrator runs it, shrunk to a tiny model on CPU (the preset's 4 backends, bf16, LoRA)."""
    rc = max_batch.main(["--full", "--models", "tiny-qwen3", "--device", "cpu", "--budget-gib", "0.5", "--upper", "4",
                         "--start", "2", "--prompt-len", "8", "--completion-len", "8", "--out", str(tmp_path),
                         "--keep-going"])
    df = pd.read_csv(tmp_path / "fsdp_max_batch.csv")
    assert rc == 0, df[["backend", "status", "message"]]
    assert list(df["backend"]) == max_batch.PRESETS["full"]["backends"]
    assert (df["dtype"] == "bf16").all() and (df["lora_r"] == 16).all() and (df["max_batch"] >= 2).all()
    assert (tmp_path / "fsdp_max_batch.png").is_file()
    # --append with another model keeps the rows of the first run
    rc = max_batch.main(["--full", "--models", "tiny-qwen3-untied", "--backends", "trl", "--device", "cpu",
                         "--budget-gib", "0.5", "--upper", "2", "--start", "2", "--prompt-len", "8",
                         "--completion-len", "8", "--out", str(tmp_path), "--append"])
    assert rc == 0
    df = pd.read_csv(tmp_path / "fsdp_max_batch.csv")
    assert len(df) == len(max_batch.PRESETS["full"]["backends"]) + 1


def test_figure_marks_lower_bounds_and_searches_that_did_not_run():
    """An exact bar, a capped one (≥), a search cut short with a bracket (hatched, 'lo–hi'), a skipped one (named,
    no bar) and a backend not searched for a model (nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    from grpo_lab.memory.plots import plot_max_batch

    rows = [("m1", "naive", 100, 103, False, "ok"), ("m1", "trl", 1024, None, True, "ok"),
            ("m2", "naive", 76, 78, False, "ok"), ("m2", "trl", 286, 291, False, "ok"),
            ("m2", "grpo_lab", 246, 326, False, "incomplete"), ("m3", "naive", 0, None, False, "skipped")]
    df = pd.DataFrame(rows, columns=["model", "backend", "max_batch", "first_oom", "capped", "status"])
    ax = plot_max_batch(df).axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert "≥1024\n≥10.24×n" in texts
    assert "246–325\n≥3.24×n\n≥0.86×t" in texts
    assert "skipped" in texts
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_height() == 246


def test_figure_with_four_backends_rotates_its_labels():
    """Four bars per model leave no room for stacked labels: each bar gets one vertical line of text instead."""
    import matplotlib

    matplotlib.use("Agg")
    from grpo_lab.memory.plots import plot_max_batch

    rows = [("m1", b, v, v + 5, False, "ok") for b, v in (("naive", 95), ("trl", 692), ("grpo_lab", 692),
                                                             ("liger", 695))]
    df = pd.DataFrame(rows, columns=["model", "backend", "max_batch", "first_oom", "capped", "status"])
    ax = plot_max_batch(df).axes[0]
    labels = {t.get_text(): t.get_rotation() for t in ax.texts}
    assert labels == {"95 0.14×t": 90.0, "692 7.28×n": 90.0, "692 7.28×n 1.00×t": 90.0, "695 7.32×n 1.00×t": 90.0}


def test_ratio_table_says_which_figures_are_bounds():
    from grpo_lab.memory.notebook import closing_note_max_batch
    from grpo_lab.memory.results import ratio_table

    rows = [("m1", "naive", 100, 103, False, "ok"), ("m1", "trl", 1024, None, True, "ok"),
            ("m1", "grpo_lab", 1024, None, True, "ok"),
            ("m2", "naive", 76, 78, False, "ok"), ("m2", "trl", 286, 291, False, "ok"),
            ("m2", "grpo_lab", 246, 326, False, "incomplete"), ("m3", "naive", 86, 88, False, "ok"),
            ("m3", "grpo_lab", 0, None, False, "skipped")]
    df = pd.DataFrame(rows, columns=["model", "backend", "max_batch", "first_oom", "capped", "status"])
    t = ratio_table(df)
    assert t.loc["m1", "trl"] == "≥1024" and t.loc["m1", "trl/naive"] == "≥10.24×"
    assert t.loc["m1", "grpo_lab/trl"] == ""  # a bound over a bound
    assert t.loc["m2", "grpo_lab"] == "246–325" and t.loc["m2", "grpo_lab/trl"] == "≥0.86×"
    assert t.loc["m2", "trl/naive"] == "3.76×"
    assert t.loc["m3", "grpo_lab"] == ""
    df = df.assign(gpu_name="GPU", lora_r=16, dtype="bf16", prompt_len=256, completion_len=512, world_size=1,
                   budget_gib=140.0, date="2026-12-02")
    note = closing_note_max_batch(df)
    assert "| m2 | 76 | 286 | 246–325 |" in note and "Not run: m3 grpo_lab (skipped)." in note


@pytest.mark.parametrize("limit", [1, 37, 290, 700])
@pytest.mark.parametrize("cut_after", [0, 1, 2, 3])
def test_a_search_cut_short_returns_its_bracket_and_resumes_to_the_same_answer(limit, cut_after):
    fits, calls = known_model(limit)
    budget = 100 + 10 * limit + 5
    whole = search_max_batch(fits, start=8, upper=1024, rel_tol=0.03, budget=budget)
    fits, calls = known_model(limit)
    cut = search_max_batch(fits, start=8, upper=1024, rel_tol=0.03, budget=budget,
                           out_of_time=lambda: len(calls) >= cut_after)
    assert len(calls) == min(cut_after, len(whole.probes))
    if cut.incomplete:
        assert cut.max_batch <= limit and (cut.first_oom is None or cut.first_oom > limit)
    first = list(calls)
    resumed = search_max_batch(fits, start=8, upper=1024, rel_tol=0.03, budget=budget, known=cut.results)
    assert not resumed.incomplete and resumed.resumed == len(first)
    assert resumed.max_batch <= limit < resumed.first_oom
    assert resumed.first_oom - resumed.max_batch <= max(1, 0.03 * resumed.max_batch)
    assert len(calls) == len(set(calls)), "a resumed search does not probe again what it already knows"
    assert [b for b, _ in resumed.probes[:len(first)]] == sorted(first)


def test_run_searches_records_a_cut_search_as_incomplete_and_resume_finishes_it(tmp_path, monkeypatch, fake_clock):
    """Through the probe pipeline and the CSVs: a time limit hit mid-search leaves status `incomplete` with the
    bracket; `resume` starts from the probes CSV, probes nothing twice, and ends at the exact limit (16)."""
    calls = []

    def fake_run_point(spec):
        calls.append(spec.batch_size)
        fake_clock.advance(60.0)  # each probe takes a minute
        peak = (1 + 0.25 * spec.batch_size) * GiB
        ok = peak <= spec.budget_bytes
        return {"status": "ok" if ok else "oom", "peak_bytes": peak if ok else None, "base_bytes": 0,
                "reserved_bytes": peak if ok else None, "setup_bytes": 1 * GiB, "memory_kind": "cuda_allocated",
                "wall_s": 60.0, "message": "" if ok else "CUDA out of memory"}

    monkeypatch.setattr(max_batch, "run_point", fake_run_point)
    monkeypatch.setattr(max_batch, "time", fake_clock)
    searches = build_searches(models="tiny-qwen3", backends="trl,naive", dtype="bf16", prompt_len=8,
                              completion_len=8, lora_r=4, budget_gib=5.1, start=1, upper=512, device="cpu",
                              rel_tol=0.0)
    csv = tmp_path / "mb.csv"
    df = run_searches(searches, out_csv=csv, max_seconds=90.0, guess=False)
    assert list(df["status"]) == ["incomplete", "skipped"]
    cut = df.iloc[0]
    assert cut["max_batch"] == 2 and pd.isna(cut["first_oom"]) and cut["n_probes"] == 2
    first = list(calls)
    df = run_searches(searches, out_csv=csv, resume=True, guess=False)
    assert list(df["status"]) == ["ok", "ok"] and list(df["max_batch"]) == [16, 16]
    assert "resumed from 2 earlier probes" in df.iloc[0]["message"]
    assert not set(first) & set(calls[len(first):len(first) + int(df.iloc[0]["n_probes"]) - 2])
    probes = pd.read_csv(tmp_path / "mb_probes.csv")
    assert len(probes) == df["n_probes"].sum()
    assert not probes.duplicated(["model", "backend", "batch_size"]).any()
    # probes of another setting (here: another budget) are not reused
    other = build_searches(models="tiny-qwen3", backends="trl", dtype="bf16", prompt_len=8, completion_len=8,
                           lora_r=4, budget_gib=6.1, start=1, upper=512, device="cpu", rel_tol=0.0)
    df = run_searches(other, out_csv=csv, resume=True, guess=False)
    row = df[df["backend"] == "trl"].iloc[0]
    assert row["max_batch"] == 20 and "resumed" not in str(row["message"])


def _linear_fake_probe(calls, per_gib=0.25, interrupt_at=None):
    """A probe whose peak is 1 GiB + B × per_gib against spec.budget_bytes; raises KeyboardInterrupt (a job killed)
    when asked for `interrupt_at`."""
    def fake_run_point(spec):
        if spec.batch_size == interrupt_at:
            raise KeyboardInterrupt
        calls.append((spec.loss_backend, spec.batch_size, spec.budget_bytes))
        peak = (1 + per_gib * spec.batch_size) * GiB
        ok = peak <= spec.budget_bytes
        return {"status": "ok" if ok else "oom", "peak_bytes": peak if ok else None, "base_bytes": 0,
                "reserved_bytes": peak if ok else None, "setup_bytes": 1 * GiB, "memory_kind": "cuda_allocated",
                "wall_s": 1.0, "message": "" if ok else "CUDA out of memory"}

    return fake_run_point


def _tiny_searches(backends="trl", budget_gib=5.1, steps=1):
    return build_searches(models="tiny-qwen3", backends=backends, dtype="bf16", prompt_len=8, completion_len=8,
                          lora_r=4, budget_gib=budget_gib, start=1, upper=512, device="cpu", rel_tol=0.0,
                          steps=steps)


def test_resume_after_a_job_killed_in_its_first_search(tmp_path, monkeypatch):
    """Killed before any search ended, only the probes CSV exists; resume still starts from it."""
    calls = []
    csv = tmp_path / "mb.csv"
    monkeypatch.setattr(max_batch, "run_point", _linear_fake_probe(calls, interrupt_at=4))
    with pytest.raises(KeyboardInterrupt):
        run_searches(_tiny_searches(), out_csv=csv, guess=False)
    assert not csv.exists() and len(pd.read_csv(tmp_path / "mb_probes.csv")) == 2
    calls.clear()
    monkeypatch.setattr(max_batch, "run_point", _linear_fake_probe(calls))
    df = run_searches(_tiny_searches(), out_csv=csv, resume=True, guess=False)
    assert df.iloc[0]["max_batch"] == 16 and "resumed from 2" in df.iloc[0]["message"]
    assert [b for _, b, _ in calls][:1] == [4]  # went on from B=2, did not start again at 1


def test_resume_adopts_a_budget_measured_again_and_skips_other_step_counts(tmp_path, monkeypatch):
    calls = []
    csv = tmp_path / "mb.csv"
    monkeypatch.setattr(max_batch, "run_point", _linear_fake_probe(calls))
    run_searches(_tiny_searches(budget_gib=5.1), out_csv=csv, max_seconds=None, guess=False)
    n_first = len(calls)
    # the same setting with a budget that moved by 1 % (budget_above_one_gib is measured anew on every run)
    df = run_searches(_tiny_searches(budget_gib=5.151), out_csv=csv, resume=True, guess=False)
    assert len(calls) == n_first and round(df.iloc[0]["budget_gib"], 3) == 5.1
    assert "resumed" in df.iloc[0]["message"]
    # another number of optimizer steps per probe is another measurement: nothing reused
    df = run_searches(_tiny_searches(budget_gib=5.1, steps=2), out_csv=csv, resume=True, guess=False)
    assert len(calls) > n_first and "resumed" not in str(df.iloc[0]["message"])


def test_resume_under_a_spent_time_limit_keeps_a_finished_search(tmp_path, monkeypatch, fake_clock):
    calls = []
    csv = tmp_path / "mb.csv"
    monkeypatch.setattr(max_batch, "run_point", _linear_fake_probe(calls))
    run_searches(_tiny_searches("trl,naive"), out_csv=csv, guess=False)
    monkeypatch.setattr(max_batch, "time", fake_clock)
    fake_clock.advance(1e6)
    df = run_searches(_tiny_searches("trl,naive"), out_csv=csv, resume=True, max_seconds=1.0, guess=False)
    assert list(df["status"]) == ["ok", "ok"] and list(df["max_batch"]) == [16, 16]


def test_cli_with_every_search_skipped_prints_its_table(tmp_path, capsys):
    """--max-minutes 0: nothing runs, the figure and table are still written (no traceback)."""
    rc = max_batch.main(["--quick", "--backends", "naive", "--budget-gib", "0.5", "--max-minutes", "0",
                         "--out", str(tmp_path)])
    df = pd.read_csv(tmp_path / "fsdp_max_batch_quick.csv")
    assert rc == 0 and list(df["status"]) == ["skipped"]
    assert (tmp_path / "fsdp_max_batch_quick.png").is_file()


def test_search_settings_are_checked(tmp_path, capsys):
    assert max_batch.main(["--rel-tol", "-1", "--out", str(tmp_path)]) == 2
    assert "rel_tol" in capsys.readouterr().err
    assert max_batch.main(["--models", "", "--out", str(tmp_path)]) == 2
    assert "models" in capsys.readouterr().err
    (tmp_path / "fsdp_max_batch_quick.csv").write_text("x\n")
    assert max_batch.main(["--budget-gib", "0.5", "--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (tmp_path / "fsdp_max_batch_quick.csv").read_text() == "x\n"


def test_expandable_segments_search_probes_with_it_and_resumes_only_from_its_own_probes(tmp_path, monkeypatch):
    """A search with expandable_segments hands the allocator setting to every probe, records it in both CSVs, and
    a resumed search never reuses probes measured under the other allocator (their limits differ by 12-16 %)."""
    seen, calls = [], []
    fake = _linear_fake_probe(calls)

    def probe(spec):
        seen.append(spec.extra.get("cuda_alloc_conf", ""))
        return fake(spec)

    monkeypatch.setattr(max_batch, "run_point", probe)
    searches = build_searches(models="tiny-qwen3", backends="trl", dtype="bf16", prompt_len=8, completion_len=8,
                              lora_r=4, budget_gib=5.1, start=1, upper=512, device="cuda", rel_tol=0.0,
                              expandable_segments=True)
    csv = tmp_path / "mb.csv"
    df = run_searches(searches, out_csv=csv, guess=False)
    assert seen and set(seen) == {"expandable_segments:True"}
    assert list(df["cuda_alloc_conf"]) == ["expandable_segments:True"]
    assert set(pd.read_csv(tmp_path / "mb_probes.csv")["cuda_alloc_conf"]) == {"expandable_segments:True"}
    n_first = len(calls)
    plain = build_searches(models="tiny-qwen3", backends="trl", dtype="bf16", prompt_len=8, completion_len=8,
                           lora_r=4, budget_gib=5.1, start=1, upper=512, device="cuda", rel_tol=0.0)
    df = run_searches(plain, out_csv=csv, resume=True, guess=False)
    assert len(calls) > n_first and "resumed" not in str(df.iloc[0]["message"])
    assert seen[n_first:] and set(seen[n_first:]) == {""}


def test_expandable_segments_on_cpu_is_refused_with_a_message(tmp_path, capsys):
    with pytest.raises(ValueError, match="CUDA caching allocator"):
        build_searches(models="tiny-qwen3", backends="trl", budget_gib=1.0, device="cpu", expandable_segments=True)
    rc = max_batch.main(["--quick", "--device", "cpu", "--expandable-segments", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "allocator" in err and "Traceback" not in err


def test_a_seeded_search_starts_from_another_runs_probes_and_says_where_they_came_from(tmp_path, monkeypatch):
    """`seed_probes` (planner.check's pair around a predicted limit, say): the pair measured under the search's
    setting brackets the search from the start, is not probed again, lands in the probes CSV marked with its file;
    a row of another allocator setting is not taken."""
    calls = []
    monkeypatch.setattr(max_batch, "run_point", _linear_fake_probe(calls))
    kw = dict(models="tiny-qwen3", backends="trl", dtype="bf16", prompt_len=8, completion_len=8, lora_r=4,
              budget_gib=5.1, start=1, upper=512, device="cuda", rel_tol=0.0)
    plain = run_searches(build_searches(**kw, expandable_segments=True), out_csv=tmp_path / "a.csv", guess=False)
    n_plain = len(calls)
    probes = pd.read_csv(tmp_path / "a_probes.csv")
    pair = probes[probes["batch_size"].isin([8, 32])].assign(figure="memory_planner", expect=["fits", "oom"])
    other = pair.iloc[[0]].assign(batch_size=17, status="ok", cuda_alloc_conf=np.nan)  # default allocator: wrong
    seeds = tmp_path / "planner_pairs.csv"
    pd.concat([pair, other]).to_csv(seeds, index=False)
    calls.clear()
    csv = tmp_path / "seeded.csv"
    df = run_searches(build_searches(**kw, expandable_segments=True), out_csv=csv, seed_probes=seeds, guess=False)
    row = df.iloc[0]
    assert row["max_batch"] == plain.iloc[0]["max_batch"] == 16 and row["first_oom"] == 17
    assert "resumed from 2 earlier probes" in row["message"] and row["probes"].startswith("8:ok 32:oom")
    assert {b for _, b, _ in calls}.isdisjoint({8, 32}) and len(calls) < n_plain
    written = pd.read_csv(tmp_path / "seeded_probes.csv")
    assert set(written["figure"]) == {"fsdp_max_batch"} and len(written) == row["n_probes"]
    marked = written[written["seeded_from"].fillna("") == "planner_pairs.csv"]
    assert sorted(marked["batch_size"]) == [8, 32]
    # seeding again (a resumed job) does not duplicate the pair
    run_searches(build_searches(**kw, expandable_segments=True), out_csv=csv, seed_probes=seeds, guess=False)
    assert not pd.read_csv(tmp_path / "seeded_probes.csv").duplicated(["batch_size"]).any()


def test_cli_seed_probes_that_do_not_exist_is_a_message(tmp_path, capsys):
    rc = max_batch.main(["--quick", "--budget-gib", "0.5", "--seed-probes", str(tmp_path / "nope.csv"),
                         "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "nope.csv" in err and "Traceback" not in err


@pytest.mark.parametrize("flag, name, alloc", [([], "fsdp_max_batch_expandable", "expandable_segments:True"),
                                               (["--default-allocator"], "fsdp_max_batch", "")])
def test_full_preset_probes_under_expandable_segments_unless_told_otherwise(tmp_path, monkeypatch, flag, name,
                                                                           alloc):
    """The H200 preset's searches run under expandable_segments and write their own CSV, so the committed
    default-allocator searches are never mixed with them; --default-allocator gives the old setting and name."""
    calls, seen = [], []
    fake = _linear_fake_probe(calls, per_gib=0.25)

    def probe(spec):
        seen.append(spec.extra.get("cuda_alloc_conf", ""))
        return fake(spec)

    monkeypatch.setattr(max_batch, "run_point", probe)
    monkeypatch.setattr(max_batch, "_gpu_total_bytes", lambda: int(140 * GiB))  # a GPU is here
    rc = max_batch.main(["--full", "--models", "Qwen3-0.6B", "--backends", "trl", "--upper", "64",
                         "--budget-gib", "5.1", *flag,
                         "--out", str(tmp_path)])
    df = pd.read_csv(tmp_path / f"{name}.csv")
    assert rc == 0 and set(seen) == {alloc} and df.iloc[0]["max_batch"] == 16
    assert df["cuda_alloc_conf"].fillna("").tolist() == [alloc]


def test_text_column_reads_a_missing_or_empty_column_as_empty_strings():
    """CSVs written before `cuda_alloc_conf` / `seeded_from` existed mean the default allocator / a probe of the run
    itself: every reader sees "" for them, as for an empty cell."""
    from grpo_lab.memory.results import text_column

    old = pd.DataFrame({"model": ["a", "b"]})
    assert text_column(old, "cuda_alloc_conf").tolist() == ["", ""]
    new = pd.DataFrame({"cuda_alloc_conf": [np.nan, "expandable_segments:True"]})
    assert text_column(new, "cuda_alloc_conf").tolist() == ["", "expandable_segments:True"]
