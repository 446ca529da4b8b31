"""Host-tier KV blocks (the `swap_space` GiB of pinned host memory): ids only, no torch.

A host block is free, owned (reference count > 0: a swapped-out request's KV, or held while a
step's copy of it is in flight), or cached: a prefix block evicted from the GPU pool, found by
its block hash (the GPU prefix cache's hash, salt included). Cached blocks with no reference
are evicted least recently used first when a block is needed. Free ids are handed out lowest
first, so a step's blocks tend to be contiguous and the worker copies them in few runs.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable, Optional


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is invalid: must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        self._free = list(range(num_blocks))          # a heap: lowest id first
        self._lru: OrderedDict[bytes, int] = OrderedDict()   # oldest first
        self._held_cached = 0                         # cached blocks with a reference

    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._lru) - self._held_cached

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding KV someone needs: owned and referenced (cached ones are reusable)."""
        return self.num_blocks - self.num_available

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def lookup(self, block_hash: bytes) -> Optional[int]:
        return self._lru.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """A cached block was used: it becomes the most recently used."""
        self._lru.move_to_end(block_hash)

    def allocate(self, n: int) -> Optional[list[int]]:
        """n blocks with one reference each, evicting cached ones as needed; None (nothing
        changed) if fewer than n are available."""
        if n > self.num_available:
            return None
        out = []
        while len(out) < n:
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b = self._evict_one()
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def _evict_one(self) -> int:
        for h, b in self._lru.items():
            if self.ref_cnt[b] == 0:
                del self._lru[h]
                self.block_hash[b] = None
                return b
        raise RuntimeError("no host block to evict")      # num_available said there was one

    def hold(self, block_ids: Iterable[int]) -> None:
        """Take one more reference each (a cached block read by a copy in flight)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0 and self.block_hash[b] is not None:
                self._held_cached += 1
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; a block reaching 0 is free again, or stays cached."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, f"host block {b} freed twice"
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    heapq.heappush(self._free, b)
                else:
                    self._held_cached -= 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Register a block the caller holds under its hash (as the most recently used)."""
        assert self.ref_cnt[block_id] > 0 and self.block_hash[block_id] is None
        assert block_hash not in self._lru
        self.block_hash[block_id] = block_hash
        self._lru[block_hash] = block_id
        self._held_cached += 1

    def check_invariants(self) -> dict[str, int]:
        """free + cached + owned == total, and the indexes agree with the blocks."""
        cached = set(self._lru.values())
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is free twice"
        assert not free & cached
        owned = [b for b in range(self.num_blocks) if b not in cached and b not in free]
        assert all(self.ref_cnt[b] > 0 for b in owned), "a host block is lost"
        assert all(self.ref_cnt[b] == 0 for b in free)
        for h, b in self._lru.items():
            assert self.block_hash[b] == h
        assert self._held_cached == sum(1 for b in cached if self.ref_cnt[b] > 0)
        assert all(self.block_hash[b] is None for b in owned + list(free))
        return {"free": len(free), "cached": len(cached), "owned": len(owned),
                "total": self.num_blocks}
