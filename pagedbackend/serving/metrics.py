"""vLLM-named metrics published through Triton's custom metrics API (pb_utils.MetricFamily).

The engine loop only enqueues events (cheap, never blocks). They and the loop's periodic
`EngineStats` snapshot are applied to the Triton metric objects in passes that take whatever has
queued up at once (one increment per counter per pass, at most one pass per `min_pass_s`), by
whoever calls `pump()`: the engine model's sender thread, so that one thread makes all the
stub's IPC calls (a separate metrics thread making them alongside the sender is what the engine
model had when tritonserver died of heap corruption under load). `families` is anything with
pb_utils' MetricFamily interface, so tests pass a fake.

Every metric call is an IPC round trip from the stub to the server process. Per-request
histograms (TTFT, e2e, ...) observe once per request, which is cheap; the inter-token latency
histogram has one observation per generated token (thousands per second on a GPU), so it is
kept as Prometheus' histogram series built from counters (`CounterHistogram`): the same
`_bucket{le}`, `_sum` and `_count` series a histogram exposes, updated with one increment per
changed bucket per pass.
"""
from __future__ import annotations

import bisect
import queue
import time
from typing import Any, Callable, Optional

from pagedbackend.serving.queues import take_batch

# Same bucket edges as vLLM, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000]
# vllm:iteration_tokens_total: tokens per engine step (vLLM's edges).
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = ("stop", "length", "abort")

# Gauge/counter key -> pagedbackend.engine.engine_stats.EngineStats attribute.
STAT_NAMES = {
    "running": "num_running",
    "waiting": "num_waiting",
    "kv_usage": "kv_cache_usage",
    "preemptions": "num_preemptions",
    "prefix_queries": "prefix_cache_queries",
    "prefix_hits": "prefix_cache_hits",
    # the host tier (swap_space; zeros without it)
    "swapped": "num_swapped",
    "cpu_usage": "cpu_cache_usage",
    "swap_out": "swap_out_blocks",
    "swap_in": "swap_in_blocks",
    "cpu_prefix_queries": "cpu_prefix_cache_queries",
    "cpu_prefix_hits": "cpu_prefix_cache_hits",
    "preemptions_swap": "preemptions_swap",
    "preemptions_recompute": "preemptions_recompute",
}
HOST_TIER_COUNTERS = ("swap_out", "swap_in", "cpu_prefix_queries", "cpu_prefix_hits",
                      "preemptions_swap", "preemptions_recompute")


def stat(stats: Any, key: str) -> Optional[float]:
    value = getattr(stats, STAT_NAMES[key], None)
    return None if value is None else float(value)


class CounterHistogram:
    """A Prometheus histogram made of counters: `<name>_bucket{le}` (cumulative, "+Inf" last),
    `<name>_sum`, `<name>_count`, the series a histogram metric exposes, so PromQL such as
    `histogram_quantile(0.99, rate(<name>_bucket[1m]))` reads it unchanged. Observations are
    counted locally; `flush()` increments only the series that changed (<= buckets + 3 calls)."""

    def __init__(self, counter_family: Callable[[str, str], Any], labels: dict, name: str,
                 doc: str, buckets: list[float]):
        self.edges = sorted(buckets)
        les = [repr(float(b)) for b in self.edges] + ["+Inf"]
        family = counter_family(f"{name}_bucket", doc)
        self.bucket_metrics = [family.Metric(labels={**labels, "le": le}) for le in les]
        self.sum_metric = counter_family(f"{name}_sum", doc).Metric(labels=labels)
        self.count_metric = counter_family(f"{name}_count", doc).Metric(labels=labels)
        self._pending = [0] * len(les)       # observations per bucket, not yet published
        self._sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self._pending[bisect.bisect_left(self.edges, value)] += count
        self._sum += value * count

    def flush(self) -> None:
        if not any(self._pending):
            return
        cumulative = 0
        for metric, n in zip(self.bucket_metrics, self._pending):
            cumulative += n
            if cumulative:
                metric.increment(cumulative)
        self.sum_metric.increment(self._sum)
        self.count_metric.increment(cumulative)
        self._pending = [0] * len(self._pending)
        self._sum = 0.0


def cache_config_labels(engine: Any) -> dict[str, str]:
    """vllm:cache_config_info's labels, vLLM's names: the KV cache's block size, element type
    (kv_cache_dtype, "auto" = the model's), block count, prefix caching, memory share, and
    with a host tier its swap_space and num_cpu_blocks."""
    c = engine.config
    labels = {"block_size": str(c.block_size), "cache_dtype": c.kv_cache_dtype,
              "num_gpu_blocks": str(engine.info.num_kv_blocks),
              "enable_prefix_caching": str(c.enable_prefix_caching),
              "gpu_memory_utilization": str(c.gpu_memory_utilization)}
    if getattr(c, "swap_space", 0):     # the host tier's GiB per GPU and its blocks
        labels.update(swap_space=str(c.swap_space),
                      num_cpu_blocks=str(engine.stats().num_host_blocks))
    return labels


class ServingMetrics:
    def __init__(self, families: Any, model_name: str, log: Callable[[str], None] = print,
                 min_pass_s: float = 0.1, cache_config: Optional[dict] = None,
                 num_speculative_tokens: Optional[int] = None):
        """cache_config: labels of vLLM's vllm:cache_config_info gauge (value 1), e.g.
        cache_config_labels(engine); none published without it. num_speculative_tokens: the
        engine speculates (spec_metrics.py's counters, from EngineStats.spec_decode)."""
        mf, labels = families.MetricFamily, {"model_name": model_name}
        self._log = log
        self._families = []

        def family(name, doc, kind):
            fam = mf(name=name, description=doc, kind=kind)
            self._families.append(fam)
            return fam

        def gauge(name, doc):
            return family(name, doc, mf.GAUGE).Metric(labels=labels)

        def counter(name, doc, **extra):
            return family(name, doc, mf.COUNTER).Metric(labels={**labels, **extra})

        def histogram(name, doc, buckets):
            return family(name, doc, mf.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens_total",
                                         "Generation tokens processed.")
        success = family("vllm:request_success_total", "Finished requests by finish reason.",
                         mf.COUNTER)
        self.success = {r: success.Metric(labels={**labels, "finished_reason": r})
                        for r in FINISH_REASONS}
        self.preemptions = counter("vllm:num_preemptions_total", "Cumulative preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries_total",
                                      "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits_total", "Prefix-cache hits, in tokens.")
        # the host tier (swap_space): vLLM v0's gauges, counters in its style
        self.swapped = gauge("vllm:num_requests_swapped", "Requests swapped out to the host tier.")
        self.cpu_usage = gauge("vllm:cpu_cache_usage_perc",
                               "Host-tier KV usage (swapped-out requests); 1 means 100 percent.")
        self.swap_out = counter("vllm:swap_out_blocks_total",
                                "KV blocks copied to the host tier (preemption and offload).")
        self.swap_in = counter("vllm:swap_in_blocks_total",
                               "KV blocks copied back from the host tier.")
        self.cpu_prefix_queries = counter("vllm:cpu_prefix_cache_queries_total",
                                          "Host prefix-cache queries (GPU misses), in tokens.")
        self.cpu_prefix_hits = counter("vllm:cpu_prefix_cache_hits_total",
                                       "Host prefix-cache hits, in tokens.")
        by_mode = family("vllm:num_preemptions_by_mode_total",
                         "Preemptions by how the request gets its KV back.", mf.COUNTER)
        self.preemptions_swap = by_mode.Metric(labels={**labels, "preemption_mode": "swap"})
        self.preemptions_recompute = by_mode.Metric(
            labels={**labels, "preemption_mode": "recompute"})
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = CounterHistogram(lambda name, doc: family(name, doc, mf.COUNTER), labels,
                                    "vllm:inter_token_latency_seconds", "Inter-token latency.",
                                    ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time spent waiting before the first schedule.",
                                    REQUEST_LATENCY_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens",
                                        "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Generation tokens per request.", TOKEN_BUCKETS)
        # a request's phases, as vLLM splits them: first schedule -> first token -> last token
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Time in the prefill phase.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Time in the decode phase.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Time from the first schedule to the last token.",
                                        REQUEST_LATENCY_BUCKETS)
        # one observation per engine step: built from counters, as the inter-token latency
        self.iteration_tokens = CounterHistogram(
            lambda name, doc: family(name, doc, mf.COUNTER), labels, "vllm:iteration_tokens_total",
            "Tokens per engine step.", ITERATION_BUCKETS)
        if cache_config is not None:
            self.cache_config = family("vllm:cache_config_info", "Information of the KV cache.",
                                       mf.GAUGE).Metric(labels={**labels, **cache_config})
            self.cache_config.set(1)
        self.spec = None
        if num_speculative_tokens:
            from pagedbackend.serving.spec_metrics import SpecDecodeMetrics
            self.spec = SpecDecodeMetrics(counter, num_speculative_tokens)
        self._totals = dict.fromkeys(("preemptions", "prefix_queries", "prefix_hits")
                                     + HOST_TIER_COUNTERS, 0.0)
        self._min_pass_s = min_pass_s
        self._last_pass = 0.0
        self._events: queue.SimpleQueue = queue.SimpleQueue()

    # ---- called from the engine loop: enqueue only -----------------------------------------
    def on_first_token(self, ttft: float, queue_time: Optional[float], prompt_tokens: int):
        self._events.put(("first", ttft, queue_time, prompt_tokens))

    def on_inter_token(self, seconds: float, count: int):
        self._events.put(("itl", seconds, count))

    def on_generated(self, n: int):
        self._events.put(("gen", n))

    def on_finished(self, reason: str, e2e: float, prompt_tokens: int, generated: int,
                    phases: Optional[tuple[float, float]] = None):
        """phases: (prefill, decode) seconds, for a request that got at least one token."""
        self._events.put(("done", reason, e2e, prompt_tokens, generated, phases))

    def on_step(self, num_tokens: int):
        self._events.put(("step", num_tokens))

    def on_stats(self, stats: Any):
        self._events.put(("stats", stats))

    def close(self) -> None:
        """Publish what is still queued (call it once the pumping thread has stopped)."""
        self.pump(force=True)

    # ---- the thread that owns the stub's IPC ------------------------------------------------
    def pump(self, force: bool = False) -> None:
        """Apply what has queued, unless the last pass was less than `min_pass_s` ago (never
        blocks; call it often from the thread that owns the stub's IPC)."""
        now = time.monotonic()
        if not force and now - self._last_pass < self._min_pass_s:
            return
        self._last_pass = now
        batch = take_batch(self._events, 0)[0]
        if not batch:
            return
        try:
            self.apply_batch(batch)
        except Exception as e:  # noqa: BLE001 - metrics must never take the model down
            self._log(f"metrics update failed: {type(e).__name__}: {e}")

    def apply_batch(self, events: list) -> None:
        """Apply queued events with one increment per counter and only the newest stats
        snapshot: every Triton metric call is an IPC round trip to the server process, and at
        thousands of tokens/s one call per event rivals the responses themselves."""
        totals: dict[int, list] = {}

        def add(metric: Any, amount: float) -> None:
            entry = totals.setdefault(id(metric), [metric, 0.0])
            entry[1] += amount

        stats = None
        for kind, *args in events:
            if kind == "first":
                ttft, queue_time, prompt_tokens = args
                self.ttft.observe(ttft)
                if queue_time is not None:
                    self.queue_time.observe(queue_time)
                add(self.prompt_tokens, prompt_tokens)
            elif kind == "itl":
                seconds, count = args
                self.itl.observe(seconds, count)
            elif kind == "gen":
                add(self.generation_tokens, args[0])
            elif kind == "done":
                reason, e2e, prompt_tokens, generated, phases = args
                add(self.success.get(reason, self.success["abort"]), 1)
                self.e2e.observe(e2e)
                self.request_prompt.observe(prompt_tokens)
                self.request_generation.observe(generated)
                if phases is not None:
                    self.prefill_time.observe(phases[0])
                    self.decode_time.observe(phases[1])
                    self.inference_time.observe(phases[0] + phases[1])
            elif kind == "step":
                self.iteration_tokens.observe(args[0])
            elif kind == "stats":
                stats = args[0]                     # gauges and cumulative totals: newest wins
        for metric, amount in totals.values():
            if amount:
                metric.increment(amount)
        self.itl.flush()
        self.iteration_tokens.flush()
        if stats is not None:
            self._apply_stats(stats)

    def _apply_stats(self, stats: Any) -> None:
        for key, gauge in (("running", self.running), ("waiting", self.waiting),
                           ("kv_usage", self.kv_usage), ("swapped", self.swapped),
                           ("cpu_usage", self.cpu_usage)):
            value = stat(stats, key)
            if value is not None:
                gauge.set(value)
        for key, ctr in (("preemptions", self.preemptions),
                         ("prefix_queries", self.prefix_queries),
                         ("prefix_hits", self.prefix_hits),
                         *((k, getattr(self, k)) for k in HOST_TIER_COUNTERS)):
            value = stat(stats, key)           # engine totals are cumulative: publish the growth
            if value is not None and value > self._totals[key]:
                ctr.increment(value - self._totals[key])
                self._totals[key] = value
        if self.spec is not None and getattr(stats, "spec_decode", None) is not None:
            self.spec.apply(stats.spec_decode)
