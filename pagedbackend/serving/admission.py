"""Admission control of the engine model: past capacity, refuse at once instead of queueing
without bound. Two engine parameters (docs/SERVING.md, "Overload"):
- `max_queue_len`: at most this many requests wait for the engine (submitted, not yet scheduled,
  preempted ones included); one more is refused on Triton's execute thread with UNAVAILABLE.
- `max_queue_delay_ms`: a request that has not produced its first token this long after it
  arrived is ended with UNAVAILABLE (and its KV blocks freed) instead of waiting on.
0 turns either off. Triton's own `dynamic_batching { default_queue_policy }` does not apply:
the engine's execute() returns at once, so Triton's queue never holds a request; the queue that
grows under load is the engine scheduler's, and it is bounded here.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from pagedbackend.config import check
from pagedbackend.serving.settings import convert_parameter


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue_len: int = 0              # 0: unbounded
    max_queue_delay_ms: float = 0.0     # 0: a request may wait for its first token forever

    def __post_init__(self) -> None:
        check(isinstance(self.max_queue_len, int) and self.max_queue_len >= 0, "max_queue_len",
              self.max_queue_len, "an integer >= 0 (0: unbounded)")
        check(self.max_queue_delay_ms >= 0, "max_queue_delay_ms", self.max_queue_delay_ms,
              "a number >= 0 (0: no limit)")

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "AdmissionConfig":
        return cls(*(convert_parameter(key, params.get(key, "") or "0", kind)
                     for key, kind in (("max_queue_len", "int"), ("max_queue_delay_ms", "float"))))


class Admission:
    """The queue's length as the loop last saw it plus what waits in its inbox; read on Triton's
    execute thread, written by the loop thread (one int: no lock needed)."""

    def __init__(self, config: AdmissionConfig, inbox: queue.SimpleQueue):
        self.config = config
        self._inbox = inbox
        self._engine_waiting = 0

    def refusal(self) -> Optional[str]:
        """Why a new request cannot be admitted now, or None."""
        limit = self.config.max_queue_len
        if not limit:
            return None
        waiting = self._engine_waiting + self._inbox.qsize()
        if waiting < limit:
            return None
        return (f"the server is overloaded: the queue is full ({waiting} requests waiting, "
                f"max_queue_len={limit}); retry later")

    def on_engine_waiting(self, stats: Any) -> None:
        """The loop thread, after adding requests and after each step: the engine's queue."""
        self._engine_waiting = int(getattr(stats, "num_waiting", 0) or 0)

    def overdue(self, live: Iterable[tuple[str, Any]], now: float) -> list[tuple[str, str]]:
        """(request id, error message) of each request still without its first token
        max_queue_delay_ms after it arrived; `live` yields (request id, LiveRequest)."""
        delay = self.config.max_queue_delay_ms / 1e3
        if not delay:
            return []
        return [(rid, f"the request waited {now - r.arrival:.1f} s without being scheduled "
                      f"(max_queue_delay_ms={self.config.max_queue_delay_ms:g}); the server is "
                      "overloaded, retry later")
                for rid, r in live if not r.started and not r.cancelled
                and now - r.arrival > delay]
