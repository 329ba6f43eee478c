"""Notebook 02's planner panel (core ipywidgets, driven here without a kernel) and the committed planner results it
and the docs show: the validation table, the max-batch table and the article-setting prediction are what the code
computes today from the committed measurements."""

from pathlib import Path

import ipywidgets
import matplotlib
import pandas as pd
import pytest

from grpo_lab.memory.planner import validate as planner_validate
from grpo_lab.memory.planner import PlannerConfig, max_batch
from grpo_lab.memory.planner.report import article_setting
from grpo_lab.memory.planner.widgets import PlannerPanel, searches_against_planner, with_committed_searches
from grpo_lab.memory.results import load_reference

matplotlib.use("Agg")
RESULTS = Path(__file__).resolve().parents[2] / "results" / "memory_planner"


@pytest.fixture
def panel():
    """A panel built with real ipywidgets, as in a kernel (the image output is left out: no kernel to capture it)."""
    p = PlannerPanel(model="Qwen3-1.7B", searches=with_committed_searches(None))
    p._w = ipywidgets
    p._build()
    p.update()
    return p


def test_panel_controls_change_the_prediction(panel):
    one = panel.summary.value
    assert "max batch per GPU:" in one and "(predicted;" in one
    batch_one = int(one.split("max batch per GPU: ")[1].split("<")[0].split()[0])
    cfg = PlannerConfig(model="Qwen3-1.7B", lora_r=16, fsdp=True)
    assert batch_one == max_batch(cfg, 140.4).batch
    panel.controls["gpus"].value = 8
    eight = panel.summary.value
    assert eight != one and "multi-GPU, not measured here" in eight
    panel.controls["loss_backend"].value = "naive"
    assert panel.summary.value != eight
    panel.controls["loss_backend"].value = "grpo_lab"
    panel.controls["gpus"].value = 1
    panel.controls["expandable_segments"].value = True  # 2 % headroom instead of the default allocator's 12 %
    expandable = int(panel.summary.value.split("max batch per GPU: ")[1].split("<")[0].split()[0])
    assert expandable == max_batch(cfg.replace(expandable_segments=True), 140.4).batch > batch_one


def test_panel_shows_a_refused_setting_as_a_message(panel):
    panel.controls["lora_r"].value = 0
    panel.controls["loss_backend"].value = "liger"   # liger under FSDP2 needs a frozen (LoRA) head
    assert "color:#b00" in panel.summary.value and "liger" in panel.summary.value
    panel.controls["lora_r"].value = 8
    assert "max batch per GPU" in panel.summary.value


def test_panel_figure_overlays_the_measured_searches():
    p = PlannerPanel(model="Qwen3-8B", searches=with_committed_searches(None))
    _, fig = p.render()
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["naive (predicted)", "grpo_lab (predicted)", "naive (measured)", "grpo_lab (measured)"]
    measured = fig.axes[0].get_lines()[2]
    assert list(measured.get_xdata()) == [1] and list(measured.get_ydata()) == [76]   # the committed H200 search
    matplotlib.pyplot.close(fig)


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="Unknown model"):
        PlannerPanel(model="Qwen3-9B")


def test_searches_just_measured_replace_the_committed_ones():
    """A search rerun in the notebook replaces the committed one of its setting, allocator included; the other
    allocator's search of the same model and backend stays."""
    committed = load_reference("fsdp_max_batch", "fsdp_max_batch.csv")
    expandable = load_reference("fsdp_max_batch", "fsdp_max_batch_expandable.csv")
    rerun = committed.iloc[[0]].assign(max_batch=99)
    both = with_committed_searches(rerun)
    assert len(both) == len(committed) + len(expandable)
    same = both[(both["model"] == rerun["model"].iloc[0]) & (both["backend"] == rerun["backend"].iloc[0])]
    assert sorted(same["max_batch"].tolist()) == [99, 100]


def test_committed_validation_tables_are_what_the_code_computes(tmp_path):
    """`python -m grpo_lab.memory.planner.validate` regenerates results/memory_planner's tables exactly (same
    columns, rows and, to print precision, values); a change to the planner must come with new tables."""
    assert planner_validate.main(["--out", str(tmp_path)]) == 0
    for name in ("validation.csv", "validation_max_batch.csv"):
        fresh, committed = pd.read_csv(tmp_path / name), pd.read_csv(RESULTS / name)
        assert list(fresh.columns) == list(committed.columns), name
        pd.testing.assert_frame_equal(fresh, committed, check_exact=False, rtol=1e-6, obj=name)
    assert (tmp_path / "validation.md").read_text() == (RESULTS / "validation.md").read_text()
    table = pd.read_csv(RESULTS / "validation.csv")
    measured = table[table["source"] != "CPU gloo FSDP2 (RSS)"]
    card = measured["source"].str.split().str[0]  # "H200 ..." / "H100 ...": the card the source was measured on
    assert (measured["machine"].str.split().str[1] == card).all() and measured["measured_on"].notna().all()
    assert set(card) == {"H200", "H100"}


@pytest.mark.parametrize("name, source", [("fsdp_max_batch.csv", "H200 notebook 02 (searches)"),
                                          ("fsdp_max_batch_expandable.csv",
                                           "H200 notebook 02 (searches, expandable segments)")])
def test_notebook_table_matches_the_validation_table(name, source):
    shown = searches_against_planner(load_reference("fsdp_max_batch", name))
    committed = pd.read_csv(RESULTS / "validation_max_batch.csv")
    h200 = committed[committed["source"] == source]
    assert len(shown) == len(h200) == 16
    assert shown["predicted_max_batch"].tolist() == h200["predicted_max_batch"].tolist()
    assert shown["within_one_step"].tolist() == h200["within_one_step"].tolist()


def test_committed_article_setting_is_the_planners_prediction():
    committed = pd.read_csv(RESULTS / "article_setting.csv")
    fresh = article_setting(models=("Qwen3-8B",))
    rows = committed[committed["model"] == "Qwen3-8B"].reset_index(drop=True)
    assert rows[["naive_max_batch", "liger_max_batch"]].values.tolist() == \
        fresh[["naive_max_batch", "liger_max_batch"]].values.tolist()
    assert (committed["status"] == "predicted").all()


def test_validate_cli_missing_heldout_csv_is_one_line(tmp_path, capsys):
    assert planner_validate.main(["--out", str(tmp_path), "--heldout-csv", str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err
    assert "no CSV" in err and "Traceback" not in err


def test_committed_searches_of_both_allocators_are_overlaid_each_on_its_own_setting():
    """with_committed_searches keeps the default-allocator and the expandable_segments searches apart (same model and
    backend, different limits); the panel draws a search only on the allocator setting it was made with."""
    from grpo_lab.memory.planner import PlannerConfig
    from grpo_lab.memory.planner.widgets import measured_points

    both = with_committed_searches(None)
    assert len(both) == 32
    cfg = PlannerConfig(model="Qwen3-4B", loss_backend="grpo_lab", lora_r=16, prompt_len=256, completion_len=512)
    plain = measured_points(both, cfg, 140.4).set_index("backend")["max_batch"]
    expandable = measured_points(both, cfg.replace(expandable_segments=True), 140.4).set_index("backend")["max_batch"]
    assert plain["grpo_lab"] == 397 and expandable["grpo_lab"] == 474
    assert plain["naive"] == 86 and expandable["naive"] == 88


def test_allocator_comparison_tabulates_the_gain_of_expandable_segments():
    from grpo_lab.memory import notebook as nb

    t = nb.allocator_comparison()
    assert t.loc[("Qwen3-4B", "grpo_lab"), "default"] == "397" and t.loc[("Qwen3-4B", "grpo_lab"), "gain"] == "+19 %"
    assert t.loc[("Qwen3-0.6B", "trl"), "expandable"] == "≥1024" and t.loc[("Qwen3-0.6B", "trl"), "gain"] == ""
    assert list(t.index.get_level_values(0)[:4]) == ["Qwen3-0.6B"] * 4
    assert nb.reference_max_batch(True)["cuda_alloc_conf"].eq("expandable_segments:True").all()
    assert "cuda_alloc_conf" not in nb.reference_max_batch(False) or \
        nb.reference_max_batch(False)["cuda_alloc_conf"].isna().all()
    assert "expandable_segments:True" in nb.closing_note_max_batch(nb.reference_max_batch(True))
    assert "default caching allocator" in nb.closing_note_max_batch(nb.reference_max_batch(False))
