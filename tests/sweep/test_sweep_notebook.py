"""Notebook 05's calls on the CPU, without a pool: the form's comma lists as a sweep, its one-line refusals, the
figure and tables the panel shows, the panel's Stop/Add/launch on a stand-in sweep, and the files a refresh writes."""

from __future__ import annotations

import typing
from dataclasses import dataclass

import pandas as pd
import pytest

from grpo_lab.sweep import SweepConfig, SweepError, runner
from grpo_lab.sweep import notebook as nb05

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_quick_form_is_three_runs_on_a_started_cpu_pool():
    config = nb05.sweep_config(nb05.form_values(nb05.QUICK))
    assert config.grid["learning_rate"] == [1e-3, 3e-3, 1e-2] and config.grid["lora_rank"] == [1]
    assert config.base == {"max_steps": nb05.QUICK.max_steps, "prompts_per_step": nb05.QUICK.prompts_per_step}
    assert config.pool == {"replica_kind": "cpu"} and config.pool_url is None and config.replicas == 2
    assert len(runner.Sweep(config).runs) == 3


def test_the_full_form_varies_rank_and_staleness_on_vllm():
    config = nb05.sweep_config(nb05.form_values(nb05.FULL, replicas=4))
    assert len(runner.Sweep(config).runs) == 12 and config.pool == {"replica_kind": "vllm"} and config.replicas == 4


def test_parameters_override_the_mode_and_unknown_grid_keys_go_to_more_grid():
    values = nb05.form_values(nb05.QUICK, grid={"learning_rate": [1e-3, 2e-3], "loss_backend": "trl"}, max_steps=3,
                              pool_url="http://127.0.0.1:8000", admin_key_file="pool/admin.key")
    assert values["learning_rate"] == "0.001,0.002" and values["more_grid"] == "loss_backend=trl"
    config = nb05.sweep_config(values, out_dir="x")
    assert config.grid["loss_backend"] == ["trl"] and config.base["max_steps"] == 3 and config.out_dir == "x"
    assert config.pool_url == "http://127.0.0.1:8000" and config.pool_admin_key_file == "pool/admin.key"
    assert config.pool == {}


def test_values_take_each_settings_type():
    values = {**nb05.form_values(nb05.QUICK), "num_generations": " 4, 8 ", "more_grid": "autotune=true,false; "
              "loss_backend=trl", "model": "some/dir"}
    config = nb05.sweep_config(values)
    assert config.grid["num_generations"] == [4, 8] and config.grid["autotune"] == [True, False]
    assert config.base["model"] == "some/dir"
    assert nb05.parse_values("report_to", "trackio,none") == [["trackio"], ["none"]]   # a list setting
    assert nb05.parse_assignments("learning_rate=5e-3, max_steps=8", lists=False) == {"learning_rate": 5e-3,
                                                                                     "max_steps": 8}


@pytest.mark.parametrize("change, message", [
    ({"learning_rate": "1e-3,fast"}, "learning_rate: 'fast' is not a number"),
    ({"lora_rank": "1.5"}, "lora_rank: '1.5' is not a whole number"),
    ({"learning_rate": " , "}, "learning_rate: give at least one value"),
    ({"more_grid": "beta=0.1"}, "unknown setting 'beta'"),
    ({"more_grid": "output_dir=a"}, "output_dir is set by the sweep"),
    ({"more_grid": "autotune=maybe"}, "autotune: 'maybe' is not true or false"),
    ({"more_grid": "learning_rate=1e-2"}, "learning_rate already has its own box"),
    ({"more_grid": "seed"}, "write setting=value"),
    ({"pool": nb05.JOIN}, "give the pool's URL and its admin key file"),
    ({"lora_rank": "0"}, "lora_rank"),
    ({"learning_rate": "1e-3,1e-3"}, "lists a value twice"),
])
def test_a_bad_box_is_one_line_naming_it(change, message):
    with pytest.raises(SweepError, match=message) as error:
        nb05.sweep_config({**nb05.form_values(nb05.QUICK), **change})
    assert "\n" not in str(error.value)


def test_the_grid_file_runs_the_same_sweep(tmp_path):
    config = nb05.sweep_config({**nb05.form_values(nb05.QUICK), "more_grid": "autotune=true,false"})
    path = tmp_path / "grid.yaml"
    path.write_text(nb05.grid_yaml(config))
    again = SweepConfig.from_yaml(path)
    assert (again.grid, again.base, again.pool, again.replicas, again.parallel) == (
        config.grid, config.base, config.pool, config.replicas, config.parallel)


def curves_frame():
    return pd.DataFrame([{"run": "a", "step": 1, "reward": 0.5, "kl": 0.0, "staleness": 0.0, "rollout_wait_s": 1.0},
                         {"run": "a", "step": 2, "reward": 0.7, "kl": None, "staleness": 1.0, "rollout_wait_s": 0.5},
                         {"run": "b", "step": 1, "reward": 0.2, "kl": 0.1, "staleness": 1.0, "rollout_wait_s": 2.0}])


def test_the_figure_draws_runs_with_and_without_points_and_shares():
    shares = {"a": {"share": 0.6, "queued": 0}, "b": {"share": 0.4, "queued": 2}}
    assert nb05.sweep_png(curves_frame(), shares, ["a", "b", "c"]).startswith(PNG)
    assert nb05.sweep_png(pd.DataFrame(), {}, ["a"]).startswith(PNG)   # before any step: empty panels
    assert [key for key, _ in nb05.PANELS] == ["reward", "kl", "staleness", "rollout_wait_s"]


def test_the_runs_table_escapes_and_shows_shares():
    status = [{"name": "a", "status": "running", "step": 2, "max_steps": 6, "last_line": "<b>step 2</b>"},
              {"name": "b", "status": "queued", "step": 0, "max_steps": 6, "last_line": ""}]
    text = nb05.status_html(status, {"a": {"share": 0.25, "queued": 3}})
    assert "&lt;b&gt;step 2&lt;/b&gt;" in text and "<td>25%</td><td>3</td>" in text and "<td>2/6</td>" in text
    assert nb05.counts(status) == "1 running, 1 queued"


@dataclass
class FakeRun:
    settings: dict


class FakeSweep:
    """What the panel asks of a `Sweep`, without processes: runs advance one step per `wait`."""

    started: typing.ClassVar[list] = []

    def __init__(self, config, env=None):
        self.config, self.env = config, env
        self.runs = {"a": FakeRun({"report_to": ["trackio"]}), "b": FakeRun({})}
        self.state = {"a": "running", "b": "running"}
        self.steps = {"a": 0, "b": 0}
        self.folder = None
        self.url = "http://pool"
        self.closed = False

    def start(self):
        self.folder = self.config.out_dir_path
        FakeSweep.started.append(self)
        return self

    def status(self):
        return [{"name": n, "status": s, "step": self.steps[n], "max_steps": 2, "last_line": "", "output_dir": n}
                for n, s in self.state.items()]

    def shares(self):
        return {"a": {"share": 0.5, "queued": 0}, "b": {"share": 0.5, "queued": 0}}

    def curves(self):
        return pd.DataFrame([{"run": n, "step": s, "reward": 0.5, "kl": 0.0, "staleness": 0.0, "rollout_wait_s": 0.1}
                             for n, last in self.steps.items() for s in range(1, last + 1)])

    def wait(self, timeout_s=None):
        for n in self.state:
            if self.state[n] == "queued":
                self.state[n] = "running"
            elif self.state[n] == "running":
                self.steps[n] += 1
                if self.steps[n] == 2:
                    self.state[n] = "finished"
        return all(s != "running" for s in self.state.values())

    def stop(self, name):
        if name not in self.state:
            raise SweepError(f"no run {name!r} in this sweep")
        self.state[name] = "stopped"
        return "stopped"

    def add(self, settings):
        name = "lr5e-3"
        self.runs[name], self.state[name], self.steps[name] = FakeRun(settings), "queued", 0
        return name

    def close(self):
        self.closed = True

    def summary(self):
        return pd.DataFrame([{"run": n, "status": s, "final_reward": 0.5 if n == "a" else 0.4}
                             for n, s in self.state.items()])


@pytest.fixture
def fake_sweep(monkeypatch, tmp_path):
    FakeSweep.started = []
    monkeypatch.setattr(nb05, "Sweep", FakeSweep)
    monkeypatch.setattr(SweepConfig, "out_dir_path", tmp_path, raising=False)
    return FakeSweep


def test_the_panel_without_widgets_prints_changes_and_ends_with_the_ranked_table(fake_sweep, capsys):
    panel = nb05.SweepPanel(refresh_s=0.0)
    assert not panel.widgets   # plain Python: no widget frontend
    panel.launch(nb05.sweep_config(nb05.form_values(nb05.QUICK)), live=False)
    table = panel.watch()
    out = capsys.readouterr().out
    assert "a: running step 0/2" in out and "a: running step 1/2" in out and "b: finished step 2/2" in out
    assert out.count("a: running step 1/2") == 1                 # a line when something changed, not every poll
    assert list(table.index) == [1, 2] and list(table["run"]) == ["a", "b"]
    assert list(table["tracker"]) == ["trackio: a", ""]          # the run that logs to a tracker names its run
    sweep = fake_sweep.started[0]
    assert sweep.closed and (sweep.folder / nb05.FIGURE_FILE).read_bytes().startswith(PNG)
    assert panel.png.startswith(PNG)


def test_the_panel_stops_and_adds_runs_and_refuses_a_second_sweep_while_one_runs(fake_sweep, capsys):
    panel = nb05.SweepPanel(refresh_s=0.0)
    config = nb05.sweep_config(nb05.form_values(nb05.QUICK))
    panel.launch(config, live=False)
    with pytest.raises(SweepError, match="still running"):
        panel.launch(config, live=False)
    assert panel.stop("a") == "stopped" and panel.stop("nope") == ""
    assert panel.add("learning_rate=5e-3") == "lr5e-3"
    assert fake_sweep.started[0].runs["lr5e-3"].settings == {"learning_rate": 5e-3}
    assert panel.add("") == "" and panel.add("learning_rate=fast") == ""
    out = capsys.readouterr().out
    assert "a: stopped" in out and "no run 'nope'" in out and "added lr5e-3" in out
    assert "write the settings that differ" in out and "'fast' is not a number" in out
    panel.watch()
    assert panel.add("learning_rate=1e-2") == "" and "launch one from the form" in capsys.readouterr().out
    panel.launch(config, live=False)   # the first ended: a new one may start
    assert len(fake_sweep.started) == 2


def test_the_live_panel_returns_at_once_and_finishes_in_its_thread(fake_sweep):
    panel = nb05.SweepPanel(refresh_s=0.01)
    panel.launch(nb05.sweep_config(nb05.form_values(nb05.QUICK)))
    panel._thread.join(timeout=10)
    assert not panel._thread.is_alive() and panel.table is not None and fake_sweep.started[0].closed


def test_a_refresh_writes_the_table_with_its_machine_and_the_figure(tmp_path):
    table = pd.DataFrame([{"run": "a", "final_reward": 0.5}], index=pd.RangeIndex(1, 2, name="rank"))
    path = nb05.write_results(table, PNG + b"x", tmp_path / "results" / "sweep", device="cpu")
    written = pd.read_csv(path)
    assert path.name == nb05.RESULTS_SUMMARY and written["run"].tolist() == ["a"] and written["rank"].tolist() == [1]
    assert {"date", "torch"} <= set(written.columns)
    assert (tmp_path / "results" / "sweep" / nb05.RESULTS_FIGURE).read_bytes() == PNG + b"x"


def test_the_form_without_a_widget_frontend_keeps_the_values():
    values = nb05.form_values(nb05.QUICK)
    form = nb05.controls(values, lambda v: None)
    assert form.values() == values


def test_committed_is_empty_or_a_table_and_a_figure():
    table, png = nb05.committed()
    assert table is None or "run" in table
    assert png is None or png.startswith(PNG)



def test_the_ranking_puts_finished_runs_first():
    sweep = FakeSweep(SweepConfig(grid={"learning_rate": [1e-3]}))
    sweep.state = {"a": "stopped", "b": "finished"}   # a: the higher reward, over fewer steps
    table = nb05.ranked(sweep)
    assert list(table["run"]) == ["b", "a"] and list(table.index) == [1, 2] and table.index.name == "rank"
