"""Shared storage for adapter versions: publish atomically, never reuse a name, let replicas find what was published.

`AdapterStore` puts every policy version under one root (a directory or any fsspec URL): renamed into place locally,
on an object store the files first and the manifest (their SHA-256s, the adapter's digest, run id, step) last
(`upload_tree`, `download_tree`: checkpoints follow the same rule); every name is recorded in `<root>/.history/` first
and never reused, so after a resume `trl-policy-v7` cannot mean two weights (docs/serving.md, docs/async_loop.md).
Credentials come from the store's own client (for `s3://`, the `AWS_*` variables), never from arguments, so none
ends up in a command line, a log or a run record. In `serving`: both the trainer and the replicas use it.
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
ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a PEFT adapter
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


def _file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digest(files: dict[str, str]) -> str:
    """One digest for the adapter: the sorted (file, sha256) pairs."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def version_of(name: str, prefix: str) -> int | None:
    m = VERSION_RE.match(name)
    return int(m["version"]) if m and m["prefix"] == prefix else None


def lineage_of(name: str) -> str:
    """`run-a--trl-policy-v7` -> `run-a--trl-policy`: the name less its `-vN` version (itself when it has none)."""
    m = VERSION_RE.match(name)
    return m["prefix"] if m else name


def is_local(fs) -> bool:
    """Whether `fs` is the local file system (renames exist; listings are never stale)."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


# -- files first, manifest last: the object-store publishing rule ----------------------------------------------------
def tree_files(local_dir: str | os.PathLike) -> dict[str, str]:
    """Every file under `local_dir` (relative POSIX path -> SHA-256), sorted; the manifest's `files`."""
    root = Path(local_dir)
    return {p.relative_to(root).as_posix(): _file_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def upload_tree(fs, local_dir: str | os.PathLike, remote_dir: str, manifest: dict,
                manifest_name: str = MANIFEST) -> None:
    """Upload `manifest["files"]` from `local_dir` to `remote_dir`, then the manifest: a reader that finds the manifest
    finds every file it lists (object stores make each object visible whole once its upload returns)."""
    for rel in manifest["files"]:
        fs.put_file(str(Path(local_dir, rel)), posixpath.join(remote_dir, rel))
    fs.pipe_file(posixpath.join(remote_dir, manifest_name), json.dumps(manifest, indent=1).encode())


def read_manifest(url: str, manifest_name: str = MANIFEST) -> dict:
    """The manifest of the tree at `url` (fresh from the store, never from a cached listing); FileNotFoundError
    while there is none (not published yet, or cut short)."""
    fs, path = fsspec.core.url_to_fs(url)
    if not is_local(fs):
        fs.invalidate_cache()
    try:
        return json.loads(fs.cat_file(posixpath.join(path, manifest_name)))
    except FileNotFoundError:
        raise FileNotFoundError(f"No adapter found at {url} (no manifest yet)") from None


def local_copy_matches(dest: str | os.PathLike, files: dict[str, str]) -> bool:
    """`dest` holds exactly `files` with those SHA-256s (extra files aside): a copy that may be used as it is."""
    dest = Path(dest)
    try:
        return all(_file_sha256(dest / rel) == sha for rel, sha in files.items())
    except OSError:
        return False


def download_tree(url: str, dest: str | os.PathLike, manifest: dict, manifest_name: str = MANIFEST) -> Path:
    """Copy the files `manifest` lists from `url` to `dest`, each checked against its SHA-256, the manifest last, in a
    sibling folder renamed into place: `dest` is absent or complete, and a matching copy is kept. ValueError on a
    mismatch."""
    dest = Path(dest)
    if dest.is_dir() and (dest / manifest_name).is_file() and local_copy_matches(dest, manifest["files"]):
        return dest
    fs, path = fsspec.core.url_to_fs(url)
    staging = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    try:
        for rel, sha in manifest["files"].items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(posixpath.join(path, rel), str(target))  # streamed: checkpoints hold large files
            if _file_sha256(target) != sha:
                raise ValueError(f"{url}/{rel} does not match its manifest (sha256 {sha[:12]}...)")
        (staging / manifest_name).write_text(json.dumps(manifest, indent=1))
        if dest.exists():  # a stale or damaged copy: replaced whole
            shutil.rmtree(dest)
        try:
            os.replace(staging, dest)
        except OSError:  # another caller renamed its complete copy into place first
            if not local_copy_matches(dest, manifest["files"]):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


class FolderStore:
    """Folders under one path or fsspec URL, each made whole by a manifest written last: what the adapter store and
    the checkpoint store (`async_loop.checkpoint_store`) share."""

    def __init__(self, url: str | os.PathLike):
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = is_local(self.fs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def _fresh(self) -> None:
        """Forget cached listings: another process (the trainer, a killed publisher) may have written since."""
        if not self.local:
            self.fs.invalidate_cache()

    def _read_json(self, *parts: str) -> dict | None:
        """The JSON file at `<root>/<parts>`; None where there is none."""
        try:
            return json.loads(self.fs.cat_file(self._join(*parts)))
        except FileNotFoundError:
            return None

    def _folders(self) -> list[str]:
        """The names of the folders under the root (hidden ones aside); none before the first publish."""
        self._fresh()
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:  # an object-store prefix exists only once something is written under it
            return []
        return sorted(base for e in entries if e.get("type") == "directory"
                      and not (base := posixpath.basename(e["name"].rstrip("/"))).startswith("."))


class AdapterStore(FolderStore):
    """Adapter versions under `root` (a path or fsspec URL); `replica_root` is what the replicas call it (a bucket's
    mount point on their hosts); `run_id` is recorded in every manifest."""

    def __init__(self, root: str | os.PathLike, replica_root: str | None = None, run_id: str | None = None):
        super().__init__(root)
        if self.local:
            self.root = os.path.abspath(self.root)
            self.fs.makedirs(self._join(HISTORY), exist_ok=True)
        # an object store has no folders to make, and s3fs's makedirs would create a missing bucket: a wrong bucket
        # name must fail at the first write, not quietly start a new bucket
        self.replica_root = replica_root
        self.run_id = run_id or uuid.uuid4().hex[:12]

    # -- where replicas read ----------------------------------------------------------------------------------
    def replica_path(self, name: str) -> str:
        if self.replica_root is not None:
            return posixpath.join(self.replica_root.rstrip("/"), name)
        return self._join(name) if self.local else self.fs.unstrip_protocol(self._join(name))

    # -- publishing ---------------------------------------------------------------------------------------------
    def history(self) -> dict[str, Published]:
        """Every name ever published under this root (deleted versions included)."""
        self._fresh()
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
        return max((v for n in self.history() if (v := version_of(n, prefix)) is not None), default=0)

    def publish(self, local_dir: str | os.PathLike, name: str, *, version: int | None = None,
                step: int | None = None) -> Published:
        """Copy the adapter in `local_dir` to `<root>/<name>` atomically; refuses a name published before."""
        local_dir = Path(local_dir)
        if not (local_dir / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(f"{local_dir} holds no {ADAPTER_CONFIG}: not a PEFT adapter directory")
        self._fresh()
        history_entry = self._join(HISTORY, f"{name}.json")
        if self.fs.exists(history_entry) or self.fs.exists(self._join(name)):
            raise FileExistsError(f"adapter name {name!r} was already published under {self.url}; a name must never "
                                  "be reused for other weights (replicas may still hold the old ones under it)")
        files = {p.name: _file_sha256(p) for p in sorted(local_dir.iterdir()) if p.is_file()}
        manifest = {"name": name, "version": version, "step": step, "run_id": self.run_id, "files": files,
                    "digest": _digest(files), "published_at": time.time()}
        text = json.dumps(manifest, indent=1).encode()
        # the history entry goes first: a crash after it leaves a name that is merely skipped, never one reused
        self.fs.pipe_file(history_entry, text)
        final = self._join(name)
        if self.local:
            staging = self._join(f".{name}.staging-{uuid.uuid4().hex[:8]}")
            shutil.copytree(local_dir, staging)
            Path(staging, MANIFEST).write_bytes(text)
            os.replace(staging, final)
        else:
            upload_tree(self.fs, local_dir, final, manifest)  # the manifest last: its presence means complete
        return Published.from_manifest(manifest)

    # -- reading ------------------------------------------------------------------------------------------------
    def manifest(self, name: str) -> Published | None:
        self._fresh()
        manifest = self._read_json(name, MANIFEST)
        return None if manifest is None else Published.from_manifest(manifest)

    def verify(self, name: str) -> bool:
        """The files under `<root>/<name>` are exactly what its manifest lists."""
        published = self.manifest(name)
        try:
            return published is not None and all(
                hashlib.sha256(self.fs.cat_file(self._join(name, fname))).hexdigest() == sha
                for fname, sha in published.files.items())
        except FileNotFoundError:
            return False

    def published_names(self) -> list[str]:
        """Names whose directory (with a manifest) is present now."""
        return [name for name in self._folders() if self.fs.exists(self._join(name, MANIFEST))]

    def delete(self, name: str) -> None:
        """Remove a version's files (its history entry stays, so the name stays used)."""
        path = self._join(name)
        self._fresh()
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def clean_staging(self) -> int:
        """Remove half-written versions a crash left behind (local `.name.staging-*` folders; on an object store,
        recorded names without a manifest); returns how many. Only where no other process publishes: a version being
        written right now looks the same."""
        if self.local:
            stale = [p for p in self.fs.ls(self.root, detail=False)
                     if ".staging-" in posixpath.basename(p.rstrip("/"))]
        else:
            recorded = set(self.history())
            stale = [self._join(n) for n in self._folders()
                     if n in recorded and not self.fs.exists(self._join(n, MANIFEST))]
        for p in stale:
            self.fs.rm(p, recursive=True)
        return len(stale)


def storage_reachable(url: str) -> None:
    """Raise what the store says (FileNotFoundError, PermissionError, OSError) unless the folder `url` names, or
    on an object store its bucket, can be listed: a missing bucket or refused credentials show before a run starts
    instead of at its first publish."""
    fs, path = fsspec.core.url_to_fs(url)
    local = is_local(fs)
    target = path if local else path.strip("/").split("/", 1)[0]
    if local and not fs.exists(target):
        return  # made at the first publish
    fs.invalidate_cache()
    fs.ls(target, detail=False)


def fetch_adapter(url: str, dest: str | os.PathLike, published: dict | None = None) -> Path:
    """What a replica without the bucket mounted does before loading: `download_tree` of a published adapter.
    FileNotFoundError while it has no manifest yet (the caller retries); `published`: its manifest, if read already."""
    manifest = published if published is not None else read_manifest(url)
    return download_tree(url, dest, manifest)
