import json
import subprocess
import sys
from dataclasses import replace

import pytest

from grpo_lab.tasks.reward_curves import EmbeddedConfig, check_prompt_lengths, parity, shipped_warm_start
from grpo_lab.tasks.sanity import sanity_filter
from grpo_lab.tasks.sft import pass_rates, sample, sft_warm_start
from grpo_lab.tasks.tiny import addition_problems, build_char_tokenizer, build_tiny_model, completion_for


def test_tokenizer_and_model():
    tok = build_char_tokenizer()
    text = "12+34=" + completion_for("46")
    ids = tok(text)["input_ids"]
    assert len(ids) == 6 + 4 and tok.decode(ids) == text
    m = build_tiny_model(tok)
    n = sum(p.numel() for p in m.parameters())
    assert 0.5e6 < n < 0.7e6
    train, held = addition_problems()
    assert len(train) + len(held) == 90 * 90
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}


def test_sft_lowers_loss_and_is_seeded():
    tok = build_char_tokenizer()
    rows, _ = addition_problems()
    info = []
    for _ in range(2):
        m = build_tiny_model(tok, seed=0)
        r = sft_warm_start(m, tok, rows, target_pass_rate=1.01, max_steps=20, batch_size=32, eval_every=10,
                           eval_problems=16)
        info.append(r)
    assert info[0]["history"][-1]["loss"] < 2.5  # random init: ln(22) = 3.09
    assert info[0]["history"] == info[1]["history"]


def _warm():
    from grpo_lab.tasks.reward_curves import load_warm_start

    tok = build_char_tokenizer()
    m = build_tiny_model(tok)
    load_warm_start(m, shipped_warm_start())
    return tok, m


def test_shipped_warm_start_and_sanity_construction():
    tok, m = _warm()
    rows, _ = addition_problems()
    rates = pass_rates(m, tok, rows[:300], k=8, seed=1)
    assert 0.25 < sum(rates) / len(rates) < 0.9           # right some of the time, like the recipe's base model
    kept, stats = sanity_filter(m, tok, rows[:300], k=8, seed=1)
    assert kept and all(0.2 <= r["pass_rate"] <= 0.8 for r in kept) and stats["kept"] == len(kept)
    assert sample(m, tok, ["12+34="], k=3, seed=5) == sample(m, tok, ["12+34="], k=3, seed=5)
    with pytest.raises(ValueError, match="k >= 2"):
        sanity_filter(m, tok, rows[:3], k=1)


@pytest.mark.parametrize("change, match", [
    (dict(lora_r=0), "lora_r must be >= 1"),
    (dict(num_generations=1), r"num_generations \(G\) must be >= 2"),
    (dict(backends=("fast",)), "Unknown loss_backend"),
    (dict(max_completion_length=40), "no room for a prompt"),
    (dict(backends=()), "No loss backend to run"),
    (dict(backends=("trl", "trl")), "Each backend once"),
    (dict(eval_k=0), "eval_k must be >= 1"),
])
def test_bad_embedded_configs(change, match):
    with pytest.raises(ValueError, match=match):
        replace(EmbeddedConfig(), **change).validate()


def test_prompt_longer_than_context():
    with pytest.raises(ValueError, match="exceeds the context"):
        replace(EmbeddedConfig(), max_context=12).validate(prompt_lengths=[6, 6])
    check_prompt_lengths([6], 32, 8)


def test_parity_helper():
    runs = [{"rows": [{"step": 1, "reward": 0.5, "loss": 0.1}]}, {"rows": [{"step": 1, "reward": 0.4, "loss": 0.1}]}]
    assert parity(runs)["max_abs_delta_reward"] == pytest.approx(0.1)
    # same mean reward, other rollouts (a different completion length): still a divergence
    row = {"reward": 0.5, "reward_std": 0.2, "completion_length": 6.0, "loss": 0.1}
    runs = [{"rows": [{"step": 1} | row, {"step": 2} | row]},
            {"rows": [{"step": 1} | row, {"step": 2} | row | {"completion_length": 6.5}]}]
    assert parity(runs)["first_divergent_step"] == 2
    assert parity([runs[0], runs[0]])["first_divergent_step"] is None


def test_gpu_script_runs_tiny_on_cpu(tmp_path):
    """The H200 entry point, in its seconds-long setting on CPU: it writes CSV + PNG + JSON."""
    r = subprocess.run([sys.executable, "-m", "grpo_lab.tasks.reward_curves", "--variant", "tiny", "--device", "cpu",
                        "--out", str(tmp_path), "--backends", "trl"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import pandas as pd

    df = pd.read_csv(tmp_path / "tiny.csv")
    assert set(df.metric) >= {"reward", "loss", "heldout_pass_rate"} and (tmp_path / "tiny.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "tiny.json").read_text())
    assert summary["backends"]["trl"]["reward_start"] >= 0 and summary["env"]["trl"]
    (tmp_path / "tiny.png").unlink()
    r = subprocess.run([sys.executable, "-m", "grpo_lab.tasks.reward_curves", "--replot", str(tmp_path / "tiny.csv")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "tiny.png").stat().st_size > 1000, r.stderr[-2000:]


def test_a_run_cut_short_keeps_the_backends_it_finished(tmp_path, monkeypatch):
    """The files are written after every backend (a time-limited GPU call keeps what it finished), and the
    notebook's committed-figure caption names the backends that did not finish."""
    import pandas as pd

    from grpo_lab.tasks import notebook as nb03, reward_curves as rc

    real = rc.run_grpo

    def run_grpo(cfg, prep, backend, **kw):
        if backend == "naive":
            raise KeyboardInterrupt("the call's time limit")
        return real(cfg, prep, backend, **kw)

    monkeypatch.setattr(rc, "run_grpo", run_grpo)
    cfg = replace(EmbeddedConfig(), steps=2, prompts_per_step=4, num_generations=4, n_candidates=300, n_heldout=10,
                  eval_k=4, backends=("trl", "naive"))
    with pytest.raises(KeyboardInterrupt):
        rc.run_reward_curves(cfg, tmp_path, board=False, tag="cut")
    df = pd.read_csv(tmp_path / "cut.csv")
    assert set(df["backend"]) == {"trl"} and (df["metric"] == "reward").sum() == 2
    summary = json.loads((tmp_path / "cut.json").read_text())
    assert summary["complete"] is False and list(summary["backends"]) == ["trl"]
    assert (tmp_path / "cut.png").stat().st_size > 1000  # the figure of what finished, not of an earlier run
    assert not list(tmp_path.glob("*.tmp"))
    fig, = nb03.committed_figures(tmp_path)
    assert "not finished: naive" in fig["caption"] and list(fig["table"].index) == ["trl"]


def test_cli_bad_settings_are_one_line_errors(tmp_path):
    for args, msg in ((["--backends", "trl, fast"], "Unknown loss_backend 'fast'"),
                      (["--rank", "0"], "lora_r must be"), (["--backends", " , "], "No loss backend to run")):
        r = subprocess.run([sys.executable, "-m", "grpo_lab.tasks.reward_curves", "--variant", "tiny", "--device",
                            "cpu", "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "grpo_lab.tasks.reward_curves", "--replot", str(tmp_path / "no.csv")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no CSV" in r.stderr and "Traceback" not in r.stderr


def test_an_unreadable_summary_does_not_hide_the_other_figures(tmp_path, capsys):
    from grpo_lab.tasks import notebook as nb03
    from grpo_lab.tasks.reward_curves import plot_curves

    import pandas as pd

    df = pd.DataFrame({"backend": ["trl", "trl"], "step": [1, 2], "metric": ["reward", "reward"], "value": [0.1, 0.2]})
    for tag in ("good", "broken"):
        (tmp_path / f"{tag}.png").write_bytes(plot_curves(df))
    (tmp_path / "good.json").write_text(json.dumps({"env": {"device": "cpu"}, "backends": {}}))
    (tmp_path / "broken.json").write_text('{"env": {"dev')  # a write cut short
    figs = nb03.committed_figures(tmp_path)
    assert [f["tag"] for f in figs] == ["broken", "good"]
    assert "unreadable" in capsys.readouterr().err


def test_controls_start_at_the_parameters_cell_values():
    from grpo_lab.tasks.notebook import controls

    box = controls(replace(EmbeddedConfig(), lora_r=3, steps=2000, learning_rate=0.5, num_generations=32))
    steps, lr, rank = box.children[0].children
    g = box.children[1].children[0]
    assert (steps.value, lr.value, rank.value, g.value) == (2000, 0.5, 3, 32)
