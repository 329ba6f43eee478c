"""What a restarted router cannot learn from the replicas: which adapters are live and whether generation is paused.

The replicas' adapters alone cannot say which are live: one the trainer already unloaded may still be held while it
drains, and adopting it would take a `max_loras` slot for good (the trainer never unloads a name twice). So the router
writes the live set and its pause state here at every change, and a router restarted by `router.process` takes them
back. A router shared by several runs writes its runs too (`RunRegistry.snapshot`: token digests, never a token), so
their tokens keep working across its restart; the file is its owner's only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...lab.files import write_atomically


class RouterStateFile:
    """`save(live_adapters, paused)` after each change; `load()` at start (None when there is no file yet)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        return {"live_adapters": {str(k): str(v) for k, v in data.get("live_adapters", {}).items()},
                "paused": bool(data.get("paused", False)), "runs": list(data.get("runs", []))}

    def save(self, live_adapters: dict[str, str], paused: bool, runs: list[dict] | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {"live_adapters": live_adapters, "paused": paused, **({"runs": runs} if runs is not None else {})}
        # a crash mid-write leaves the previous state, never half of one
        write_atomically(self.path, json.dumps(state))  # mkstemp: readable by its owner only
