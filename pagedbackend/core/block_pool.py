"""Fixed-size KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block with ref_cnt 0 sits in the free queue. If it still carries a hash it is "cached":
reusable by a prefix hit until it reaches the head of the queue and is handed out again
(lazy LRU eviction). No torch here: the pool only deals in block ids.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence


def hash_block(parent: Optional[bytes], token_ids: Sequence[int],
               salt: Optional[str] = None) -> bytes:
    """Chained, collision-resistant block hash: sha256(parent | tokens | salt)."""
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    if salt is not None:
        h.update(b"salt:" + salt.encode("utf-8"))
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        # Head = next to hand out. Values unused; OrderedDict gives O(1) removal from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # Called as on_evict(block_id, block_hash) before a cached block is handed out again
        # (the host tier keeps a copy: core/host_tier.py)
        self.on_evict: Optional[Callable[[int, bytes], None]] = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + cached-evictable)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found by a prefix hit (pulls them off the free queue)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            if self.on_evict is not None and self.cached.get(self.block_hash[b]) == b:
                self.on_evict(b, self.block_hash[b])
            self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue's tail in the given order."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"block {b} freed twice"
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def uncache(self, block_id: int) -> None:
        """Forget a block's hash (its tokens were registered but will not be computed)."""
        self._evict(block_id)

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None

    def reset_prefix_cache(self) -> None:
        for b in range(self.num_blocks):
            if self.ref_cnt[b] == 0:
                self._evict(b)

    def check_invariants(self) -> dict[str, int]:
        """free + cached-evictable + in-use == total; the cache index agrees with the blocks."""
        in_use = sum(1 for r in self.ref_cnt if r > 0)
        evictable = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        free = len(self.free_queue) - evictable
        assert free + evictable + in_use == self.num_blocks, (free, evictable, in_use)
        assert all(self.ref_cnt[b] == 0 for b in self.free_queue)
        assert all(r >= 0 for r in self.ref_cnt)
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
        return {"free": free, "cached_evictable": evictable, "in_use": in_use,
                "total": self.num_blocks}
