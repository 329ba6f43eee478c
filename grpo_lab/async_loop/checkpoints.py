"""Which checkpoint a resume may start from: the last complete one, never one a kill cut short.

TRL writes `rollout_state.json` first and transformers `trainer_state.json` last, none of it atomically, so a run
killed while saving leaves a folder `get_last_checkpoint` still returns and the resume crashes on. Here a checkpoint
is complete when both JSON files are there and parse; incomplete ones newer than it are named and skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME (that module is heavy), written last
ROLLOUT_STATE = "rollout_state.json"  # TRL's prompt position and adapter version, written first
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


@dataclass
class ResumePoint:
    """The checkpoint to resume from (None: there is none) and the incomplete ones after it, newest first."""

    checkpoint: str | None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (folder, what is wrong with it)

    def describe_skipped(self) -> str:
        return "; ".join(f"{Path(folder).name}: {why}" for folder, why in self.skipped)


def is_checkpoint_name(name: str) -> bool:
    """Whether `name` is a `checkpoint-<step>` folder name."""
    return _CHECKPOINT.match(name) is not None


def checkpoint_step(checkpoint: str | Path) -> int:
    """The global step a `checkpoint-<step>` folder was saved at."""
    return int(_CHECKPOINT.match(Path(checkpoint).name).group(1))


def checkpoint_problem(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from, or None when it is complete."""
    for name in (ROLLOUT_STATE, TRAINER_STATE):
        path = folder / name
        if not path.is_file():
            return f"{name} missing (killed while saving?)"
        try:
            json.loads(path.read_text())
        except (ValueError, OSError) as err:
            return f"{name} unreadable ({err.__class__.__name__}: cut short while saving?)"
    return None


def last_complete_checkpoint(output_dir: str | Path) -> ResumePoint:
    """The newest `checkpoint-N` under `output_dir` whose state files are whole (by step, as transformers orders)."""
    steps = sorted(((int(m.group(1)), p) for p in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
                    if p.is_dir() and (m := _CHECKPOINT.match(p.name))), reverse=True)  # none: no such folder
    skipped = []
    for _, folder in steps:
        problem = checkpoint_problem(folder)
        if problem is None:
            return ResumePoint(str(folder), skipped)
        skipped.append((str(folder), problem))
    return ResumePoint(None, skipped)


def resume_checkpoint(output_dir: str | Path, warn: Callable[[str], object]) -> str:
    """The checkpoint a resume starts from; `warn` hears which incomplete ones were skipped. ValueError (a one-line
    message for the user) when none is complete."""
    point = last_complete_checkpoint(output_dir)
    if point.skipped:
        warn(f"skipping incomplete checkpoints: {point.describe_skipped()}")
    if point.checkpoint is None:
        raise ValueError(f"no complete checkpoint-* folder in {output_dir}")
    return point.checkpoint
