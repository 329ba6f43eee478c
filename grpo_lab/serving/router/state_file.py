"""What a restarted router cannot learn from the replicas: which adapters are live and whether generation is paused
(docs/serving.md, "When the router dies").

Adopting a drained adapter the replicas still hold as live would take a `max_loras` slot for good, so the router
writes the live set, its pause state and its runs (token digests, never a token) here at every change, and a router
restarted by `router.process` takes them back. The file is its owner's only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...lab.files import write_atomically


def load_state(path: str | os.PathLike) -> dict | None:
    """The live adapters, pause state and runs a router wrote at `path`; None when there is no file yet."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return {"live_adapters": {str(k): str(v) for k, v in data.get("live_adapters", {}).items()},
            "paused": bool(data.get("paused", False)), "runs": list(data.get("runs", []))}


def write_state(path: str | os.PathLike, live_adapters: dict[str, str], paused: bool,
                runs: list[dict] | None = None) -> None:
    """Write them after each change; a crash mid-write leaves the previous state, never half of one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {"live_adapters": live_adapters, "paused": paused, **({"runs": runs} if runs is not None else {})}
    write_atomically(path, json.dumps(state))  # mkstemp: readable by its owner only
