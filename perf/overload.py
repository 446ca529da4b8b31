"""Overload: past capacity the server sheds load fast, and admitted requests keep their latency.

    .venv/bin/python perf/overload.py [--seconds 40] [--clients 16]

SmolLM2 on the CPU through tritonserver's HTTP generate endpoint (non-streaming, 16 tokens).
1. unloaded: one request at a time, the median latency L0;
2. flood with admission control (max_num_seqs=2, max_queue_len=1): `--clients` closed-loop
   clients; admitted requests' latency vs L0, refusals' latency, the share refused;
3. the same flood without it (max_queue_len=0): every request queues, latency grows;
4. the gateway's per-key rate limit (--rate-limit 5) under one flooding key: 429 latency.
Writes perf/results/overload-smollm2-cpu.json and prints a table last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from common import ROOT, commit, print_table, start_gateway, write_result

from pagedbackend.serving.launcher import TritonServer, free_port, materialize_repository

MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
BASE = {"model": MODEL, "max_model_len": "1024", "dtype": "float32"}
BODY = {"text_input": "Tell me about the sea.", "max_tokens": 16, "ignore_eos": True,
        "temperature": 0.0}
KEY = "sk-overload"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def flood(url: str, clients: int, seconds: float, body: dict, headers=None,
          backoff_s: float = 0.05) -> dict:
    """`clients` closed-loop clients for `seconds`: latencies of 200s and of refusals."""
    ok, refused, other = [], [], []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(timeout=300, headers=headers) as http:
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    r = http.post(url, json=body)
                    status, text = r.status_code, r.text
                except httpx.HTTPError as e:
                    status, text = 0, str(e)
                dt = time.monotonic() - t0
                with lock:
                    if status == 200:
                        ok.append(dt)
                    elif status in (429, 503) or "overloaded" in text:
                        refused.append(dt)
                    else:
                        other.append((status, text[:100]))
                if status != 200:
                    time.sleep(backoff_s)     # a refused client backs off, as SDKs do

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 310)
    total = len(ok) + len(refused) + len(other)
    return {"admitted": len(ok), "refused": len(refused), "other_errors": len(other),
            "other_examples": other[:3], "refused_share": len(refused) / max(1, total),
            "admitted_p50_s": pct(ok, 0.5), "admitted_p90_s": pct(ok, 0.9),
            "admitted_max_s": max(ok, default=float("nan")),
            "refusal_p50_ms": pct(refused, 0.5) * 1e3, "refusal_p99_ms": pct(refused, 0.99) * 1e3,
            "admitted_per_s": len(ok) / seconds}


def with_server(settings: dict, body):
    work = Path(tempfile.mkdtemp(prefix="overload-"))
    repo = materialize_repository(work / "repo", settings)
    server = TritonServer(repo, work, free_port(), free_port(), free_port())
    log = open(work / "server.log", "w")
    server.start(stdout=log, stderr=log)
    try:
        server.wait_ready(600)
        return body(server)
    finally:
        server.stop()
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-queue-len", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--backoff-s", type=float, default=0.05,
                   help="how long a refused client waits before its next request")
    p.add_argument("--suffix", default="", help="result file suffix")
    args = p.parse_args()
    # the commit the run started from (HEAD may move while it runs)
    os.environ.setdefault("PAGEDBACKEND_COMMIT", commit())
    base = {**BASE, "max_num_seqs": str(args.max_num_seqs)}
    data: dict = {"clients": args.clients, "seconds": args.seconds, "engine": base,
                  "max_queue_len": args.max_queue_len, "backoff_s": args.backoff_s}

    def admitted_run(server) -> None:
        url = f"http://{server.http_url}/v2/models/ensemble/generate"
        for _ in range(2):                                       # warm-up
            httpx.post(url, json=BODY, timeout=300)
        lat = []
        for _ in range(10):
            t0 = time.monotonic()
            assert httpx.post(url, json=BODY, timeout=300).status_code == 200
            lat.append(time.monotonic() - t0)
        data["unloaded_p50_s"] = statistics.median(lat)
        data["with_admission"] = flood(url, args.clients, args.seconds, BODY,
                                       backoff_s=args.backoff_s)
        data["gateway_rate_limit"] = gateway_run(server, args.seconds / 2, args.backoff_s)

    with_server({**base, "max_queue_len": str(args.max_queue_len)}, admitted_run)
    with_server({**base, "max_queue_len": "0"}, lambda server: data.__setitem__(
        "without_admission", flood(f"http://{server.http_url}/v2/models/ensemble/generate",
                                   args.clients, args.seconds, BODY, backoff_s=args.backoff_s)))
    l0 = data["unloaded_p50_s"]
    rows = []
    for name in ("with_admission", "without_admission"):
        r = data[name]
        r["admitted_p50_vs_unloaded"] = r["admitted_p50_s"] / l0
        r["admitted_p90_vs_unloaded"] = r["admitted_p90_s"] / l0
        rows.append({"run": name, "admitted": r["admitted"], "refused": r["refused"],
                     "errors": r["other_errors"], "p50_s": round(r["admitted_p50_s"], 3),
                     "p90_s": round(r["admitted_p90_s"], 3),
                     "p50/L0": round(r["admitted_p50_vs_unloaded"], 2),
                     "p90/L0": round(r["admitted_p90_vs_unloaded"], 2),
                     "refusal_p50_ms": round(r["refusal_p50_ms"], 1),
                     "refusal_p99_ms": round(r["refusal_p99_ms"], 1)})
    g = data["gateway_rate_limit"]
    rows.append({"run": "gateway --rate-limit 5", "admitted": g["admitted"],
                 "refused": g["refused"], "errors": g["other_errors"],
                 "p50_s": round(g["admitted_p50_s"], 3), "p90_s": round(g["admitted_p90_s"], 3),
                 "p50/L0": "", "p90/L0": "", "refusal_p50_ms": round(g["refusal_p50_ms"], 1),
                 "refusal_p99_ms": round(g["refusal_p99_ms"], 1)})
    path = write_result("overload", "smollm2", data, suffix=args.suffix)
    print(f"wrote {path}")
    print_table(rows, f"overload: {args.clients} clients, {args.seconds:g} s each, unloaded "
                      f"p50 L0 = {l0:.3f} s (max_num_seqs={args.max_num_seqs}, "
                      f"max_queue_len={args.max_queue_len}, backoff {args.backoff_s:g} s)")


def gateway_run(server, seconds: float, backoff_s: float) -> dict:
    proc, base = start_gateway(server, MODEL, KEY, subprocess.DEVNULL, "--triton-metrics", "off",
                               "--rate-limit", "5")
    try:
        body = {"model": "smollm2", "prompt": BODY["text_input"], "max_tokens": 16,
                "ignore_eos": True, "temperature": 0.0}
        return flood(base + "/v1/completions", 8, seconds, body,
                     headers={"Authorization": f"Bearer {KEY}"}, backoff_s=backoff_s)
    finally:
        proc.terminate()
        proc.wait(15)

if __name__ == "__main__":
    main()
