"""Plumbing for perf/w4_gpu.sh (W4 serving on one model through Triton); measures nothing itself.

    w4_tools.py serve --model-dir DIR --state F --log L [--setting k=v ...]   # hold a server
    w4_tools.py pa-input --model-dir DIR --out-dir D --concurrency 16 64      # perf_analyzer data
    w4_tools.py summary --name N --gpu G --rates "inf 16 4" --out-dir D --since T
    w4_tools.py stats --http H:P --out-dir D --label L     # per-model Triton statistics

`serve` starts tritonserver through pagedbackend.serving.launcher (the repository materialised
with the engine settings substituted, free ports on 127.0.0.1), writes a shell-sourceable state
file (URLs, the server's process group, READY=1 once ready) and stops the server and its stubs
(the whole process group) on SIGTERM or when the server dies.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, print_table


def settings_of(pairs: list[str]) -> dict[str, str]:
    out = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if not sep:
            sys.exit(f"--setting {kv!r} is invalid: must be key=value")
        out[key] = value
    return out


# -- serve ------------------------------------------------------------------------------------
def write_state(path: str, **values) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for k, v in values.items():
            f.write(f"{k}={v}\n")
    os.replace(tmp, path)


def serve(a) -> int:
    from pagedbackend.serving.launcher import TritonServer, free_port, materialize_repository

    work = Path(tempfile.mkdtemp(prefix="pagedbackend-w4-"))
    overrides = {"model": a.model_dir, **settings_of(a.setting)}
    repo = materialize_repository(work / "repo", overrides)
    server = TritonServer(repo, work, free_port(), free_port(), free_port())
    print("engine parameters:", json.dumps(overrides), flush=True)
    print("tritonserver:", " ".join(server.cmd), flush=True)

    def on_signal(signum, frame):
        # once: a second SIGTERM (the script's trap after a timeout's) must not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log = open(a.log, "w")
    try:
        server.start(stdout=log, stderr=log)
        state = dict(GRPC_URL=server.grpc_url, HTTP_URL=server.http_url,
                     METRICS_URL=server.metrics_url, SERVER_PGID=server.proc.pid)
        write_state(a.state, READY=0, **state)
        t0 = time.monotonic()
        server.wait_ready(timeout=a.timeout)
        write_state(a.state, READY=1, START_S=f"{time.monotonic() - t0:.1f}", **state)
        print(f"ready after {time.monotonic() - t0:.1f}s: gRPC {server.grpc_url}", flush=True)
        while server.proc.poll() is None:
            time.sleep(0.5)
        print(f"tritonserver exited with code {server.proc.returncode}", flush=True)
        return 1
    except (RuntimeError, TimeoutError) as e:
        print(f"tritonserver did not become ready: {e}", flush=True)
        return 1
    finally:
        server.stop()
        log.close()
        shutil.rmtree(work, ignore_errors=True)
        print("tritonserver stopped", flush=True)


# -- perf_analyzer input ----------------------------------------------------------------------
def pa_input(a) -> None:
    """W4's mean shape (prompt ~202, output ~179 tokens at scale 1) as `--prompts` different
    texts, greedy, ignore_eos; one file per concurrency with its own cache salt, so a level does
    not start on the prefix cache the previous one filled."""
    from serve_bench import MEAN_OUTPUT, MEAN_PROMPT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    rng = random.Random(a.seed)
    n_prompt = max(4, round(MEAN_PROMPT * a.scale))
    max_tokens = max(2, round(MEAN_OUTPUT * a.scale))
    texts = [tok.decode([rng.randrange(100, 10000) for _ in range(n_prompt)])
             for _ in range(a.prompts)]
    lens = [len(ids) for ids in tok(texts)["input_ids"]]
    with open(os.path.join(HERE, "ensemble_input.json")) as f:
        base = json.load(f)["data"][0]
    os.makedirs(a.out_dir, exist_ok=True)
    for c in a.concurrency:
        data = []
        for text in texts:
            entry = dict(base)
            entry.update({"text_input": {"content": [text], "shape": [1]},
                          "max_tokens": {"content": [max_tokens], "shape": [1]},
                          "temperature": {"content": [0.0], "shape": [1]},
                          "ignore_eos": {"content": [True], "shape": [1]},
                          "stream": {"content": [True], "shape": [1]},
                          "cache_salt": {"content": [f"pa-c{c}"], "shape": [1]}})
            data.append(entry)
        with open(os.path.join(a.out_dir, f"pa_input_c{c}.json"), "w") as f:
            json.dump({"data": data}, f)
    print(f"perf_analyzer input: {a.prompts} prompts of {min(lens)}-{max(lens)} tokens "
          f"(mean {sum(lens) / len(lens):.0f}), max_tokens {max_tokens}")


# -- summary ----------------------------------------------------------------------------------
def fresh_result(stem: str, since: float):
    """The newest perf/results/<stem>[-...].json written after `since` (write_result may add a
    suffix, e.g. -sync), or None: a step that failed this run never shows an older file."""
    paths = [p for p in glob.glob(os.path.join(HERE, "results", stem + "*.json"))
             if os.path.getmtime(p) >= since and os.path.basename(p)[len(stem):] in
             (".json", "-sync.json")]
    if not paths:
        return None
    with open(max(paths, key=os.path.getmtime)) as f:
        return json.load(f)


def merge_pa(out_dir: str, since: float, dst: list[str]) -> list[dict]:
    """One CSV from the per-concurrency perf_analyzer CSVs (header once), written to dst."""
    rows, header = [], None
    for path in sorted(glob.glob(os.path.join(out_dir, "pa-c*.csv")),
                       key=lambda p: int(os.path.basename(p)[4:-4])):
        if os.path.getmtime(path) < since:
            continue
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = header or reader.fieldnames
            rows += [r for r in reader if r.get("Concurrency")]
    if header and rows:
        for d in dst:
            os.makedirs(os.path.dirname(d), exist_ok=True)
            with open(d, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
                w.writeheader()
                w.writerows(rows)
    return rows


def num(v, scale: float = 1.0):
    try:
        return float(v) * scale
    except (TypeError, ValueError):
        return None


def summary(a) -> None:
    res_dir = os.path.join(HERE, "results")
    rows = []
    variants = [(r, a.name, "ensemble") for r in a.rates.split()]
    variants += [(r, f"{a.name}-engine", "engine") for r in a.engine_rates.split()]
    for rate, name, target in variants:
        r = fresh_result(f"W4-{name}-{a.gpu}-{rate}", a.since)
        if r is None:
            if target == "ensemble":
                rows.append({"target": target, "rate": rate, "completed": "not run/failed"})
            continue
        rows.append({"target": r.get("target_model", target), "rate": rate,
                     "completed": r["completed"],
                     "failed": r["failed"], "req_s": r["request_throughput"],
                     "out_tok_s": r["output_throughput"], "ttft_med_ms": r["median_ttft_ms"],
                     "ttft_p99_ms": r["p99_ttft_ms"], "tpot_med_ms": r["median_tpot_ms"],
                     "itl_p99_ms": r["p99_itl_ms"],
                     "client_cpu": r.get("client_cpu_fraction")})

    pa_name = f"perf_analyzer-{a.name}-{a.gpu}.csv"
    pa_rows = merge_pa(a.out_dir, a.since, [os.path.join(res_dir, pa_name),
                                             os.path.join(a.out_dir, pa_name)])
    pa_table = []
    for r in pa_rows:
        pa_table.append({"concurrency": r.get("Concurrency"),
                         "infer_s": num(r.get("Inferences/Second")),
                         "responses_s": num(r.get("Response Throughput")),
                         "p50_lat_ms": num(r.get("p50 latency"), 1e-3),
                         "p90_lat_ms": num(r.get("p90 latency"), 1e-3),
                         "p99_lat_ms": num(r.get("p99 latency"), 1e-3)})
    for c in a.concurrency:
        if not any(str(c) == str(r["concurrency"]) for r in pa_table):
            pa_table.append({"concurrency": c, "infer_s": "not run/failed"})

    off = fresh_result(f"W4-offline-vs-triton-{a.name}-{a.gpu}", a.since)
    print(f"\nW4 {a.name} on {a.gpu}: files in perf/results/ and {a.out_dir}")
    print_table(rows, "W4 through Triton (serve_bench, gRPC streaming, client clock)")
    print_table(pa_table, "perf_analyzer (ensemble, streaming; responses/s ~ tokens/s; "
                         "latency = whole request)")
    if off is None:
        print("\n== offline vs Triton ==\nnot run/failed")
        return
    ratio = off.get("ratio")
    print_table([{"offline_req_s": off["offline_request_throughput"],
                  "offline_tok_s": off["offline_output_throughput"],
                  "triton_tok_s": off.get("triton_output_throughput"),
                  "ratio": ratio, "engine_ratio": off.get("ratio_engine_target"),
                  "goal>=0.9": None if ratio is None or math.isnan(ratio) else ratio >= 0.9}],
                "offline LLM.generate vs Triton (rate inf, output tok/s)")


# -- stats ------------------------------------------------------------------------------------
STAT_KEYS = ("queue", "compute_input", "compute_infer", "compute_output")


def model_stats(http: str) -> dict[str, dict]:
    """Triton's cumulative statistics per model (GET /v2/models/stats): counts and nanoseconds."""
    import urllib.request

    with urllib.request.urlopen(f"http://{http}/v2/models/stats", timeout=10) as r:
        raw = json.load(r)
    out = {}
    for m in raw.get("model_stats", []):
        inf = m.get("inference_stats", {})
        row = {"inferences": int(m.get("inference_count", 0)),
               "executions": int(m.get("execution_count", 0))}
        for k in STAT_KEYS:
            row[f"{k}_ns"] = int(inf.get(k, {}).get("ns", 0))
        out[m["name"]] = row
    return out


def stats(a) -> None:
    """Snapshot the statistics into OUT/stats-LABEL.json and print what changed since the
    previous snapshot (OUT/stats-last.json): per model, requests, executions, mean queue wait
    and mean execute time per request, and the model's busy time (sum of compute) over the
    interval's wall time — a Python model near 1.0 is the hop the chain waits on."""
    os.makedirs(a.out_dir, exist_ok=True)
    now = time.time()
    cur = model_stats(a.http)
    last_path = os.path.join(a.out_dir, "stats-last.json")
    prev, t_prev = {}, None
    if os.path.exists(last_path):
        with open(last_path) as f:
            old = json.load(f)
        prev, t_prev = old["models"], old["time"]
    snap = {"time": now, "label": a.label, "models": cur}
    for path in (os.path.join(a.out_dir, f"stats-{a.label}.json"), last_path):
        with open(path, "w") as f:
            json.dump(snap, f, indent=1)
    wall = (now - t_prev) if t_prev else None
    rows = []
    for name, c in sorted(cur.items()):
        p = prev.get(name, {})
        d = {k: v - p.get(k, 0) for k, v in c.items()}
        n = max(d["inferences"], 1)
        compute = sum(d[f"{k}_ns"] for k in STAT_KEYS[1:])
        rows.append({"model": name, "requests": d["inferences"], "executions": d["executions"],
                     "queue_ms": d["queue_ns"] / n / 1e6, "compute_ms": compute / n / 1e6,
                     "busy": compute / 1e9 / wall if wall else None})
    print_table(rows, f"Triton model statistics, {a.label}"
                      + (f" ({wall:.1f} s since the previous snapshot)" if wall else ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--model-dir", required=True)
    s.add_argument("--setting", action="append", default=[], help="engine setting k=v")
    s.add_argument("--state", required=True)
    s.add_argument("--log", required=True)
    s.add_argument("--timeout", type=float, default=300)
    p = sub.add_parser("pa-input")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", required=True)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=2)
    m = sub.add_parser("summary")
    m.add_argument("--name", required=True)
    m.add_argument("--gpu", required=True)
    m.add_argument("--rates", required=True)
    m.add_argument("--concurrency", nargs="*", default=[])
    m.add_argument("--engine-rates", default="inf", help="rates also sent to the engine model")
    m.add_argument("--out-dir", required=True)
    m.add_argument("--since", type=float, default=0.0)
    t = sub.add_parser("stats")
    t.add_argument("--http", required=True, help="Triton's HTTP address, host:port")
    t.add_argument("--out-dir", required=True)
    t.add_argument("--label", required=True)
    a = ap.parse_args()
    if a.cmd == "stats":
        return stats(a)
    if a.cmd == "serve":
        sys.exit(serve(a))
    pa_input(a) if a.cmd == "pa-input" else summary(a)


if __name__ == "__main__":
    main()
