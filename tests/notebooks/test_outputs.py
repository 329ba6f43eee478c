"""Where runs write: the checkout's git-ignored outputs/ (wherever the kernel runs), a chosen folder, or the committed
results/ only when asked; never a folder relative to notebooks/."""

import pytest

from grpo_lab.lab import outputs


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    root = tmp_path / "clone"
    for d in ("grpo_lab", "notebooks", "results"):
        (root / d).mkdir(parents=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'grpo-lab'\n")
    monkeypatch.delenv(outputs.OUTPUT_ENV, raising=False)
    monkeypatch.chdir(root / "notebooks")           # where a notebook kernel runs
    return root


def test_default_is_the_checkouts_scratch_folder_not_notebooks(checkout):
    p = outputs.output_dir("reward_curves")
    assert p == checkout / "outputs" / "reward_curves" and p.is_dir()
    assert not (checkout / "notebooks" / "results").exists() and not (checkout / "notebooks" / "outputs").exists()


def test_refresh_writes_the_committed_results(checkout):
    assert outputs.output_dir("memory_vs_batch", refresh=True) == checkout / "results" / "memory_vs_batch"


def test_a_relative_choice_is_taken_from_the_root_and_an_absolute_one_as_is(checkout, tmp_path):
    assert outputs.output_dir("x", "my_runs/a") == checkout / "my_runs" / "a"
    assert outputs.output_dir("x", tmp_path / "abs") == tmp_path / "abs"
    assert outputs.output_dir("x", "runs", refresh=True) == checkout / "runs"   # a chosen folder wins


def test_env_variable_moves_the_scratch_folder_but_not_a_refresh(checkout, tmp_path, monkeypatch):
    monkeypatch.setenv(outputs.OUTPUT_ENV, str(tmp_path / "ci"))
    assert outputs.output_dir("fsdp_max_batch") == tmp_path / "ci" / "fsdp_max_batch"
    assert outputs.output_dir("fsdp_max_batch", refresh=True) == checkout / "results" / "fsdp_max_batch"


def test_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(outputs.OUTPUT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert outputs.repo_root() is None
    assert outputs.output_dir("reward_curves") == tmp_path / "grpo_lab_outputs" / "reward_curves"
    with pytest.raises(ValueError, match="REFRESH_RESULTS needs a clone"):
        outputs.output_dir("reward_curves", refresh=True)


def test_a_file_in_the_way_is_a_clear_error(checkout):
    (checkout / "outputs").write_text("")
    with pytest.raises(ValueError, match="cannot make the output folder"):
        outputs.output_dir("reward_curves")
    (checkout / "taken").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        outputs.output_dir("x", "taken")


def test_the_real_checkout_ignores_its_scratch_folder():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert outputs.repo_root(root / "notebooks") == root
    assert "/outputs/" in (root / ".gitignore").read_text().split()
