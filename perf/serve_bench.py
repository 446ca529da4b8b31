"""W4: a vLLM-style serving benchmark against Triton over one asyncio gRPC stream.

500 requests with ShareGPT-shaped random lengths (prompt ~202, output ~179 tokens on average;
seeded), sent with Poisson arrivals at --request-rate (or all at once: inf), `ignore_eos`, to the
`engine` model (token ids) or the `ensemble` (text). Client-side clock; vLLM's definitions:
TTFT = send -> first streamed token, TPOT = (E2EL - TTFT) / (output tokens - 1),
ITL = every gap between streamed chunks, output throughput = tokens / (first send -> last done).

    python perf/serve_bench.py --url 127.0.0.1:8001 --model engine --request-rate 16
    python perf/serve_bench.py --start-server --num-prompts 40 --scale 0.2    # CPU smoke run

--cache-salt keeps repeated runs on one server (several rates) from hitting the prefix cache
filled by the previous run; --warmup N first sends N other requests, not measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import ROOT, print_table, write_result

MEAN_PROMPT, MEAN_OUTPUT = 202, 179


@dataclass
class Sample:
    prompt_ids: list[int]
    output_len: int
    prompt_text: str = ""


@dataclass
class Trace:
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""
    done: bool = False


def sharegpt_shaped(n: int, seed: int, scale: float = 1.0, max_len: int = 1024) -> list[Sample]:
    """Lognormal lengths (the long right tail of chat data) with ShareGPT's means."""
    rng = random.Random(seed)
    sigma = 0.9
    out = []
    for _ in range(n):
        p = rng.lognormvariate(math.log(MEAN_PROMPT * scale) - sigma ** 2 / 2, sigma)
        o = rng.lognormvariate(math.log(MEAN_OUTPUT * scale) - sigma ** 2 / 2, sigma)
        p, o = min(max(4, int(p)), max_len), min(max(2, int(o)), max_len)
        out.append(Sample([rng.randrange(100, 10000) for _ in range(p)], o))
    return out


def make_samples(n: int, seed: int, scale: float, model: str, model_dir: str) -> list[Sample]:
    """The W4 requests; for the ensemble the prompt ids are sent as their decoded text."""
    samples = sharegpt_shaped(n, seed, scale)
    if model == "ensemble":
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        for s in samples:
            s.prompt_text = tok.decode(s.prompt_ids)
    return samples


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds before each of n sends: Poisson arrivals at `rate` per second (the first at
    once; inf: all at once), seeded."""
    rng = np.random.default_rng(seed)
    return [0.0] + [float(rng.exponential(1.0 / rate)) if math.isfinite(rate) else 0.0
                    for _ in range(n - 1)]


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return (float("nan"),) * 3
    a = np.asarray(xs) * 1e3
    return float(a.mean()), float(np.median(a)), float(np.percentile(a, 99))


async def run(url: str, model: str, samples: list[Sample], rate: float, seed: int,
              cache_salt: str | None = None) -> dict:
    import tritonclient.grpc.aio as aio

    from client.triton_client import build_inputs

    client = aio.InferenceServerClient(url)
    outbox: asyncio.Queue = asyncio.Queue()
    traces = [Trace() for _ in samples]
    left = len(samples)
    all_done = asyncio.Event()

    async def requests():
        while True:
            item = await outbox.get()
            if item is None:
                return
            yield item

    async def sender():
        for i, (s, gap) in enumerate(zip(samples, arrival_gaps(len(samples), rate, seed))):
            if gap:
                await asyncio.sleep(gap)
            kw = dict(max_tokens=s.output_len, ignore_eos=True, temperature=0.0, stream=True)
            inputs = (build_inputs(input_ids=s.prompt_ids, cache_salt=cache_salt, **kw)
                      if model == "engine" else build_inputs(s.prompt_text, cache_salt=cache_salt,
                                                             **kw))
            traces[i].sent = time.perf_counter()
            await outbox.put({"model_name": model, "inputs": inputs, "request_id": str(i),
                              "enable_empty_final_response": True})

    async def receiver():
        nonlocal left
        async for result, error in client.stream_infer(requests()):
            now = time.perf_counter()
            if error is not None:
                # stream errors carry no request id: count it against the oldest open request
                i = next(k for k, t in enumerate(traces) if t.sent and not t.done)
                traces[i].error, traces[i].done = str(error), True
            else:
                resp = result.get_response()
                t = traces[int(resp.id)]
                if resp.outputs:
                    n = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                    if n:
                        t.chunks.append(now)
                        t.tokens += n
                if resp.parameters["triton_final_response"].bool_param:
                    t.done = True
                else:
                    continue
            left -= 1
            if left == 0:
                all_done.set()
                await outbox.put(None)

    recv = asyncio.create_task(receiver())
    await sender()
    await all_done.wait()
    await recv
    await client.close()
    return summarize(traces, samples), traces


def summarize(traces: list[Trace], samples: list[Sample]) -> dict:
    ok = [t for t in traces if not t.error and t.chunks]
    start = min(t.sent for t in traces)
    end = max(t.chunks[-1] for t in ok) if ok else start
    dur = end - start
    ttft = [t.chunks[0] - t.sent for t in ok]
    tpot = [(t.chunks[-1] - t.chunks[0]) / (t.tokens - 1) for t in ok if t.tokens > 1]
    itl = [b - a for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    out = {"completed": len(ok), "failed": len(traces) - len(ok), "duration": dur,
           "request_throughput": len(ok) / dur, "output_throughput": sum(t.tokens for t in ok) / dur,
           "total_input_tokens": sum(len(s.prompt_ids) for s in samples),
           "total_output_tokens": sum(t.tokens for t in ok),
           "expected_output_tokens": sum(s.output_len for s in samples)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        mean, med, p99 = percentiles(xs)
        out.update({f"mean_{name}_ms": mean, f"median_{name}_ms": med, f"p99_{name}_ms": p99})
    return out


def write_details(path: str, traces: list[Trace], samples: list[Sample]) -> list[dict]:
    """One CSV row per request (send time from the first send, prompt and output length,
    TTFT, end-to-end, responses, error); returns the rows of the ten slowest first tokens."""
    import csv

    start = min(t.sent for t in traces)
    rows = []
    for i, (t, s) in enumerate(zip(traces, samples)):
        ok = bool(t.chunks) and not t.error
        rows.append({"request": i, "sent_s": round(t.sent - start, 4),
                     "prompt_len": len(s.prompt_ids), "output_len": s.output_len,
                     "ttft_ms": round((t.chunks[0] - t.sent) * 1e3, 2) if ok else None,
                     "e2e_ms": round((t.chunks[-1] - t.sent) * 1e3, 2) if ok else None,
                     "responses": len(t.chunks), "error": t.error})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return sorted((r for r in rows if r["ttft_ms"] is not None), key=lambda r: -r["ttft_ms"])[:10]


def start_server(model_dir: str, settings: dict):
    from pagedbackend.serving.launcher import TritonServer, free_port, materialize_repository
    work = Path(tempfile.mkdtemp(prefix="pagedbackend-w4-"))
    repo = materialize_repository(work / "repo", {"model": model_dir, **settings})
    server = TritonServer(repo, work, free_port(), free_port(), free_port())
    log = open(work / "tritonserver.log", "w")
    server.start(stdout=log, stderr=log)
    server.wait_ready(timeout=600)
    return server


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="engine", choices=["engine", "ensemble"])
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink lengths (CPU smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-server", action="store_true",
                    help="start tritonserver on --model-dir (else use --url)")
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    ap.add_argument("--setting", action="append", default=[], help="engine setting k=v")
    ap.add_argument("--name", default="smollm2-135m", help="model name for the result file")
    ap.add_argument("--cache-salt", default=None, help="prefix-cache salt sent with every request")
    ap.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")
    ap.add_argument("--details", default=None,
                    help="CSV path for per-request times (the slowest first tokens are printed)")
    a = ap.parse_args()
    samples = make_samples(a.num_prompts, a.seed, a.scale, a.model, a.model_dir)
    server = None
    if a.start_server:
        server = start_server(a.model_dir, dict(kv.split("=", 1) for kv in a.setting))
        a.url = server.grpc_url
    try:
        if a.warmup:
            warm = make_samples(a.warmup, a.seed + 1, a.scale, a.model, a.model_dir)
            asyncio.run(run(a.url, a.model, warm, float("inf"), a.seed, "warmup"))
        cpu0 = time.process_time()
        res, traces = asyncio.run(run(a.url, a.model, samples, a.request_rate, a.seed,
                                      a.cache_salt))
        # near 1.0: the client's one Python thread, not the server, may be the limit
        res["client_cpu_fraction"] = (time.process_time() - cpu0) / max(res["duration"], 1e-9)
    finally:
        if server is not None:
            server.stop()
    rate = "inf" if math.isinf(a.request_rate) else f"{a.request_rate:g}"
    res.update({"request_rate": rate, "num_prompts": a.num_prompts, "scale": a.scale,
                "target_model": a.model, "cache_salt": a.cache_salt, "warmup": a.warmup,
                "roofline_fraction": None})
    write_result("W4", a.name, res, suffix=rate)
    keys = ["request_rate", "completed", "failed", "request_throughput", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms"]
    print(json.dumps(res, indent=1))
    if a.details:
        print_table(write_details(a.details, traces, samples),
                    f"slowest first tokens (all requests: {a.details})")
    print_table([{k: res[k] for k in keys}], f"W4 serving benchmark ({a.model})")


if __name__ == "__main__":
    main()
