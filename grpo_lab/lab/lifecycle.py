"""The `with` protocol of everything that starts processes or threads and must stop them: replicas, the cluster of
replicas and router, a loop, a shared pool. Written once so every one of them stops on the way out of a `with`,
whatever was raised inside it."""

from __future__ import annotations

from typing import Self


class StartStop:
    """`with thing:` runs `thing.start()` (which returns `thing`) and `thing.stop()` on the way out."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
