"""Ray replicas' logs copied back to the run's folder, where the run says they are.

A Ray replica's output stays on its node (`ReplicaServer.read_log`), but the async loop names `<output_dir>/logs` as
the place to look. A replica that does not answer is skipped until it does; what a lost node printed after the last
copy is lost with it (docs/clusters.md).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

LOG_NAME = "ray-replica-{index}.log"


class LogMirror:
    """Copies each of `replicas`' (`RayReplicas`) new output to `log_dir` every `interval_s` while running; an actor
    that takes over `timeout_s` is skipped for the round."""

    def __init__(self, replicas, log_dir: str | os.PathLike, interval_s: float = 2.0, timeout_s: float = 5.0):
        self.replicas, self.log_dir = replicas, Path(log_dir)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._seen: dict[int, tuple[str, int]] = {}  # slot index -> (incarnation, bytes copied)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def path(self, index: int) -> Path:
        return self.log_dir / LOG_NAME.format(index=index)

    def start(self) -> LogMirror:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="ray-replica-logs", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.copy()

    def copy(self) -> None:
        """One round: every replica's output since the last round, appended to its file."""
        import ray  # optional (the `ray` extra): only a Ray launcher makes a mirror

        with self._lock:
            for slot in list(self.replicas.slots):
                incarnation, offset = self._seen.get(slot.index, (None, 0))
                try:
                    got, end, text = ray.get(slot.actor.read_log.remote(offset), timeout=self.timeout_s)
                    if got != incarnation and offset:  # restarted: its new server's log starts at 0
                        got, end, text = ray.get(slot.actor.read_log.remote(0), timeout=self.timeout_s)
                    info = ray.get(slot.actor.info.remote(), timeout=self.timeout_s) if got != incarnation else {}
                except Exception as error:  # noqa: BLE001 - dead, restarting or cut off: the next round tries again
                    log.debug("replica %d's log not copied: %s", slot.index, type(error).__name__)
                    continue
                with open(self.path(slot.index), "a", errors="replace") as f:
                    if got != incarnation:
                        f.write(f"--- replica {slot.index}, incarnation {got[:8]} on node {info.get('node_ip')} "
                                f"(its log there: {info.get('log')}) ---\n")
                    f.write(text)
                self._seen[slot.index] = (got, end)

    def stop(self) -> None:
        """Stop copying, after a last round (the replicas are still up: the launcher stops them afterwards)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s * 2)
        try:
            self.copy()
        except Exception as error:  # noqa: BLE001 - Ray already gone: what was copied stays
            log.debug("last copy of the replicas' logs failed: %s", error)
