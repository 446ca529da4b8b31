"""The host tier's bookkeeping for the scheduler (no torch): swap on preemption, offload of
evicted prefix blocks, and the copies each step hands the runner.

Swap: a preempted request's computed blocks are copied to host blocks it then owns; when it is
swapped back in it gets fresh GPU blocks and the copies back. Offload: a full, hashed GPU block
evicted from the prefix cache is copied to a host block cached under the same hash (LRU); a
later admission whose prefix continues on the host copies those blocks in instead of computing
them. Which preempted request swaps is decided by `PreemptionCost` (mode auto).

Ordering (what makes a block never read before its copy lands): a step's copies run before its
forward pass, swap-outs before swap-ins, after everything launched earlier (worker/host_kv.py).
So a GPU block freed by a swap-out may be reused in the same step (by a swap-in or by the
forward's writes), and a host block written by an offload may be read back in the same step.
A host block read by a swap-in is released only at the next step, so no swap-out of the same
step overwrites it first. A step that schedules nothing passes its copies on to the next one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedbackend.core.host_pool import HostBlockPool
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.core.request import Request


@dataclass(frozen=True)
class PreemptionCost:
    """Estimated seconds to bring a preempted context of n tokens back, for mode auto:
    recompute(n) = n * prefill_s_per_token + n^2 * attention_s_per_token2 (the prefill's
    matmuls and its causal attention), swap(n) = swap_s_fixed + n * swap_s_per_token (its KV
    over the host link both ways, plus a fixed cost per swap). Swap when it is cheaper: short
    contexts recompute, long ones swap. worker/host_kv.preemption_cost fills it in from the
    model's shape and the device."""
    prefill_s_per_token: float
    attention_s_per_token2: float
    swap_s_per_token: float
    swap_s_fixed: float

    def recompute_s(self, n: int) -> float:
        return n * self.prefill_s_per_token + n * n * self.attention_s_per_token2

    def swap_s(self, n: int) -> float:
        return self.swap_s_fixed + n * self.swap_s_per_token

    def prefers_swap(self, n: int) -> bool:
        return self.swap_s(n) < self.recompute_s(n)


class HostTier:
    def __init__(self, kv: KVCacheManager, num_host_blocks: int, mode: str,
                 cost: Optional[PreemptionCost] = None):
        if mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode={mode!r} is invalid: must be recompute, swap "
                             "or auto")
        if mode == "auto" and cost is None:
            raise ValueError("preemption_mode='auto' needs a PreemptionCost")
        self.kv = kv
        self.block_size = kv.block_size
        self.pool = HostBlockPool(num_host_blocks)
        self.mode = mode
        self.cost = cost
        self.host_blocks: dict[str, list[int]] = {}   # swapped-out request -> its host blocks
        self._swap_out: list[tuple[int, int]] = []   # (GPU block, host block), not yet handed
        self._swap_in: list[tuple[int, int]] = []
        self._held: list[int] = []       # host refs of this step's copies, until handed out
        self._release: list[int] = []    # host refs of the copies handed out last step
        self.num_swap_out_blocks = 0
        self.num_swap_in_blocks = 0
        self.prefix_queries = 0          # tokens looked up on the host (GPU-cache misses)
        self.prefix_hits = 0             # tokens found there
        self.preemptions = {"swap": 0, "recompute": 0}
        if kv.enable_caching:
            kv.pool.on_evict = self._offload

    # -- step boundaries ---------------------------------------------------------------------
    def begin_step(self) -> None:
        """The copies handed out last step are queued ahead of anything this step does."""
        self.pool.free(self._release)
        self._release = []

    def end_step(self, out) -> None:
        """Hand this step's copies to the runner with `out`, or keep them for the next step if
        it runs nothing (they must still run before any later forward)."""
        if not out.scheduled:
            return
        out.blocks_to_swap_out, self._swap_out = self._swap_out, []
        out.blocks_to_swap_in, self._swap_in = self._swap_in, []
        self._release, self._held = self._held, []

    # -- swap on preemption ------------------------------------------------------------------
    def swap_out(self, req: Request) -> bool:
        """Preempt req by swapping, if its mode, its cost and the host tier's room say so:
        its computed blocks go to host blocks it owns and its GPU blocks are freed. False:
        nothing changed (the caller recomputes)."""
        n_tokens = req.num_computed_tokens
        n_blocks = -(-n_tokens // self.block_size)
        if (self.mode == "recompute" or n_blocks == 0
                or self.mode == "auto" and not self.cost.prefers_swap(n_tokens)):
            return False
        # A full block whose hash the host holds already is not copied again: the request takes
        # a reference on that copy. Its other full blocks are cached under their hashes too, so
        # that their later eviction from the GPU pool copies nothing, and once the request is
        # back (or gone) they serve prefix hits.
        hashes = [self.kv.enable_caching and i < len(req.block_hashes)
                  and i < n_tokens // self.block_size and req.block_hashes[i] or None
                  for i in range(n_blocks)]
        found = [self.pool.lookup(h) if h else None for h in hashes]
        reused = [b for b in found if b is not None]
        n_new = n_blocks - len(reused)
        if n_new > self.pool.num_available - sum(1 for b in reused if not self.pool.ref_cnt[b]):
            return False                # the tier is full of other swapped requests
        self.pool.hold(reused)
        new = iter(self.pool.allocate(n_new))
        gpu = self.kv.block_ids(req.request_id)[:n_blocks]
        host = []
        for g, h, b in zip(gpu, hashes, found):
            if b is None:
                b = next(new)
                self._swap_out.append((g, b))
                if h:
                    self.pool.cache(b, h)
            host.append(b)
        self.num_swap_out_blocks += n_new
        self.host_blocks[req.request_id] = host
        self.kv.free(req)
        self.preemptions["swap"] += 1
        return True

    def swap_in(self, req: Request, num_new_tokens: int) -> Optional[list[int]]:
        """Give a swapped-out request GPU blocks for its saved KV and its next num_new_tokens,
        queue the copies back, release its host blocks after this step. Leading blocks still
        in the GPU prefix cache are taken from there instead. Returns the block ids copied
        into, or None (nothing changed) if they do not fit."""
        host = self.host_blocks[req.request_id]
        cached = []             # leading blocks the GPU prefix cache still holds: not copied
        for b in host:
            g = self.kv.pool.lookup(self.pool.block_hash[b]) if self.pool.block_hash[b] else None
            if g is None:
                break
            cached.append(g)
        gpu = self.kv.restore_slots(req, len(host), num_new_tokens, cached)
        if gpu is None:
            return None
        del self.host_blocks[req.request_id]
        self._swap_in.extend(zip(gpu, host[len(cached):]))
        self.num_swap_in_blocks += len(gpu)
        self._held.extend(host)
        return gpu

    def free(self, req: Request) -> None:
        """A swapped-out request finished (abort, a stop on its last token): drop its KV."""
        self.pool.free(self.host_blocks.pop(req.request_id, ()))

    # -- offload of evicted prefix blocks ----------------------------------------------------
    def _offload(self, gpu_block: int, block_hash: bytes) -> None:
        """The GPU pool evicts a cached block to reuse it: keep a copy on the host, if the host
        has no copy yet and has room (evicting its own least recently used)."""
        if self.pool.lookup(block_hash) is not None:
            self.pool.touch(block_hash)
            return
        got = self.pool.allocate(1)
        if got is None:
            return
        self.pool.cache(got[0], block_hash)
        self._swap_out.append((gpu_block, got[0]))
        self.num_swap_out_blocks += 1
        self._held.append(got[0])

    def lookup_prefix(self, req: Request, num_gpu_hits: int) -> list[int]:
        """Host blocks that continue req's cached GPU prefix of num_gpu_hits blocks (never
        covering the last token). Read-only; kv.get_computed_blocks hashed the blocks."""
        if not self.kv.enable_caching or req.skip_prefix_cache:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[num_gpu_hits:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int],
                       host_hits: list[int]) -> Optional[list[int]]:
        """kv.allocate_slots for an admission whose prefix continues on the host: GPU blocks
        for the host hits too, the copies in queued; None (nothing changed) if it does not
        fit. The hits are held first: the GPU evictions this allocation makes may offload
        blocks, which must not evict the hits to make room."""
        self.pool.hold(host_hits)
        new = self.kv.allocate_slots(req, num_new_tokens + len(host_hits) * self.block_size,
                                     computed)
        if new is None:
            self.pool.free(host_hits)
            return None
        for b in host_hits:
            self.pool.touch(self.pool.block_hash[b])
        self._swap_in.extend(zip(new, host_hits))
        self.num_swap_in_blocks += len(host_hits)
        self._held.extend(host_hits)
        return new

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.prefix_queries += num_queried
        self.prefix_hits += num_hit

    # -- checks ------------------------------------------------------------------------------
    def check_invariants(self, swapped_ids: set[str], idle: bool = False) -> dict[str, int]:
        """Every owned host block belongs to one swapped-out request or to a copy of the last
        or this step; the swapped-out requests are the ones the scheduler has queued."""
        counts = self.pool.check_invariants()
        assert set(self.host_blocks) == swapped_ids, (set(self.host_blocks), swapped_ids)
        refs = [0] * self.pool.num_blocks
        for b in [b for bs in self.host_blocks.values() for b in bs] + self._held + self._release:
            refs[b] += 1
        assert refs == self.pool.ref_cnt, "host reference counts disagree with their owners"
        if idle:        # (copies may wait for the next step: they are still owed)
            assert not self.host_blocks, "host blocks left over with no request"
        return {**counts, "in_flight": len(self._held) + len(self._release)}
