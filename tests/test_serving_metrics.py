"""ServingMetrics with a fake MetricFamily: queued events become one increment per counter per
pass, per-request histograms get every observation, the inter-token latency histogram's
counter series get exact counts with one increment per changed series, and only the newest
stats snapshot is published."""
import threading
from types import SimpleNamespace

from pagedbackend.serving.metrics import ServingMetrics


class FakeMetric:
    def __init__(self, calls):
        self.calls, self.total, self.observed, self.value = calls, 0.0, [], None
        self.threads = set()

    def increment(self, v):
        self.calls.append("increment")
        self.threads.add(threading.current_thread().name)
        self.total += v

    def observe(self, v):
        self.calls.append("observe")
        self.threads.add(threading.current_thread().name)
        self.observed.append(v)

    def set(self, v):
        self.calls.append("set")
        self.threads.add(threading.current_thread().name)
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
                                   ("itl", 0.02, 3), ("done", "length", 1.5, 30, 7, None),
                                   ("done", "stop", 1.0, 12, 3, None),
                                   ("done", "length", 2.0, 5, 9, None),
                                   ("stats", stats(4, 1)), ("stats", stats(2, 3))]
    m.apply_batch(events)
    get = lambda name, **kw: fams.metrics[(name, tuple(sorted({"model_name": "m", **kw}.items())))]
    assert get("vllm:generation_tokens_total").total == 200
    assert get("vllm:prompt_tokens_total").total == 42
    assert get("vllm:request_success_total", finished_reason="length").total == 2
    assert get("vllm:request_success_total", finished_reason="stop").total == 1
    itl_bucket = lambda le: get("vllm:inter_token_latency_seconds_bucket", le=le).total
    assert itl_bucket("0.01") == 0 and itl_bucket("0.025") == 3 and itl_bucket("+Inf") == 3
    assert get("vllm:inter_token_latency_seconds_count").total == 3
    assert abs(get("vllm:inter_token_latency_seconds_sum").total - 0.06) < 1e-12
    assert get("vllm:time_to_first_token_seconds").observed == [0.1, 0.2]
    assert get("vllm:request_queue_time_seconds").observed == [0.01]
    assert get("vllm:num_requests_running").value == 2          # the newest snapshot only
    assert get("vllm:num_preemptions_total").total == 3
    # 200 "gen" events and 3 "done": one increment each for generation, prompt, 2 reasons,
    # preemptions -> 5 increments, not 200+; the ITL observations: the 18 buckets from
    # le=0.025 up (cumulative) and +Inf, _sum and _count
    assert fams.calls.count("increment") == 5 + 18 + 3


def test_request_phases_and_tokens_per_step():
    """vLLM's phase histograms (first schedule -> first token -> last token) per finished
    request, and vllm:iteration_tokens_total, one observation per engine step, as counters."""
    fams = FakeFamilies()
    m = ServingMetrics(fams, "m")
    m.on_finished("stop", 2.0, 10, 5, phases=(0.25, 1.5))
    m.on_finished("abort", 0.1, 10, 0)                     # no token: no phases
    for tokens in [1] * 300 + [512, 700, 9000]:
        m.on_step(tokens)
    m.close()
    get = lambda name, **kw: fams.metrics[(name, tuple(sorted({"model_name": "m", **kw}.items())))]
    assert get("vllm:request_prefill_time_seconds").observed == [0.25]
    assert get("vllm:request_decode_time_seconds").observed == [1.5]
    assert get("vllm:request_inference_time_seconds").observed == [1.75]
    bucket = lambda le: get("vllm:iteration_tokens_total_bucket", le=le).total
    assert bucket("1.0") == 300 and bucket("512.0") == 301 and bucket("1024.0") == 302
    assert bucket("16384.0") == bucket("+Inf") == 303
    assert get("vllm:iteration_tokens_total_sum").total == 300 + 512 + 700 + 9000


def test_inter_token_latency_buckets_are_cumulative_and_cost_one_call_per_series():
    fams = FakeFamilies()
    m = ServingMetrics(fams, "m")
    values = [0.004, 0.01, 0.03, 0.3, 0.3, 100.0] * 500      # 3,000 observations
    m.apply_batch([("itl", v, 1) for v in values[:-1]] + [("itl", values[-1], 1)])
    m.apply_batch([("itl", 0.2, 2)])
    m.close()
    get = lambda name, **kw: fams.metrics[(name, tuple(sorted({"model_name": "m", **kw}.items())))]
    bucket = lambda le: get("vllm:inter_token_latency_seconds_bucket", le=le).total
    # le is inclusive: 0.01 lands in the 0.01 bucket, as in prometheus_client
    assert bucket("0.01") == 1000 and bucket("0.025") == 1000 and bucket("0.05") == 1500
    assert bucket("0.2") == 1502 and bucket("0.3") == 2502 and bucket("80.0") == 2502
    assert bucket("+Inf") == get("vllm:inter_token_latency_seconds_count").total == 3002
    assert abs(get("vllm:inter_token_latency_seconds_sum").total
               - (500 * (0.004 + 0.01 + 0.03 + 0.6 + 100.0) + 0.4)) < 1e-6
    assert "observe" not in fams.calls
    # one increment per series per pass: 20 buckets + sum + count, then the 14 buckets from
    # le=0.2 up + sum + count for 0.2 x 2
    assert fams.calls.count("increment") == 22 + 16


def test_metrics_are_published_by_the_engine_loops_sender_thread():
    """The sender thread, the one that sends responses, also makes every metric call."""
    from test_serving_loop import FakeEngine, run_loop, stream_all

    fams = FakeFamilies()
    m = ServingMetrics(fams, "m", min_pass_s=0.01)
    loop = run_loop(FakeEngine(), metrics=m)
    stream_all(loop, 8, max_tokens=5)
    get = lambda name, **kw: fams.metrics[(name, tuple(sorted({"model_name": "m", **kw}.items())))]
    sent_by = set().union(*(metric.threads for metric in fams.metrics.values()))
    m.close()        # publishes what the last pass left (on the closing thread)
    assert get("vllm:generation_tokens_total").total == 8 * 5
    assert get("vllm:request_success_total", finished_reason="length").total == 8
    assert get("vllm:inter_token_latency_seconds_count").total == 8 * 4
    assert sent_by <= {"engine-sender"} and sent_by


def test_cache_config_info_carries_the_cache_settings_as_labels():
    # vLLM's vllm:cache_config_info: one gauge at 1 whose labels are the KV cache's settings
    from pagedbackend.serving.metrics import cache_config_labels
    engine = SimpleNamespace(
        config=SimpleNamespace(block_size=16, kv_cache_dtype="fp8", enable_prefix_caching=True,
                               gpu_memory_utilization=0.9),
        info=SimpleNamespace(num_kv_blocks=1234))
    labels = cache_config_labels(engine)
    assert labels == {"block_size": "16", "cache_dtype": "fp8", "num_gpu_blocks": "1234",
                      "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9"}
    fams = FakeFamilies()
    ServingMetrics(fams, "m", cache_config=labels)
    metric = fams.metrics[("vllm:cache_config_info",
                           tuple(sorted({"model_name": "m", **labels}.items())))]
    assert metric.value == 1
    ServingMetrics(fams2 := FakeFamilies(), "m")            # without it: no such family
    assert not any(name == "vllm:cache_config_info" for name, _ in fams2.metrics)
