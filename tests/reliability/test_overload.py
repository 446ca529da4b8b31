"""Overload: the engine model's admission control (max_queue_len refuses at once past the limit,
max_queue_delay_ms ends requests that waited too long), unit-tested on the engine loop with a fake
engine, then through the real tritonserver (HTTP 503, gRPC UNAVAILABLE, and the gateway)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pagedbackend.serving.admission import AdmissionConfig
from test_serving_loop import FakeEngine, Sender, req, run_loop


class QueueingEngine(FakeEngine):
    """FakeEngine that runs at most `slots` requests, one token per step every `step_s`; the
    rest wait (FCFS), as the scheduler's waiting queue."""

    def __init__(self, slots=1, step_s=0.01):
        super().__init__()
        self.slots, self.step_s, self.order = slots, step_s, []

    def add_request(self, rid, *a, **kw):
        super().add_request(rid, *a, **kw)
        self.order.append(rid)

    def step(self):
        time.sleep(self.step_s)
        self.order = [r for r in self.order if r in self.reqs]
        running = set(self.order[:self.slots])
        waiting = {r: self.reqs.pop(r) for r in list(self.reqs) if r not in running
                   and not self.reqs[r].aborted}
        try:
            return super().step()
        finally:
            self.reqs.update(waiting)

    def stats(self):
        running = sum(1 for r in self.order[:self.slots] if r in self.reqs)
        return SimpleNamespace(num_waiting=len(self.reqs) - running)


def errors(sender):
    return [i.error for i in sender.items if i.error]


def test_admission_config_names_the_field():
    with pytest.raises(ValueError, match="max_queue_len=-1 is invalid"):
        AdmissionConfig(max_queue_len=-1)
    with pytest.raises(ValueError, match="parameter max_queue_delay_ms='soon' is invalid"):
        AdmissionConfig.from_parameters({"max_queue_delay_ms": "soon"})
    assert AdmissionConfig.from_parameters({}) == AdmissionConfig(0, 0.0)


def test_past_max_queue_len_refused_at_once_and_the_rest_finish():
    engine = QueueingEngine(slots=1, step_s=0.02)
    loop = run_loop(engine, admission=AdmissionConfig(max_queue_len=2))
    first = Sender()
    loop.submit(first, req(prompt=[1], max_tokens=50))
    deadline = time.monotonic() + 5
    while not first.items and time.monotonic() < deadline:      # running, not waiting
        time.sleep(0.01)
    waiting = [Sender(), Sender()]
    for s in waiting:
        loop.submit(s, req(prompt=[1], max_tokens=2))
    refused = Sender()
    t0 = time.monotonic()
    loop.submit(refused, req(prompt=[1], max_tokens=2))
    assert refused.done.wait(1.0)
    assert time.monotonic() - t0 < 0.5, "refusal must not wait for the engine"
    assert len(refused.items) == 1 and refused.items[0].error_kind == "unavailable"
    assert "max_queue_len=2" in refused.items[0].error and "queue is full" in refused.items[0].error
    assert all(s.done.wait(10) for s in [first, *waiting])
    assert not any(errors(s) for s in [first, *waiting])
    late = Sender()                                               # room again once drained
    loop.submit(late, req(prompt=[1], max_tokens=2))
    assert late.done.wait(5) and not errors(late)
    loop.shutdown()


def test_request_waiting_past_max_queue_delay_ends_with_unavailable():
    engine = QueueingEngine(slots=1, step_s=0.02)
    loop = run_loop(engine, admission=AdmissionConfig(max_queue_delay_ms=200))
    hog, stuck = Sender(), Sender()
    loop.submit(hog, req(prompt=[1], max_tokens=40))              # ~0.8 s of steps
    loop.submit(stuck, req(prompt=[1], max_tokens=2))
    assert stuck.done.wait(5)
    assert hog.items and not hog.done.is_set(), "the running request goes on"
    [item] = stuck.items
    assert item.final and item.error_kind == "unavailable"
    assert "max_queue_delay_ms=200" in item.error
    assert [r for r in engine.aborted] == ["1"], "its engine request was aborted"
    assert hog.done.wait(10) and not errors(hog)
    loop.shutdown()


# ---- the gateway: per-key rate limits, and the backend's overload as 429 / 503 ---------------
from client.openai_gateway.__main__ import build_app, parse_args  # noqa: E402
from client.openai_gateway.ratelimit import RateLimiter  # noqa: E402
from test_gateway_unit import KEY, FakeBackend, make  # noqa: E402

BODY = {"model": "smol", "prompt": "hi there", "max_tokens": 2}


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_token_bucket_per_key_with_retry_after():
    clock = Clock()
    c = make(FakeBackend(), api_key=KEY, rate_limit=RateLimiter(2.0, burst=3, clock=clock))
    hdr = {"Authorization": f"Bearer {KEY}"}
    assert [c.post("/v1/completions", json=BODY, headers=hdr).status_code
            for _ in range(3)] == [200] * 3                          # the burst
    r = c.post("/v1/completions", json=BODY, headers=hdr)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert "2 requests per second" in err["message"]
    assert c.get("/v1/models", headers=hdr).status_code == 200       # only POST /v1/ counts
    assert c.get("/health").status_code == 200
    clock.t += 0.5                                                   # one token back at 2/s
    assert c.post("/v1/completions", json=BODY, headers=hdr).status_code == 200
    assert c.post("/v1/completions", json=BODY, headers=hdr).status_code == 429
    # a wrong key is refused by the key check before it can use anyone's bucket
    assert c.post("/v1/completions", json=BODY,
                  headers={"Authorization": "Bearer nope"}).status_code == 401


def test_rate_limit_buckets_are_per_key_and_bounded():
    clock = Clock()
    limiter = RateLimiter(1.0, burst=1, clock=clock, max_keys=3)
    c = make(FakeBackend(), rate_limit=limiter)
    for key in ("a", "b", "c"):
        h = {"Authorization": f"Bearer {key}"}
        assert c.post("/v1/completions", json=BODY, headers=h).status_code == 200
        assert c.post("/v1/completions", json=BODY, headers=h).status_code == 429
    c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer d"})
    assert len(limiter._buckets) == 3                                # least recent dropped


def test_rate_limit_flags_and_their_errors():
    args = parse_args(["--rate-limit", "5", "--rate-limit-burst", "10", "--triton-metrics",
                       "off"])
    app = build_app(args)
    assert any(m.cls.__name__ == "RateLimitMiddleware" for m in app.user_middleware)
    with pytest.raises(ValueError, match="rate_limit=0.0 is invalid"):
        RateLimiter(0.0)
    with pytest.raises(ValueError, match="rate_limit_burst=0.5 is invalid"):
        RateLimiter(1.0, burst=0.5)
    with pytest.raises(SystemExit):
        parse_args(["--rate-limit-burst", "3"])


@pytest.mark.parametrize("message, status, code", [
    ("in ensemble 'ensemble', the server is overloaded: the queue is full (2 requests "
     "waiting, max_queue_len=2); retry later", 429, "server_busy"),
    ("in ensemble 'ensemble', the request waited 5.1 s without being scheduled "
     "(max_queue_delay_ms=5000); the server is overloaded, retry later", 503, "model_not_ready"),
    ("in ensemble 'ensemble', Stub process 'engine_0_0' is not healthy.", 503, "model_not_ready"),
    ("the engine failed; the model is unavailable", 503, "model_not_ready"),
])
def test_backend_overload_and_failure_map_to_429_or_503_with_retry_after(message, status, code):
    fake = FakeBackend()
    fake.fail = message
    c = make(fake)
    t0 = time.monotonic()
    r = c.post("/v1/completions", json=BODY)
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert int(r.headers["Retry-After"]) >= 1
    assert time.monotonic() - t0 < 1.0
