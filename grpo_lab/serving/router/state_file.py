"""What a restarted router cannot learn from the replicas: which adapters are live and whether generation is paused.

A router that dies (a crash, `kill -9`) is restarted on the same port by its supervisor (`router.process`). It then
rebuilds the rest from the replicas (`/v1/models`: what each holds, re-admitted like any restarted replica), but the
replicas' adapters alone cannot say which are live: an adapter the trainer had already unloaded may still be held
while it drained, and adopting it as live would take one of every replica's `max_loras` slots for good (the trainer
never unloads a name twice). So the router writes the live set and its pause state here at every change (a small
JSON file, replaced atomically), and a router started with a file that exists takes them from it: adapters the
replicas hold beyond the live set are unloaded at admission, live ones they lack are loaded. A router shared by
several runs (`serve-pool`) writes its runs too (`tenancy.runs.RunRegistry.snapshot`: names, shares, pause state
and token digests, never a token), so their tokens keep working across its restart; the file is its owner's only.
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
