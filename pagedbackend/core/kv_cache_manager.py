"""Per-request block tables on top of the BlockPool, with automatic prefix caching.

`get_computed_blocks` looks a waiting request's prompt up in the cache without changing state;
`allocate_slots` either grows the request's table for its next tokens or returns None (nothing
changed) — the scheduler's check/action pair.
"""
from __future__ import annotations

from typing import Optional

from pagedbackend.core.block_pool import BlockPool, hash_block
from pagedbackend.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}   # leading blocks already registered
        self.prefix_cache_queries = 0   # tokens looked up (vLLM counts tokens)
        self.prefix_cache_hits = 0      # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover the full blocks among its first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else None
            salt = req.cache_salt if i == 0 else None
            req.block_hashes.append(hash_block(parent, req.all_token_ids[i * bs:(i + 1) * bs], salt))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, never covering the last token (it must be run)."""
        if not self.enable_caching or req.skip_prefix_cache:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, max_blocks * self.block_size)
        hits = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    def can_allocate(self, req: Request, num_new_tokens: int,
                     computed_blocks: tuple[int, ...] | list[int] = ()) -> bool:
        return self._fits(self._num_new_blocks(req, num_new_tokens, computed_blocks),
                          computed_blocks)

    def _fits(self, n_new: int, computed_blocks) -> bool:
        # Touching a cached-evictable block takes it off the free queue too.
        evictable = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        return n_new <= self.pool.num_free_blocks - evictable

    def _num_new_blocks(self, req, num_new_tokens, computed_blocks) -> int:
        have = len(self.req_blocks.get(req.request_id, ())) + len(computed_blocks)
        start = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = -(-(start + num_new_tokens) // self.block_size)
        return max(0, need - have)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: tuple[int, ...] | list[int] = ()) -> Optional[list[int]]:
        """Make room for the next num_new_tokens of req (after its computed prefix).

        Returns the newly allocated block ids, or None if they do not fit (state untouched).
        Blocks that become full with these tokens are registered in the prefix cache right
        away: their K/V are written earlier in the same forward pass than any reader's attention.
        """
        n_new = self._num_new_blocks(req, num_new_tokens, computed_blocks)
        if not self._fits(n_new, computed_blocks):
            return None
        self.pool.touch(computed_blocks)
        new = self.pool.allocate(n_new)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(new)
        if self.enable_caching:
            end = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
            # Only blocks whose tokens are all known: a pending (in-flight) token's block is
            # registered by a later call, once the token has landed.
            end = min(end, req.num_tokens)
            full = end // self.block_size
            done = self.num_cached_blocks.get(req.request_id, 0)
            if full > done:
                self._update_hashes(req, end)
                for i in range(done, full):
                    self.pool.cache_block(blocks[i], req.block_hashes[i])
                self.num_cached_blocks[req.request_id] = full
        return new

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first num_tokens tokens (rejected draft tokens'
        slots); never a block registered in the prefix cache (only verified tokens are)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = max(-(-num_tokens // self.block_size), self.num_cached_blocks.get(req.request_id, 0))
        if blocks and len(blocks) > keep:
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, req: Request) -> None:
        # Tail blocks first, so the least reusable (deepest) prefix blocks are evicted first.
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free(reversed(blocks))

    def restore_slots(self, req: Request, num_blocks: int, num_new_tokens: int,
                      cached: list[int] = ()) -> Optional[list[int]]:
        """A swapped-in request (no table, num_computed_tokens kept): its num_blocks saved
        blocks, the leading ones from `cached` (blocks the prefix cache still holds) and the
        rest fresh, then room for its next num_new_tokens. Returns the fresh blocks (to copy
        its KV into), or None (nothing changed) if they do not fit."""
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(cached)
        if req.request_id in self.req_blocks or not self._fits(need, cached):
            return None
        self.pool.touch(cached)
        blocks = self.pool.allocate(num_blocks - len(cached))
        self.req_blocks[req.request_id] = list(cached) + blocks
        self.allocate_slots(req, num_new_tokens)    # registers its full blocks again too
        return blocks

    def uncache_uncomputed(self, req: Request) -> None:
        """Before freeing a request preempted in the step that registered blocks for tokens it
        will now not compute: those blocks must not be found by their hash."""
        blocks = self.req_blocks.get(req.request_id, [])
        done = self.num_cached_blocks.get(req.request_id, 0)
        first = req.num_computed_tokens // self.block_size
        for i in range(first, done):
            if self.pool.block_hash[blocks[i]] == req.block_hashes[i]:
                self.pool.uncache(blocks[i])
        if done > first:
            self.num_cached_blocks[req.request_id] = first

    def check_invariants(self, idle: bool = False) -> dict[str, int]:
        counts = self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b] += 1
        assert refs == self.pool.ref_cnt, "block reference counts disagree with block tables"
        if idle:
            assert counts["in_use"] == 0 and not self.req_blocks, counts
        return counts
