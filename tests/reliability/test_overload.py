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
