"""Node-local copies of published adapter versions, for servers that load adapters by local path only.

`AdapterCache` keeps each version, verified (`storage.fetch_adapter`), at `<cache>/<name>-<digest>` until it is
unloaded: keyed by the digest, a copy is never another store's version of the same name, and one that matches is
reused. A default (temporary) cache a SIGKILL left is removed by the next one on that machine (docs/serving.md).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

import psutil

from .storage import fetch_adapter, read_manifest

_OWNED_PREFIX = "grpo-lab-adapters-"
_OWNED = re.compile(rf"^{_OWNED_PREFIX}(\d+)-")


def sweep_orphans(parent: str | os.PathLike | None = None) -> list[str]:
    """Remove the default caches of processes that no longer run (killed before they could clean up)."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for entry in parent.glob(f"{_OWNED_PREFIX}*"):
        m = _OWNED.match(entry.name)
        if m and entry.is_dir() and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def is_remote(path: str) -> bool:
    """A URL a server cannot open as a path (`s3://`, `gs://`, `hf://`, ...); `file://` and plain paths are local."""
    return "://" in path and not path.startswith("file://")


def _folder_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120] or "adapter"


class AdapterCache:
    """One replica's local copies of adapters published on an object store, under `root` (kept on `close`), or by
    default a temporary folder of this process (removed on `close` and at exit)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.owned = root is None
        if self.owned:
            sweep_orphans()
            self.root = Path(tempfile.mkdtemp(prefix=f"{_OWNED_PREFIX}{os.getpid()}-"))
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
        self._held: dict[str, Path] = {}  # adapter name -> its local copy
        self._lock = threading.Lock()  # one download at a time: loads come once per step, and two of one name share
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True) if self.owned else None

    def __repr__(self) -> str:
        return f"AdapterCache({str(self.root)!r})"

    def materialize(self, name: str, url: str) -> Path:
        """The local folder holding the version published at `url`, downloaded and verified if not there yet.
        FileNotFoundError while it has no manifest (the router retries); ValueError on a mismatch."""
        published = read_manifest(url)
        dest = self.root / f"{_folder_name(name)}-{published['digest'][:16]}"
        with self._lock:
            path = fetch_adapter(url, dest, published)
            self._held[name] = path
        return path

    def release(self, name: str) -> bool:
        """Remove the local copy of `name` (after the server unloaded it); False when there was none."""
        with self._lock:
            path = self._held.pop(name, None)
        if path is None:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True

    def close(self) -> None:
        """Remove every copy this cache made (and the folder itself when it is the temporary default)."""
        for name in list(self._held):
            self.release(name)
        if self._finalizer is not None:
            self._finalizer()
