"""W4's requests at a Poisson request rate into the engine itself, in this process: no Triton,
no gRPC, no detokenizer. It isolates the engine's share of serving latency, and --ab compares
engine variants at one load in one process (a Triton server takes ~60 s to start on the H200).

The requests are serve_bench's (500 ShareGPT-shaped, seed 0, token ids, greedy, ignore_eos),
sent at the same seeded exponential gaps; the engine runs with the Triton engine model's
settings (model_repository/engine/config.pbtxt, as perf/w4_offline.py). The clock is this
process's: a request is "sent" when its arrival time passes, a chunk "arrives" when the step
that produced it returns. TTFT, TPOT and ITL as serve_bench (vLLM's definitions).

    python perf/w4_engine_rate.py --rates 16 --ab nopdl,default
    python perf/w4_engine_rate.py --model-dir models/smollm2-135m-instruct --name smollm2 \
        --setting load_format=auto --setting dtype=auto --num-prompts 20 --scale 0.1 --rates 8
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import numpy as np

from common import AB_HELP, ROOT, print_table, run_variants, write_result
from serve_bench import Trace, arrival_gaps, make_samples, summarize
from w4_offline import engine_params
from w4_tools import settings_of


def replay(engine, samples, rate: float, seed: int, salt: str) -> tuple[dict, list[Trace]]:
    """Feed samples at Poisson arrivals (rate per second; inf: all at once) while stepping the
    engine; returns serve_bench's summary and the per-request traces."""
    from pagedbackend import SamplingParams
    due = np.cumsum(arrival_gaps(len(samples), rate, seed))
    traces = [Trace() for _ in samples]
    nxt, left = 0, len(samples)
    t0 = time.perf_counter()
    while left:
        now = time.perf_counter() - t0
        while nxt < len(samples) and due[nxt] <= now:
            s = samples[nxt]
            engine.add_request(str(nxt), {"prompt_token_ids": s.prompt_ids},
                               SamplingParams(temperature=0.0, max_tokens=s.output_len,
                                              ignore_eos=True),
                               cache_salt=salt, detokenize=False)   # as the engine model
            traces[nxt].sent = t0 + due[nxt]   # its arrival, even if the loop saw it late
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(due[nxt] - now, 0.01)))
            continue
        outs = engine.step()
        stamp = time.perf_counter()
        for out in outs:
            t = traces[int(out.request_id)]
            n = len(out.outputs[0].delta_token_ids)
            if n:
                t.chunks.append(stamp)
                t.tokens += n
            if out.finished:
                t.done = True
                left -= 1
    return summarize(traces, samples), traces


def eager_share(split: dict):
    """The fraction of steps launched kernel by kernel (no CUDA graph), or None."""
    paths = split.get("path_steps")
    if not paths or not sum(paths.values()):
        return None
    return round((paths["eager"] + paths["mixed_eager"]) / sum(paths.values()), 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "dummy", "llama-3.1-8b"))
    ap.add_argument("--name", default="llama-3.1-8b", help="model name for the result file")
    ap.add_argument("--setting", action="append", default=[],
                    help="engine setting k=v (default: load_format=dummy dtype=bfloat16 "
                         "max_model_len=4096, as w4_gpu.sh)")
    ap.add_argument("--rates", default="16",
                    help="comma-separated request rates (inf: all at once)")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--ab", default="", help=AB_HELP)
    a = ap.parse_args()
    from pagedbackend import LLM
    from pagedbackend.serving.settings import engine_config

    pairs = a.setting or ["load_format=dummy", "dtype=bfloat16", "max_model_len=4096"]
    params = engine_params({"model": a.model_dir, **settings_of(pairs)})
    samples = make_samples(a.num_prompts, a.seed, a.scale, "engine", a.model_dir)
    warm = make_samples(a.warmup, a.seed + 1, a.scale, "engine", a.model_dir)
    rows = []

    def make_llm(**overrides):
        config = dataclasses.replace(engine_config(params, ROOT), **overrides)
        return LLM(**dataclasses.asdict(config))

    def body(llm, label):
        engine = llm.engine
        if warm:
            replay(engine, warm, math.inf, a.seed + 1, "warmup")
        for r in a.rates.split(","):
            rate = float(r)
            engine.timing_summary(reset=True)
            res, _ = replay(engine, samples, rate, a.seed, f"rate-{r}-{label}")
            split = engine.timing_summary()
            res.update({"request_rate": r, "num_prompts": a.num_prompts, "scale": a.scale,
                        "target_model": "engine-in-process", "variant": label,
                        "engine_parameters": params, "step_split": split,
                        "roofline_fraction": None})
            suffix = f"inproc-{r}" + ("" if label == "default" else f"-{label}")
            write_result("W4", a.name, res, suffix)
            rows.append({"variant": label, "rate": r, "req_s": res["request_throughput"],
                         "out_tok_s": res["output_throughput"],
                         "ttft_med_ms": res["median_ttft_ms"], "ttft_p99_ms": res["p99_ttft_ms"],
                         "tpot_med_ms": res["median_tpot_ms"], "itl_p99_ms": res["p99_itl_ms"],
                         "step_ms": split.get("step_ms"),
                         "tokens_per_step": split.get("tokens_per_step"),
                         "eager_steps": eager_share(split)})
    run_variants(a.ab, make_llm, body)
    print_table(rows, f"W4 in process, engine only ({a.name})")


if __name__ == "__main__":
    main()
