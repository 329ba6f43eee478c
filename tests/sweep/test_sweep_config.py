"""A sweep's settings and grid file: what is accepted, how runs are named, and every mistake as one line (exit 2 from
`grpo-lab sweep`, before anything starts)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from grpo_lab.serving.tenancy.runs import check_run_name
from grpo_lab.sweep.config import SWEEP_OWNED, SweepConfig, SweepError, grid_settings
from grpo_lab.sweep.grid import expand, run_name


def write(tmp_path, text: str):
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def test_a_yaml_grid_expands_into_named_checked_runs(tmp_path):
    path = write(tmp_path, "base: {max_steps: 4}\ngrid:\n  learning_rate: [1e-3, 3e-3]\n  max_staleness: [1, 2]\n"
                           "  loss_backend: [grpo_lab]\nparallel: 2\n")
    config = SweepConfig.from_yaml(path, base={"prompts_per_step": 1})
    assert config.grid["learning_rate"] == [0.001, 0.003]  # YAML reads 1e-3 as text; the setting is a float
    assert config.base == {"max_steps": 4, "prompts_per_step": 1} and config.parallel == 2
    runs = expand(config.base, config.grid)
    assert [r.name for r in runs] == ["lr1e-3_ms1", "lr1e-3_ms2", "lr3e-3_ms1", "lr3e-3_ms2"]
    assert runs[3].settings == {"max_steps": 4, "prompts_per_step": 1, "learning_rate": 0.003, "max_staleness": 2,
                                "loss_backend": "grpo_lab"}
    assert runs[3].varied == {"learning_rate": 0.003, "max_staleness": 2}  # a single value names nothing


@pytest.mark.parametrize("varied", [
    {"learning_rate": 0.5, "max_inflight_tasks": -1}, {"group_versions": False, "seed": 12},
    {"max_steps": 3, "max_staleness": 2}, {"model": "some/odd model--name"},
    {"learning_rate": 1.25e-4, "num_generations": 16, "prompts_per_step": 64, "queue_maxsize": 4096,
     "rollout_failure_timeout": 30.5, "save_steps": 100},
])
def test_run_names_are_valid_pool_names_without_dots(varied):
    name = run_name(varied)
    assert check_run_name(name) == name and "." not in name and len(name) <= 48


def test_settings_with_one_initial_pattern_are_told_apart_in_names():
    names = [r.name for r in expand({}, {"max_steps": [3, 4], "max_staleness": [1, 2]})]
    assert names == ["maxsteps3_maxstaleness1", "maxsteps3_maxstaleness2", "maxsteps4_maxstaleness1",
                     "maxsteps4_maxstaleness2"]


@pytest.mark.parametrize("text, words", [
    ("grid: {beta: [0.1]}\n", ["unknown setting 'beta'", "learning_rate", "max_staleness"]),
    ("grid: {output_dir: [a]}\n", ["output_dir is set by the sweep"]),
    ("base: {router_url: http://x}\ngrid: {seed: [1, 2]}\n", ["base: router_url is set by the sweep"]),
    ("grid: {}\n", ["grid is empty"]),
    ("", ["grid is empty"]),
    ("grid: [\n", ["is not valid YAML at line 2"]),
    ("- 1\n- 2\n", ["expected a mapping"]),
    ("grid: {seed: [1]}\nreplicaz: 2\n", ["unknown key 'replicaz'", "replicas"]),
    ("grid: {seed: 1}\n", ["seed needs a non-empty list"]),
    ("grid: {seed: [1, 1]}\n", ["lists a value twice"]),
    ("grid: {learning_rate: [-1.0]}\n", ["learning_rate: must be > 0.0"]),
    ("grid: {loss_backend: [fastest]}\n", ["'fastest' is not one of"]),
    ("grid: {seed: [1]}\nparallel: 0\n", ["parallel: must be >= 1"]),
    ("grid: {seed: [1]}\npool_url: http://127.0.0.1:1\n", ["pool_url and pool_admin_key_file go together"]),
    ("base: {seed: 1}\ngrid: {seed: [1, 2]}\n", ["seed is in both base and grid"]),
    ("grid: {seed: [1]}\npool: {replica_kind: tpu}\n", ["pool: replica_kind: 'tpu' is not one of cpu, vllm"]),
    ("grid: {seed: [1]}\npool: {gpus: 2}\n", ["pool: unknown setting 'gpus'", "replica_kind"]),
    ("grid: {seed: [1]}\npool: {state_dir: x}\n", ["pool: state_dir is set by the sweep"]),
])
def test_a_bad_grid_file_is_one_line(tmp_path, text, words):
    with pytest.raises(SweepError) as caught:
        config = SweepConfig.from_yaml(write(tmp_path, text))
        expand(config.base, config.grid)
    message = str(caught.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_the_grid_names_only_settings_a_run_can_take():
    valid = grid_settings()
    assert {"learning_rate", "num_generations", "max_staleness", "loss_backend", "seed", "max_steps"} <= set(valid)
    assert not set(valid) & set(SWEEP_OWNED)
    from grpo_lab.async_loop.loop_settings import LoopSettings

    assert set(SWEEP_OWNED) <= set(LoopSettings.__dataclass_fields__)  # a renamed field is noticed here


@pytest.mark.parametrize("text, extra, words", [
    ("grid: {beta: [0.1, 0.2]}\n", [], "unknown setting 'beta'"),
    ("grid: {seed: [1, 2]\n", [], "not valid YAML"),
    ("grid: {seed: [1, 2]}\n", ["--max-steps", "0"], "max_steps: must be >= 1"),
])
def test_grpo_lab_sweep_refuses_a_bad_grid_in_one_line_with_exit_2(tmp_path, text, extra, words):
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "sweep", str(write(tmp_path, text)), *extra,
                           "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-lab sweep: error: ") and words in lines[0], done.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
    assert time.monotonic() - began < 60


def test_grpo_lab_sweep_without_a_file_says_so(tmp_path):
    done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "sweep", str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "cannot read it" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_pool_that_does_not_answer_is_one_line_and_nothing_runs(tmp_path, no_leftover_children):
    import socket

    from grpo_lab.sweep import Sweep

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = tmp_path / "admin.key"
    key.write_text("grpo-pool-not-the-key\n")
    sweep = Sweep(SweepConfig(grid={"seed": [0, 1]}, pool_url=f"http://127.0.0.1:{port}",
                              pool_admin_key_file=str(key), out_dir=str(tmp_path / "out")))
    with pytest.raises(SweepError) as caught:
        sweep.start()
    assert "\n" not in str(caught.value) and f"the pool at http://127.0.0.1:{port} refused" in str(caught.value)
    assert all(run.pid is None for run in sweep.runs.values())
    assert [r["status"] for r in sweep.status()] == ["stopped", "stopped"]  # closed: they never start


def test_an_empty_admin_key_file_is_one_line_and_nothing_runs(tmp_path, no_leftover_children):
    from grpo_lab.sweep import Sweep

    key = tmp_path / "admin.key"
    key.write_text("")
    sweep = Sweep(SweepConfig(grid={"seed": [0, 1]}, pool_url="http://127.0.0.1:9", pool_admin_key_file=str(key),
                              out_dir=str(tmp_path / "out")))
    with pytest.raises(SweepError) as caught:
        sweep.start()
    assert "\n" not in str(caught.value) and f"admin key file {key} is empty" in str(caught.value)
    assert all(run.pid is None for run in sweep.runs.values())


def test_add_and_stop_name_their_mistakes(tmp_path):
    from grpo_lab.sweep import Sweep

    sweep = Sweep(SweepConfig(base={"max_steps": 4}, grid={"learning_rate": [1e-3, 3e-3]}))
    assert sweep.add({"learning_rate": 1e-2}) == "lr1e-2"
    assert sweep.add({"learning_rate": 1e-2}) == "lr1e-2-2"  # the same point again gets a name of its own
    assert sweep.add({"max_steps": 4, "seed": 3}) == "s3"  # what equals the base does not name it
    with pytest.raises(SweepError, match="unknown setting 'beta'"):
        sweep.add({"beta": 0.1})
    with pytest.raises(SweepError, match="no '.'"):
        sweep.add({"seed": 4}, name="seed.4")
    with pytest.raises(SweepError, match="already has a run named 'lr1e-3'"):
        sweep.add({"seed": 4}, name="lr1e-3")
    with pytest.raises(SweepError, match="learning_rate: must be > 0"):
        sweep.add({"learning_rate": 0.0})
    with pytest.raises(SweepError, match="no run 'nope' in this sweep; its runs: lr1e-3, lr3e-3"):
        sweep.stop("nope")
    assert sweep.stop("s3") == "stopped"  # a queued run never starts


def test_a_folder_without_a_sweep_is_one_line(tmp_path):
    from grpo_lab.sweep import Sweep

    with pytest.raises(SweepError, match="holds no readable sweep.json"):
        Sweep.load(tmp_path)


def test_a_folder_that_holds_a_sweep_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "sweep.json").write_text('{"earlier": true}\n')
    done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "sweep", str(write(tmp_path, "grid: {seed: [1]}\n")),
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "already holds a sweep" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert (tmp_path / "sweep.json").read_text() == '{"earlier": true}\n'
    assert not (tmp_path / "summary.csv").exists()
