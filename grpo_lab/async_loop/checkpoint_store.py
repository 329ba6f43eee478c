"""Checkpoints on an object store: each complete one published as it is saved, the last complete one pulled back.

A trainer on a machine that can vanish (preemption, a requeue elsewhere) loses its local `checkpoint-N` folders with
the disk. With `checkpoint_storage` set, each checkpoint that was complete locally is copied to
`<checkpoint_storage>/checkpoint-N/` once saved, by the adapters' rule (files first, a SHA-256 manifest last), with
the run's log as of its step (`run_dir.RUN_LOG_DIR`). On a fresh machine `pull_last_checkpoint` downloads the newest
complete one (damaged ones named and skipped) and restores the run's log, so `--resume` goes on from the whole run.
A step published again after a resume loses its manifest first: a kill leaves an incomplete folder, never a mix.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..serving.adapters.storage import FolderStore, download_tree, tree_files, upload_tree
from .checkpoints import (ROLLOUT_STATE, TRAINER_STATE, ResumePoint, checkpoint_step, is_checkpoint_name,
                          last_complete_checkpoint)
from .checkpoints import checkpoint_problem as local_problem
from .checks import first_line
from .run_dir import restore_run_log, snapshot_run_log

log = logging.getLogger(__name__)

CHECKPOINT_MANIFEST = "grpo_lab_checkpoint.json"


@dataclass
class Pulled(ResumePoint):
    """What `pull_last_checkpoint` did: the local checkpoint to resume from (None: none anywhere), the published ones
    it skipped, newest first (folder, why), whether it was downloaded, and the run's log files it brought back
    (`run_dir.restore_run_log`)."""

    downloaded: bool = False
    restored: list[str] = field(default_factory=list)


class CheckpointStore(FolderStore):
    """`checkpoint-N` folders under `url` (any fsspec URL or path), each with a manifest written last."""

    def __init__(self, url: str):
        super().__init__(url)
        if self.local:  # a local folder has parents to make (an object store has none): every file's, on upload
            self.fs = fsspec.filesystem("file", auto_mkdir=True)

    def _manifest(self, name: str) -> dict | None:
        return self._read_json(name, CHECKPOINT_MANIFEST)

    def folders(self) -> list[str]:
        """The `checkpoint-N` folders on the store, newest (highest N) first, complete or not."""
        return sorted(filter(is_checkpoint_name, self._folders()), key=checkpoint_step, reverse=True)

    def published(self) -> list[str]:
        """The complete ones (manifest present, naming both state files), newest first."""
        return [n for n in self.folders() if _published_problem(self._manifest(n)) is None]

    def publish(self, folder: str | Path) -> dict:
        """Copy the local checkpoint `folder` to `<url>/<folder name>`, the manifest last; returns the manifest.
        ValueError for a folder that is not a complete checkpoint (nothing is written then)."""
        folder = Path(folder)
        if not is_checkpoint_name(folder.name):
            raise ValueError(f"{folder} is not a {PREFIX_CHECKPOINT_DIR}-<step> folder")
        problem = local_problem(folder) if folder.is_dir() else "no such folder"
        if problem is not None:
            raise ValueError(f"{folder} is not a complete checkpoint ({problem}): not published")
        remote = self._join(folder.name)
        self._fresh()
        if self.fs.exists(remote):  # a step saved again after a resume: unpublish first, then replace
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._join(folder.name, CHECKPOINT_MANIFEST))
            self.fs.rm(remote, recursive=True)
        manifest = {"checkpoint": folder.name, "step": checkpoint_step(folder), "files": tree_files(folder),
                    "published_at": time.time()}
        upload_tree(self.fs, folder, remote, manifest, CHECKPOINT_MANIFEST)
        return manifest

    def prune(self, keep: int) -> list[str]:
        """Keep the `keep` newest complete checkpoints (transformers' `save_total_limit`), and remove the older ones
        and incomplete ones older than the newest complete one; returns the names removed. Only the trainer's own
        callback publishes, before this, so no folder is being written meanwhile."""
        complete = self.published()
        if keep <= 0 or not complete:
            return []
        kept = set(complete[:keep])
        newest = checkpoint_step(complete[0])
        doomed = [n for n in self.folders() if n not in kept and checkpoint_step(n) < newest]
        for name in doomed:
            self.fs.rm(self._join(name), recursive=True)
        return doomed

    def pull_last(self, output_dir: str | Path, warn: Callable[[str], object] | None = None) -> Pulled:
        """Make the newest complete checkpoint on the store a local `output_dir/checkpoint-N` (unless `output_dir`
        already holds a complete one as new), with the run's log it carries where `output_dir` lacks that history;
        `warn` hears which published ones were skipped and why."""
        output_dir = Path(output_dir)
        local = last_complete_checkpoint(output_dir).checkpoint
        local_step = checkpoint_step(local) if local else -1
        skipped: list[tuple[str, str]] = []
        pulled = Pulled(local, skipped=skipped)
        for name in self.folders():
            if checkpoint_step(name) <= local_step:
                break
            manifest = self._manifest(name)
            problem = _published_problem(manifest)
            if problem is None:
                try:
                    download_tree(self.fs.unstrip_protocol(self._join(name)), output_dir / name, manifest,
                                  CHECKPOINT_MANIFEST)
                except (ValueError, OSError) as error:
                    problem = f"download failed ({type(error).__name__}: {error})"
                else:
                    pulled.checkpoint, pulled.downloaded = str(output_dir / name), True
                    pulled.restored = restore_run_log(pulled.checkpoint, output_dir)
                    break
            skipped.append((name, problem))
        if skipped and warn is not None:
            warn(f"skipping incomplete published checkpoints: {pulled.describe_skipped()}")
        return pulled


def _published_problem(manifest: dict | None) -> str | None:
    """Why a published checkpoint cannot be resumed from, or None."""
    if manifest is None:
        return "no manifest (publishing cut short?)"
    missing = [f for f in (ROLLOUT_STATE, TRAINER_STATE) if f not in manifest.get("files", {})]
    return f"{', '.join(missing)} not in it" if missing else None


def pull_last_checkpoint(url: str, output_dir: str | Path, warn: Callable[[str], object] | None = None) -> Pulled:
    """The last complete checkpoint published under `url`, downloaded into `output_dir` for a resume on a machine
    that does not have it (see `CheckpointStore.pull_last`)."""
    return CheckpointStore(url).pull_last(output_dir, warn)


class CheckpointPublishError(RuntimeError):
    """A checkpoint could not be published to the checkpoint store: the run stops, since a resume elsewhere would
    not find it."""


class PublishCheckpoints(TrainerCallback):
    """Publishes each checkpoint just saved to `store` (main process only) with the run's log as of that step, then
    prunes to `save_total_limit`. A store that refuses `attempts` times (`retry_s` apart, doubling) stops the run
    (`CheckpointPublishError`): a run "succeeding" without its checkpoints would leave nothing to resume from."""

    def __init__(self, store: CheckpointStore, attempts: int = 3, retry_s: float = 1.0):
        self.store = store
        self.attempts, self.retry_s = attempts, retry_s
        self.published: list[str] = []

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        t0 = time.perf_counter()
        for attempt in range(1, self.attempts + 1):
            try:
                snapshot_run_log(args.output_dir, folder, state.global_step)
                self.store.publish(folder)
                if args.save_total_limit:
                    self.store.prune(args.save_total_limit)
                break
            except (OSError, ValueError) as error:
                if attempt == self.attempts:
                    raise CheckpointPublishError(
                        f"could not publish {folder.name} to the checkpoint store {self.store.url} after {attempt} "
                        f"tries ({type(error).__name__}: {first_line(error)}); the local copy is in {folder}"
                    ) from error
                log.warning("publishing %s to %s failed (%s: %s); trying again", folder.name, self.store.url,
                            type(error).__name__, error)
                time.sleep(self.retry_s * 2 ** (attempt - 1))
        self.published.append(folder.name)
        log.info("published %s to %s in %.1fs", folder.name, self.store.url, time.perf_counter() - t0)
