"""Shared storage for adapter versions: publish atomically, never reuse a name, let replicas find what was published.

The trainer writes every policy version as a PEFT adapter directory; every replica must then read that directory.
`AdapterStore` puts them under one root — a local or mounted directory, or any fsspec URL (`s3://`, `gs://`,
`memory://` in tests) — with three guarantees:

- **Atomic.** On a local or mounted file system the adapter is written beside its final name and renamed into
  place. On an object store (no rename) the files go first and a manifest with each file's SHA-256 last; a version
  counts as published only once its manifest is there and the files match it.
- **Names are never reused.** Every published name is also recorded in `<root>/.history/` (never deleted), and
  publishing a recorded name is refused: after a crash and resume, `trl-policy-v7` can never mean two different
  weights, which is how a replica would otherwise keep serving the killed run's weights under a reused name.
- **Content identity.** The manifest carries a digest of the whole adapter, the run id and the training step, so a
  replica (or a test) can check that what it loaded is what the trainer published.

`replica_path(name)` is the path handed to `/v1/load_lora_adapter`: the local path for local roots, the mount point
given as `replica_root` for a mounted bucket, else the URL itself (the CPU replica fetches fsspec URLs; vLLM needs a
path on its own file system, i.e. a mount).

It lives in `serving` because both sides use it: the trainer (`async_loop`) publishes through it, and the replicas
read what it published (`generation.Engine` fetches fsspec URLs with `fetch_adapter`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec

log = logging.getLogger(__name__)

MANIFEST = "grpo_lab_manifest.json"
HISTORY = ".history"
VERSION_RE = re.compile(r"^(?P<prefix>.+)-v(?P<version>\d+)$")


@dataclass(frozen=True)
class Published:
    """One published adapter version, as its manifest describes it."""

    name: str
    version: int | None
    digest: str
    run_id: str
    step: int | None
    files: dict

    @classmethod
    def from_manifest(cls, data: dict) -> "Published":
        return cls(data["name"], data.get("version"), data["digest"], data.get("run_id", ""), data.get("step"),
                   data.get("files", {}))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _digest(files: dict[str, str]) -> str:
    """One digest for the adapter: the sorted (file, sha256) pairs."""
    return _sha256(json.dumps(sorted(files.items())).encode())


def version_of(name: str, prefix: str) -> int | None:
    m = VERSION_RE.match(name)
    return int(m["version"]) if m and m["prefix"] == prefix else None


class AdapterStore:
    """Adapter versions under `root` (a path or fsspec URL).

    Args:
        root: where adapters are published; a local path, `file://...`, or any fsspec URL.
        replica_root: what the replicas call `root` (the mount point of a bucket on their hosts); default: `root`.
        run_id: recorded in every manifest (which trainer process published it).
    """

    def __init__(self, root: str | os.PathLike, replica_root: str | None = None, run_id: str | None = None):
        self.url = str(root)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        if self.local:
            self.root = os.path.abspath(self.root)
        self.replica_root = replica_root
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.fs.makedirs(self._join(HISTORY), exist_ok=True)

    def __repr__(self) -> str:
        return f"AdapterStore({self.url!r})"

    def _join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts) if self.local else posixpath.join(self.root, *parts)

    # -- where replicas read ----------------------------------------------------------------------------------
    def replica_path(self, name: str) -> str:
        if self.replica_root is not None:
            return posixpath.join(self.replica_root.rstrip("/"), name)
        if self.local:
            return self._join(name)
        return f"{self.fs.unstrip_protocol(self._join(name))}"

    # -- publishing ---------------------------------------------------------------------------------------------
    def history(self) -> dict[str, Published]:
        """Every name ever published under this root (deleted versions included)."""
        out = {}
        for path in self.fs.glob(self._join(HISTORY, "*.json")):
            try:
                entry = Published.from_manifest(json.loads(self.fs.cat_file(path)))
            except (ValueError, KeyError) as error:
                log.warning("unreadable history entry %s: %s", path, error)
                continue
            out[entry.name] = entry
        return out

    def highest_version(self, prefix: str) -> int:
        """The largest N ever published as `<prefix>-vN` (0 if none)."""
        versions = [version_of(n, prefix) for n in self.history()]
        return max([v for v in versions if v is not None], default=0)

    def publish(self, local_dir: str | os.PathLike, name: str, *, version: int | None = None,
                step: int | None = None) -> Published:
        """Copy the adapter in `local_dir` to `<root>/<name>` atomically; refuses a name published before."""
        local_dir = Path(local_dir)
        if not (local_dir / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{local_dir} holds no adapter_config.json: not a PEFT adapter directory")
        history_entry = self._join(HISTORY, f"{name}.json")
        if self.fs.exists(history_entry) or self.fs.exists(self._join(name)):
            raise FileExistsError(f"adapter name {name!r} was already published under {self.url}; a name must never "
                                  "be reused for other weights (replicas may still hold the old ones under it)")
        files = {p.name: _sha256(p.read_bytes()) for p in sorted(local_dir.iterdir()) if p.is_file()}
        manifest = {"name": name, "version": version, "step": step, "run_id": self.run_id, "files": files,
                    "digest": _digest(files), "published_at": time.time()}
        text = json.dumps(manifest, indent=1).encode()
        # the history entry goes first: a crash after it leaves a name that is merely skipped, never one reused
        self.fs.pipe_file(history_entry, text)
        final = self._join(name)
        if self.local:
            staging = self._join(f".{name}.staging-{uuid.uuid4().hex[:8]}")
            shutil.copytree(local_dir, staging)
            with open(os.path.join(staging, MANIFEST), "wb") as f:
                f.write(text)
            os.replace(staging, final)
        else:
            for fname in files:
                self.fs.put_file(str(local_dir / fname), self._join(name, fname))
            self.fs.pipe_file(self._join(name, MANIFEST), text)  # last: its presence means complete
        return Published.from_manifest(manifest)

    # -- reading ------------------------------------------------------------------------------------------------
    def manifest(self, name: str) -> Published | None:
        path = self._join(name, MANIFEST)
        if not self.fs.exists(path):
            return None
        return Published.from_manifest(json.loads(self.fs.cat_file(path)))

    def verify(self, name: str) -> bool:
        """The files under `<root>/<name>` are exactly what its manifest lists."""
        published = self.manifest(name)
        if published is None:
            return False
        for fname, sha in published.files.items():
            path = self._join(name, fname)
            if not self.fs.exists(path) or _sha256(self.fs.cat_file(path)) != sha:
                return False
        return True

    def published_names(self) -> list[str]:
        """Names whose directory (with a manifest) is present now."""
        out = []
        for entry in self.fs.ls(self.root, detail=False):
            base = posixpath.basename(entry.rstrip("/"))
            if not base.startswith(".") and self.fs.exists(self._join(base, MANIFEST)):
                out.append(base)
        return sorted(out)

    def delete(self, name: str) -> None:
        """Remove a version's files (its history entry stays, so the name stays used)."""
        path = self._join(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def clean_staging(self) -> int:
        """Remove half-written versions a crash left behind (local roots); returns how many."""
        if not self.local:
            return 0
        stale = [p for p in self.fs.ls(self.root, detail=False)
                 if ".staging-" in posixpath.basename(p.rstrip("/"))]
        for p in stale:
            self.fs.rm(p, recursive=True)
        return len(stale)


def storage_reachable(url: str) -> None:
    """Raise what the store says (FileNotFoundError, PermissionError, OSError) unless the folder `url` names, or
    on an object store its bucket, can be listed: a missing bucket or refused credentials show before a run starts
    instead of at its first publish."""
    fs, path = fsspec.core.url_to_fs(url)
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    target = path if local else path.strip("/").split("/", 1)[0]
    if local and not fs.exists(target):
        return  # made at the first publish
    fs.invalidate_cache()
    fs.ls(target, detail=False)


def fetch_adapter(url: str, dest: str | os.PathLike) -> Path:
    """Download a published adapter (an fsspec URL) to `dest`, checking it against its manifest.

    What a replica without the bucket mounted does before loading; raises FileNotFoundError while the version is
    not complete (no manifest yet — the caller retries, like a lagging mount) and ValueError on a digest mismatch."""
    fs, path = fsspec.core.url_to_fs(url)
    manifest_path = posixpath.join(path, MANIFEST)
    if not fs.exists(manifest_path):
        raise FileNotFoundError(f"No adapter found at {url} (no manifest yet)")
    published = Published.from_manifest(json.loads(fs.cat_file(manifest_path)))
    dest = Path(dest)
    staging = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    for fname, sha in published.files.items():
        data = fs.cat_file(posixpath.join(path, fname))
        if _sha256(data) != sha:
            raise ValueError(f"{url}/{fname} does not match its manifest (sha256 {sha[:12]}...)")
        (staging / fname).write_bytes(data)
    (staging / MANIFEST).write_text(json.dumps(published.__dict__))
    os.replace(staging, dest)
    return dest
