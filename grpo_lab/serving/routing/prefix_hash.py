"""Chained block hashes of a prompt, the key both the router and the CPU replica's prefix cache use.

vLLM v1 (`kv_cache_utils.py`) caches KV in fixed-size blocks and names each full block by
H(parent hash, block tokens, extra keys), so one hash stands for the whole prefix up to that block. The chain here
is seeded with the adapter name instead of carrying it as an extra key on every block: the effect is the same
(two policies never share a block) and it costs one hash per block. Only full blocks count, and the last prompt
token is left out because vLLM always recomputes it (it needs that token's logits), so a prompt of exactly k
blocks can reuse at most k-1 of them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DEFAULT_BLOCK_SIZE = 16


def namespace_seed(namespace: str) -> int:
    """The chain's first parent for `namespace` (the model or adapter name), stable across processes."""
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], namespace: str = "", block_size: int = DEFAULT_BLOCK_SIZE,
                 cacheable_only: bool = True) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids`, seeded with `namespace` (the adapter the request
    names); `cacheable_only` drops the last token first (vLLM never serves it from cache)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) - 1 if cacheable_only else len(token_ids)
    n_blocks = max(n, 0) // block_size
    if n_blocks == 0:
        return []
    try:
        packed = struct.pack(f"<{n_blocks * block_size}q", *token_ids[: n_blocks * block_size])
    except struct.error as error:
        raise ValueError(f"token ids must be 64-bit integers: {error}") from None
    step = 8 * block_size
    parent = namespace_seed(namespace).to_bytes(8, "little")
    out = []
    for i in range(n_blocks):
        digest = hashlib.blake2b(parent + packed[i * step:(i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = digest
    return out
