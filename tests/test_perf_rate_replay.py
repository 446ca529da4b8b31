"""perf/w4_engine_rate.replay: W4's requests at Poisson arrivals into an engine, chunk times
and token counts per request, serve_bench's summary."""
import math

import pytest


class FakeEngine:
    """Streams one token per step to every running request; records when each was added."""

    def __init__(self):
        self.running, self.added = {}, {}

    def add_request(self, rid, prompt, params, cache_salt=None, detokenize=True):
        assert not detokenize and cache_salt == "salt" and prompt["prompt_token_ids"]
        self.added[rid] = len(self.added)
        self.running[rid] = [params.max_tokens, 0]

    def has_unfinished(self):
        return bool(self.running)

    def step(self):
        from pagedbackend.outputs import CompletionOutput, RequestOutput
        outs = []
        for rid, st in list(self.running.items()):
            st[1] += 1
            done = st[1] == st[0]
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(
                0, "", [7] * st[1], None, None, "length" if done else None,
                delta_token_ids=[7])], done))
            if done:
                del self.running[rid]
        return outs


@pytest.mark.parametrize("rate", [math.inf, 200.0])
def test_replay_streams_every_token_and_keeps_the_arrival_order(perf_module, rate):
    samples = perf_module("serve_bench").sharegpt_shaped(12, seed=3, scale=0.05)
    engine = FakeEngine()
    summary, traces = perf_module("w4_engine_rate").replay(engine, samples, rate, seed=0,
                                                           salt="salt")
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(s.output_len for s in samples)
    assert [engine.added[str(i)] for i in range(12)] == list(range(12))
    sent = [t.sent for t in traces]
    assert sent == sorted(sent)
    if math.isinf(rate):
        assert sent[-1] == sent[0]
    else:          # 11 exponential gaps at 200/s: about 55 ms, surely more than 5
        assert sent[-1] - sent[0] > 0.005
    for t, s in zip(traces, samples):
        assert t.done and t.tokens == s.output_len and len(t.chunks) == s.output_len
        assert t.chunks[0] >= t.sent
