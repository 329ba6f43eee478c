"""A block-level KV prefix cache for the CPU replica, keyed by the same chained hashes the router computes.

Each entry holds one block's keys and values for every layer, so prompts that share a prefix share entries up to
the first differing block, as in vLLM's paged cache. Hits and queries are counted in tokens, like vLLM's
`prefix_cache_hits` / `prefix_cache_queries`, so the router's affinity shows up on the replicas' `/metrics`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class PrefixKVCache:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, tuple[str, list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self._by_namespace: dict[str, set[int]] = {}  # only blocks still cached, so it stays bounded too
        self._lock = threading.Lock()
        self.query_tokens = 0
        self.hit_tokens = 0

    def lookup(self, hashes: list[int]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per-block KV of the longest cached prefix of `hashes` (each: one (keys, values) per layer)."""
        found = []
        with self._lock:
            for h in hashes:
                entry = self._blocks.get(h)
                if entry is None:
                    break
                self._blocks.move_to_end(h)
                found.append(entry[1])
            self.query_tokens += len(hashes) * self.block_size
            self.hit_tokens += len(found) * self.block_size
        return found

    def store(self, namespace: str, hashes: list[int], layers_kv: list[tuple[torch.Tensor, torch.Tensor]],
              start_block: int) -> None:
        """Cache blocks `start_block..len(hashes)-1` from full-sequence per-layer KV of shape [1, heads, T, dim]."""
        if self.capacity == 0:
            return
        bs = self.block_size
        with self._lock:
            for i in range(start_block, len(hashes)):
                h = hashes[i]
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                self._blocks[h] = namespace, [(k[:, :, i * bs:(i + 1) * bs].clone(),
                                               v[:, :, i * bs:(i + 1) * bs].clone()) for k, v in layers_kv]
                self._by_namespace.setdefault(namespace, set()).add(h)
                while len(self._blocks) > self.capacity:  # the least recently used block goes
                    evicted, (owner, _) = self._blocks.popitem(last=False)
                    self._by_namespace[owner].discard(evicted)
                    if not self._by_namespace[owner]:
                        del self._by_namespace[owner]

    def drop_namespace(self, namespace: str) -> None:
        """Forget an unloaded adapter's blocks, so a later adapter of the same name cannot reuse them."""
        with self._lock:
            for h in self._by_namespace.pop(namespace, set()):
                self._blocks.pop(h, None)

    def __len__(self) -> int:
        return len(self._blocks)
