"""Soak: N minutes of mixed traffic against tritonserver + the OpenAI gateway on SmolLM2 (CPU).

    nice -n 10 .venv/bin/python perf/soak.py --minutes 30 --concurrency 4

Each client thread loops until the deadline over: HTTP generate / generate_stream, gRPC
streaming, the gateway's chat and completions (streamed or not); 10% of the requests disconnect
mid-way, 5% are bad inputs (expected: a 4xx / an error naming the field). Every few seconds the
RSS of tritonserver and its backend stubs is sampled. At the end the load stops, the server must
drain to 0 running / 0 waiting / 0 KV usage, every request must have ended (a final response, an
error, or our own disconnect), and no process may have died. Loopback only; bounded loops.
Writes perf/results/soak-smollm2-cpu.json and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import httpx

from common import ROOT, commit, print_table, start_gateway, write_result

from pagedbackend.serving import processes
from pagedbackend.serving.launcher import TritonServer, free_port, materialize_repository

MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
SETTINGS = {"model": MODEL, "max_model_len": "1024", "max_num_seqs": "32", "dtype": "float32"}
KEY = "sk-soak"
PROMPTS = ["Tell me a story about a dragon.", "What is the capital of France?",
           "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
           "List three prime numbers.", "Bonjour, comment ça va ? Réponds en français."]
BAD_HTTP = [{"temperature": -1.0}, {"max_tokens": 0}, {"top_p": 0.0},
            {"sampling_parameters": "{oops"}, {"text_input": "word " * 1100},
            {"sampling_parameters": '{"logprobs": 1000000}'}]
BAD_GATEWAY = [{"temperature": "hot"}, {"max_tokens": -5}, {"n": 1000000}, {"top_p": 7},
               {"logprobs": True, "top_logprobs": 1000000}]
REQUEST_TIMEOUT_S = 120.0
KINDS = ["http_stream", "http", "grpc_stream", "gateway_chat_stream", "gateway_chat",
         "gateway_completion_stream"]


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        out[name.split(":")[1]] = sum(float(m) for m in re.findall(
            rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M))
    return out


def tree(root: int) -> dict[int, tuple[str, int]]:
    """{pid: (command, RSS bytes)} of root and every live process below it."""
    table = processes.process_table()
    below = [p for p in processes.descendants(root, table) if p.live]
    out = {root: (table[root].cmdline, table[root].rss_bytes) if root in table else ("", 0)}
    out.update({p.pid: (p.cmdline, p.rss_bytes) for p in below})
    return out


class Soak:
    def __init__(self, server: TritonServer, gateway: str, seed: int, disconnect: float,
                 bad: float):
        self.server, self.gateway = server, gateway
        self.rng = random.Random(seed)
        self.disconnect_p, self.bad_p = disconnect, bad
        self.outcomes: Counter = Counter()
        self.errors: Counter = Counter()
        self.latency: dict[str, list] = {}
        self.lock = threading.Lock()

    def record(self, kind: str, outcome: str, seconds: float, error: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if error:
                self.errors[re.sub(r"\d+", "N", error)[:100]] += 1
            if outcome == "ok":
                self.latency.setdefault(kind, []).append(seconds)

    def one(self, rng: random.Random) -> None:
        kind = rng.choice(KINDS)
        bad = rng.random() < self.bad_p
        leave = not bad and rng.random() < self.disconnect_p
        t0 = time.monotonic()
        try:
            outcome, error = getattr(self, kind)(rng, bad, leave)
        except Exception as e:  # noqa: BLE001 - counted, never raised
            outcome, error = "no_terminal", f"{kind}: {type(e).__name__}: {e}"
        self.record(kind, outcome, time.monotonic() - t0, error)

    # Each returns (outcome, error text): outcome "ok", "disconnected" (we left), "rejected" (a
    # bad input refused as expected), "error" (a request that should have worked failed),
    # "accepted_bad" (a bad input served), "no_terminal" (ended without final or error).
    def _body(self, rng, bad):
        body = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 48),
                "temperature": rng.choice([0.0, 0.7])}
        if bad:
            body.update(rng.choice(BAD_HTTP))
        return body

    def http(self, rng, bad, leave):
        url = f"http://{self.server.http_url}/v2/models/ensemble/generate"
        try:
            r = httpx.post(url, json=self._body(rng, bad), timeout=0.3 if leave else
                           REQUEST_TIMEOUT_S)
        except httpx.TimeoutException:
            return ("disconnected", "") if leave else ("no_terminal", "http: timeout")
        return self._judge(r.status_code, r.text, bad, "finish_reason")

    def http_stream(self, rng, bad, leave):
        url = f"http://{self.server.http_url}/v2/models/ensemble/generate_stream"
        body = {**self._body(rng, bad), "stream": True}
        with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as r:
            n = 0
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    return self._judge(400, data["error"], bad, "")
                n += 1
                if leave and n >= 2:
                    return "disconnected", ""
                if data.get("finish_reason"):
                    return ("accepted_bad", "http_stream served a bad input") if bad else \
                        ("ok", "")
            if r.status_code >= 400:
                return self._judge(r.status_code, r.read().decode(), bad, "")
        return "no_terminal", "http_stream: ended without a final response"

    def grpc_stream(self, rng, bad, leave):
        import tritonclient.grpc as grpcclient
        from client.triton_client import build_inputs

        body = self._body(rng, bad)
        kwargs = {k: v for k, v in body.items() if k != "text_input"}
        if "sampling_parameters" in kwargs:
            kwargs["sampling_parameters"] = None
            kwargs["temperature"] = -1.0          # the gRPC bad input: a negative temperature
        events: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        try:
            client.start_stream(callback=lambda result, error: events.put((result, error)))
            client.async_stream_infer("ensemble", build_inputs(body["text_input"], stream=True,
                                                               **kwargs),
                                      enable_empty_final_response=True)
            n = 0
            while True:
                try:
                    result, error = events.get(timeout=REQUEST_TIMEOUT_S)
                except queue.Empty:
                    return "no_terminal", "grpc_stream: no response for 120 s"
                if error is not None:
                    return self._judge(400, str(error), bad, "")
                n += 1
                if leave and n >= 2:
                    client.stop_stream(cancel_requests=True)
                    return "disconnected", ""
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return ("accepted_bad", "grpc served a bad input") if bad else ("ok", "")
        finally:
            try:
                client.stop_stream()
                client.close()
            except Exception:  # noqa: BLE001
                pass

    def _gateway(self, rng, bad, leave, path, stream):
        body = {"model": "smollm2", "max_tokens": rng.randint(4, 48), "stream": stream,
                "temperature": rng.choice([0.0, 0.7])}
        if path == "chat/completions":
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            body["prompt"] = rng.choice(PROMPTS)
        if bad:
            body.update(rng.choice(BAD_GATEWAY))
        url = f"{self.gateway}/v1/{path}"
        headers = {"Authorization": f"Bearer {KEY}"}
        if not stream:
            try:
                r = httpx.post(url, json=body, headers=headers,
                               timeout=0.3 if leave else REQUEST_TIMEOUT_S)
            except httpx.TimeoutException:
                return ("disconnected", "") if leave else ("no_terminal", "gateway: timeout")
            return self._judge(r.status_code, r.text, bad, '"choices"')
        with httpx.stream("POST", url, json=body, headers=headers,
                          timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                return self._judge(r.status_code, r.read().decode(), bad, "")
            n = 0
            for line in r.iter_lines():
                if line.strip() == "data: [DONE]":
                    return ("accepted_bad", "gateway served a bad input") if bad else ("ok", "")
                if '"error"' in line:
                    return "error", "gateway stream: " + line[:120]
                n += line.startswith("data:")
                if leave and n >= 2:
                    return "disconnected", ""
        return "no_terminal", "gateway stream: ended without [DONE]"

    def gateway_chat(self, rng, bad, leave):
        return self._gateway(rng, bad, leave, "chat/completions", False)

    def gateway_chat_stream(self, rng, bad, leave):
        return self._gateway(rng, bad, leave, "chat/completions", True)

    def gateway_completion_stream(self, rng, bad, leave):
        return self._gateway(rng, bad, leave, "completions", True)

    @staticmethod
    def _judge(status: int, text: str, bad: bool, ok_marker: str):
        if bad:
            if 400 <= status < 500:
                return "rejected", ""
            return "accepted_bad", f"bad input got {status}: {text[:80]}"
        if status == 200 and ok_marker in text:
            return "ok", ""
        return "error", f"{status}: {text[:120]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--disconnect", type=float, default=0.10)
    p.add_argument("--bad", type=float, default=0.05)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--suffix", default="", help="result file suffix (e.g. 2min)")
    args = p.parse_args()
    # the commit the run started from (HEAD may move while it runs)
    os.environ.setdefault("PAGEDBACKEND_COMMIT", commit())

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    repo = materialize_repository(work / "repo", SETTINGS)
    server = TritonServer(repo, work, free_port(), free_port(), free_port())
    log = open(work / "server.log", "w")
    server.start(stdout=log, stderr=log)
    gateway = None
    try:
        server.wait_ready(600)
        gateway, base = start_gateway(server, MODEL, KEY, log, "--triton-metrics",
                                      server.metrics_url)
        stubs0 = {p: c for p, (c, _) in tree(server.proc.pid).items()
                  if "triton_python_backend_stub" in c}
        soak = Soak(server, base, args.seed, args.disconnect, args.bad)
        rss: list[tuple[float, int, int]] = []       # (t, all processes, engine stub)
        t_start = time.monotonic()
        deadline = t_start + args.minutes * 60
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(args.sample_s):
                procs = tree(server.proc.pid)
                rss.append((round(time.monotonic() - t_start, 1),
                            sum(r for _, r in procs.values()),
                            sum(r for c, r in procs.values() if "/engine/1/" in c)))

        def client(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < deadline and server.proc.poll() is None:
                soak.one(rng)

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(args.concurrency)]
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.minutes * 60 + REQUEST_TIMEOUT_S + 30)
        hung_clients = sum(t.is_alive() for t in threads)
        drain_t0 = time.monotonic()
        after = {}
        while time.monotonic() - drain_t0 < 60:
            after = metrics(server.metrics_url)
            if not any(after.values()):
                break
            time.sleep(0.5)
        drain_s = time.monotonic() - drain_t0
        stop.set()
        sampler.join()
        stubs1 = {p: c for p, (c, _) in tree(server.proc.pid).items()
                  if "triton_python_backend_stub" in c}
        crashes = (server.proc.poll() is not None) + (gateway.poll() is not None) + \
            len(set(stubs0) - set(stubs1))
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(15)
        server.stop()
        log.close()

    outcomes = Counter()
    for (_, outcome), n in soak.outcomes.items():
        outcomes[outcome] += n
    total = sum(outcomes.values())
    mb = 1 << 20
    warm = next((r for r in rss if r[0] >= min(120.0, args.minutes * 60 / 4)), rss[0])
    data = {
        "minutes": args.minutes, "concurrency": args.concurrency, "requests": total,
        "outcomes": dict(outcomes),
        "by_kind": {f"{k}:{o}": n for (k, o), n in sorted(soak.outcomes.items())},
        "errors_by_kind": dict(soak.errors.most_common()),
        "p50_latency_s": {k: sorted(v)[len(v) // 2] for k, v in soak.latency.items() if v},
        "rss_mb": {"first": rss[0][1] / mb, "warm": warm[1] / mb, "warm_at_s": warm[0],
                   "max": max(r[1] for r in rss) / mb, "last": rss[-1][1] / mb,
                   "growth_after_warm": (rss[-1][1] - warm[1]) / mb,
                   "engine_stub_first": rss[0][2] / mb, "engine_stub_last": rss[-1][2] / mb},
        "rss_curve_mb": [(t, round(a / mb, 1), round(e / mb, 1)) for t, a, e in rss[::6]],
        "after_drain": after, "drain_s": round(drain_s, 1), "hung_clients": hung_clients,
        "no_terminal": outcomes.get("no_terminal", 0), "crashes": crashes, "nice": os.nice(0),
    }
    path = write_result("soak", "smollm2", data, suffix=args.suffix)
    print(f"wrote {path}")
    print_table([{"outcome": o, "requests": n} for o, n in outcomes.most_common()],
                f"soak: {args.minutes:g} min, {args.concurrency} clients, {total} requests")
    print_table([{"error": e, "count": n} for e, n in soak.errors.most_common(10)],
                "errors by kind")
    r = data["rss_mb"]
    print_table([{"rss_first_mb": round(r["first"]), "rss_warm_mb": round(r["warm"]),
                  "rss_max_mb": round(r["max"]), "rss_last_mb": round(r["last"]),
                  "growth_after_warm_mb": round(r["growth_after_warm"], 1),
                  "kv_after_drain": after.get("kv_cache_usage_perc"),
                  "running": after.get("num_requests_running"),
                  "waiting": after.get("num_requests_waiting"),
                  "no_terminal": data["no_terminal"], "crashes": crashes}],
                "soak: memory and drain")


if __name__ == "__main__":
    main()
