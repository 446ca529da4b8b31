"""Continuous batching at token granularity.

Each step spends one token budget: first on running requests (a decode costs 1 token, the rest of
a chunked prefill costs up to the remaining budget), then on waiting requests in policy order.
When blocks run out, the lowest-priority then newest running request is preempted by recompute:
its blocks are freed and it goes back to the front of the waiting queue; or, with a host tier
(core/host_tier.py), by swap: its KV is copied to host memory and it waits in `swapped`, which
is served before `waiting`.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional

from pagedbackend.core.host_tier import HostTier
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    start: int = 0          # request.num_computed_tokens when scheduled
    samples: bool = False   # this step reaches the end of the known tokens: sample a new one
    # draft tokens verified in this step, after the known ones (speculative decoding)
    spec_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, req: Request, n: int, block_ids: list[int]) -> "ScheduledRequest":
        known = req.num_tokens + req.num_pending
        end = req.num_computed_tokens + n
        spec = req.spec_token_ids[:end - known] if end > known else []
        return cls(req, n, block_ids, req.num_computed_tokens, end >= known, spec)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Copies to run before this step's forward, outs first: (GPU block, host block) pairs
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """FCFS: a list with front insertion. Priority: sorted by (priority, arrival, seq)."""

    def __init__(self, policy: str):
        self.policy = policy
        self._items: list[tuple[tuple, Request]] = []
        self._seq = itertools.count()

    def push(self, req: Request, front: bool = False) -> None:
        if self.policy == "priority":
            # A preempted request keeps its (priority, arrival): it lands before newer equals.
            key = (req.priority, req.arrival_time, next(self._seq))
            bisect.insort(self._items, (key, req), key=lambda kv: kv[0])
        elif front:
            self._items.insert(0, ((), req))
        else:
            self._items.append(((), req))

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        return self._items.pop(0)[1]

    def remove(self, req: Request) -> None:
        self._items = [(k, r) for k, r in self._items if r is not req]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (r for _, r in self._items)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, policy: str = "fcfs",
                 host_tier: Optional[HostTier] = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.host = host_tier
        self.swapped = WaitingQueue(policy)     # preempted by swap: their KV is on the host

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id={req.request_id!r} is invalid: must be unique "
                             "among unfinished requests")
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort, or stop-string hit) requests; frees their blocks at once."""
        done = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
                self.host.free(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self.kv.free(req)
            done.append(req)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # -- one step ------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        if self.host is not None:
            self.host.begin_step()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and req.will_finish_by_length:
                i += 1                  # its in-flight token is its last
                continue
            n_known = req.num_tokens + req.num_pending - req.num_computed_tokens
            n = min(n_known + len(req.spec_token_ids), budget)
            while self.kv.allocate_slots(req, n) is None:
                if n > n_known:         # drop the drafts before preempting anyone
                    req.spec_token_ids, n = [], min(n_known, budget)
                    continue
                victim = self._pick_victim()
                vi = self.running.index(victim)
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_new_tokens
                if vi < i:
                    i -= 1
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = ScheduledRequest.of(req, n, self.kv.block_ids(req.request_id))
                budget -= n
                i += 1

        if self.host is not None and not out.preempted_req_ids:
            budget = self._swap_in(scheduled, budget)

        # New admissions only when nothing had to be preempted this step, and none is left
        # swapped out (they would take the blocks it waits for).
        while (not out.preempted_req_ids and not len(self.swapped) and len(self.waiting)
               and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting.peek()
            if req.num_pending:
                break                   # preempted with a token in flight: admit once it lands
            computed, num_cached = self.kv.get_computed_blocks(req)
            host_hits = self.host.lookup_prefix(req, len(computed)) if self.host else []
            num_on_host = len(host_hits) * self.kv.block_size
            n = req.num_tokens - num_cached - num_on_host
            if n > budget and not self.enable_chunked_prefill:
                break
            n = min(n, budget)
            if self.host is not None:
                new = self.host.allocate_slots(req, n, computed, host_hits)
            else:
                new = self.kv.allocate_slots(req, n, computed)
            if new is None:
                break
            self.waiting.pop()
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            if self.host is not None and self.kv.enable_caching:
                self.host.record_prefix_lookup(req.num_tokens - num_cached, num_on_host)
            num_cached += num_on_host
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest.of(req, n, self.kv.block_ids(req.request_id))
            budget -= n

        out.scheduled = list(scheduled.values())
        if self.host is not None:
            self.host.end_step(out)
        return out

    def _swap_in(self, scheduled: dict[str, ScheduledRequest], budget: int) -> int:
        """Bring swapped-out requests back (before any new admission), in policy order, while
        their blocks and next tokens fit; returns the budget left."""
        while len(self.swapped) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped.peek()
            if req.num_pending:
                break                   # preempted with a token in flight: once it lands
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.host.swap_in(req, n) is None:
                break
            self.swapped.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest.of(req, n,
                                                            self.kv.block_ids(req.request_id))
            budget -= n
        return budget

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return max(self.running, key=lambda r: r.arrival_time)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.kv.uncache_uncomputed(req)
        if self.host is not None and self.host.swap_out(req):
            req.status = RequestStatus.SWAPPED
            self.swapped.push(req, front=True)
            return
        if self.host is not None:
            self.host.preemptions["recompute"] += 1
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.WAITING
        self.waiting.push(req, front=True)

    def on_launched(self, out: SchedulerOutput) -> None:
        """The step is on its way: its tokens count as computed, and each sampling row owes one
        token (pending) until update_from_output brings it."""
        for s in out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens += s.num_new_tokens
            if s.samples:
                req.num_pending += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           accepted: Optional[dict[str, list[int]]] = None
                           ) -> tuple[list[Request], list[Request]]:
        """Append a launched step's sampled tokens and apply token stop rules. accepted: the
        draft tokens each verifying row accepted, which come before its sampled token.

        Returns (requests that got new tokens, requests that finished this step).
        """
        progressed, finished = [], []
        for s in out.scheduled:
            req = s.request
            if req.is_finished or req.request_id not in self.requests:
                continue
            tok: Optional[int] = sampled.get(req.request_id) if s.samples else None
            if tok is None:
                continue
            progressed.append(req)
            if s.spec_token_ids:
                status = self._append_verified(req, s, (accepted or {}).get(req.request_id, []),
                                               tok)
            else:
                req.append_token(tok)
                status = req.check_stop()
            if status is not None:
                finished.extend(self.finish_requests([req.request_id], status))
        return progressed, finished

    def _append_verified(self, req: Request, s: ScheduledRequest, accepted: list[int],
                         tok: int) -> Optional[RequestStatus]:
        """A verification's accepted drafts, then its sampled token, up to a stop. The
        rejected drafts' K/V is not the request's: they count as not computed, and blocks
        holding only them go back to the pool."""
        req.num_computed_tokens -= len(s.spec_token_ids) - len(accepted)
        self.kv.trim(req, req.num_computed_tokens)
        for t in accepted + [tok]:
            req.append_token(t)
            status = req.check_stop()
            if status is not None:
                return status
        return None
