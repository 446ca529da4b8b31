"""ServingMetrics with a fake MetricFamily: queued events become one increment per counter per
pass, histograms get every observation, and only the newest stats snapshot is published."""
from types import SimpleNamespace

from pagedbackend.serving.metrics import ServingMetrics


class FakeMetric:
    def __init__(self, calls):
        self.calls, self.total, self.observed, self.value = calls, 0.0, [], None

    def increment(self, v):
        self.calls.append("increment")
        self.total += v

    def observe(self, v):
        self.calls.append("observe")
        self.observed.append(v)

    def set(self, v):
        self.calls.append("set")
        self.value = v


class FakeFamilies:
    """Stands in for triton_python_backend_utils: .MetricFamily(name=, description=, kind=)."""

    def __init__(self):
        self.calls, self.metrics = [], {}
        owner = self

        class MetricFamily:
            GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' spelling
                return owner.metrics.setdefault((self.name, tuple(sorted(labels.items()))),
                                                FakeMetric(owner.calls))

        self.MetricFamily = MetricFamily


def stats(running, preemptions):
    return SimpleNamespace(num_running=running, num_waiting=0, kv_cache_usage=0.5,
                           num_preemptions=preemptions, prefix_cache_queries=0,
                           prefix_cache_hits=0)


def test_a_batch_of_events_costs_one_increment_per_counter():
    fams = FakeFamilies()
    m = ServingMetrics(fams, "m")
    events = [("gen", 1)] * 200 + [("first", 0.1, 0.01, 30), ("first", 0.2, None, 12),
                                   ("itl", 0.02, 3), ("done", "length", 1.5, 30, 7),
                                   ("done", "stop", 1.0, 12, 3), ("done", "length", 2.0, 5, 9),
                                   ("stats", stats(4, 1)), ("stats", stats(2, 3))]
    m.apply_batch(events)
    m.close()
    get = lambda name, **kw: fams.metrics[(name, tuple(sorted({"model_name": "m", **kw}.items())))]
    assert get("vllm:generation_tokens_total").total == 200
    assert get("vllm:prompt_tokens_total").total == 42
    assert get("vllm:request_success_total", finished_reason="length").total == 2
    assert get("vllm:request_success_total", finished_reason="stop").total == 1
    assert get("vllm:inter_token_latency_seconds").observed == [0.02] * 3
    assert get("vllm:time_to_first_token_seconds").observed == [0.1, 0.2]
    assert get("vllm:request_queue_time_seconds").observed == [0.01]
    assert get("vllm:num_requests_running").value == 2          # the newest snapshot only
    assert get("vllm:num_preemptions_total").total == 3
    # 200 "gen" events and 3 "done": one increment each for generation, prompt, 2 reasons,
    # preemptions -> 5 increments, not 200+
    assert fams.calls.count("increment") == 5
