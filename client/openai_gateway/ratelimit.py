"""Per-API-key rate limits of the gateway: a token bucket per key (the bearer token, or the
client's address when none is sent), checked before a request is read, so a client past its
rate gets 429 with `Retry-After` in microseconds of work, whatever the server's load.

`--rate-limit R` (requests per second per key) and `--rate-limit-burst B` (default: max(1, R)).
Only the generating routes (POST /v1/...) are limited; /health, /metrics and /v1/models are not.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from fastapi.responses import JSONResponse

from client.openai_gateway.errors import APIError

MAX_KEYS = 10_000     # buckets kept (least recently used dropped): bounded memory under churn


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, now

    def take(self, now: float) -> float:
        """0 if a request may go now (one token taken), else the seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimiter:
    """Token buckets by key: `rate` requests per second, bursts of `burst`."""

    def __init__(self, rate: float, burst: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS):
        burst = max(1.0, rate) if burst is None else burst
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate_limit={rate!r} is invalid: must be a number > 0 "
                             "(requests per second per API key)")
        if not (math.isfinite(burst) and burst >= 1):
            raise ValueError(f"rate_limit_burst={burst!r} is invalid: must be a number >= 1")
        self.rate, self.burst, self._clock, self._max_keys = rate, burst, clock, max_keys
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    def wait_s(self, key: bytes) -> float:
        """0 if `key` may send a request now (and count it), else seconds until it may."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.pop(key, None) or TokenBucket(self.rate, self.burst, now)
            self._buckets[key] = bucket
            if len(self._buckets) > self._max_keys:
                self._buckets.popitem(last=False)
            return bucket.take(now)


class RateLimitMiddleware:
    """429 + Retry-After for a key past its rate on POST /v1/... (an ASGI middleware)."""

    def __init__(self, app, limiter: RateLimiter) -> None:
        self.app, self.limiter = app, limiter

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or not scope["path"].startswith("/v1/")):
            return await self.app(scope, receive, send)
        wait = self.limiter.wait_s(_client_key(scope))
        if wait <= 0:
            return await self.app(scope, receive, send)
        err = APIError(429, f"Rate limit exceeded: {self.limiter.rate:g} requests per second "
                       f"per API key (bursts of {self.limiter.burst:g}); retry after "
                       f"{wait:.2f} s.", type_="rate_limit_error", code="rate_limit_exceeded",
                       retry_after=max(1, math.ceil(wait)))
        resp = JSONResponse(err.body(), status_code=429, headers=err.headers())
        return await resp(scope, receive, send)


def _client_key(scope) -> bytes:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return b"key:" + value
    client = scope.get("client") or ("?", 0)
    return b"addr:" + str(client[0]).encode()
