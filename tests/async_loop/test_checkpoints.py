"""A resume starts from the last complete checkpoint: one a kill cut short while saving is named and skipped."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from grpo_lab.async_loop import command, launch
from grpo_lab.async_loop.checkpoints import ROLLOUT_STATE, TRAINER_STATE, last_complete_checkpoint, resume_checkpoint


def _checkpoint(root: Path, step: int, *, rollout=True, trainer: str | None = "{}") -> Path:
    """What TRL + transformers leave: rollout_state.json first, the adapter, trainer_state.json last."""
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if rollout:
        (folder / ROLLOUT_STATE).write_text(json.dumps({"prompt_index": step * 2, "model_version": step}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    if trainer is not None:
        (folder / TRAINER_STATE).write_text(trainer)
    return folder


def test_the_newest_complete_checkpoint_by_step_number(tmp_path):
    for step in (3, 9, 10):  # 10 after 9: by number, not by name
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-11.tmp").mkdir()  # not a checkpoint name
    (tmp_path / "checkpoint-12").write_text("a file, not a folder")
    point = last_complete_checkpoint(tmp_path)
    assert point.checkpoint == str(tmp_path / "checkpoint-10") and point.skipped == []


@pytest.mark.parametrize("cut,why", [
    (dict(trainer=None), "trainer_state.json missing"),
    (dict(trainer='{"global_step": 1'), "trainer_state.json unreadable"),
    (dict(rollout=False), "rollout_state.json missing"),
])
def test_a_checkpoint_cut_short_is_skipped_and_named(tmp_path, cut, why):
    _checkpoint(tmp_path, 6)
    _checkpoint(tmp_path, 9, **cut)
    point = last_complete_checkpoint(tmp_path)
    assert point.checkpoint == str(tmp_path / "checkpoint-6")
    assert [Path(folder).name for folder, _ in point.skipped] == ["checkpoint-9"]
    assert why in point.describe_skipped() and point.describe_skipped().startswith("checkpoint-9: ")


def test_nothing_to_resume_from(tmp_path):
    assert last_complete_checkpoint(tmp_path / "missing").checkpoint is None
    assert last_complete_checkpoint(tmp_path).checkpoint is None
    _checkpoint(tmp_path, 3, trainer=None)
    point = last_complete_checkpoint(tmp_path)
    assert point.checkpoint is None and len(point.skipped) == 1


def test_the_command_says_what_it_skips_and_stops_cleanly_without_a_complete_one(tmp_path, capsys):
    _checkpoint(tmp_path, 3, trainer=None)
    sigterm = signal.getsignal(signal.SIGTERM)
    assert command.main(["--resume", "--output-dir", str(tmp_path)]) == 2
    assert signal.getsignal(signal.SIGTERM) is sigterm  # a refused resume changes nothing in the calling process
    err = capsys.readouterr().err
    assert "skipping incomplete checkpoints: checkpoint-3: trainer_state.json missing" in err
    assert "error: --resume: no complete checkpoint-* folder" in err and "Traceback" not in err


def test_train_with_resume_true_resolves_before_starting_anything(tmp_path):
    _checkpoint(tmp_path, 3, rollout=False)
    args = launch.embedded_trainer_args(str(tmp_path), max_steps=1, save_strategy="no")
    loop = launch.AsyncLoop(launch.LoopConfig(router_url="http://127.0.0.1:9"), args, progress=False)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        loop.train(resume_from_checkpoint=True)
    assert loop.trainer is None and loop.cluster is None  # nothing was started


def test_resume_checkpoint_warns_about_what_it_skips(tmp_path):
    _checkpoint(tmp_path, 6)
    _checkpoint(tmp_path, 7, trainer=None)
    heard = []
    assert resume_checkpoint(tmp_path, heard.append) == str(tmp_path / "checkpoint-6")
    assert heard == ["skipping incomplete checkpoints: checkpoint-7: trainer_state.json missing (killed while saving?)"]
