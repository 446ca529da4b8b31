"""W6 through Triton vs the offline engine, in one run: SmolLM2-135M on the CPU, 16 concurrent
gRPC streams of 64 prompt / 64 output token ids (ignore_eos) to the `engine` model, against
LLM.generate on the same requests. The ratio is the serving overhead."""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, print_table, random_prompts, timed_greedy, write_result


def run_triton(model_dir: str, prompts, n_out: int, model: str) -> tuple[float, int]:
    from client.triton_client import TritonLLMClient
    from pagedbackend.serving.launcher import TritonServer, free_port, materialize_repository
    work = Path(tempfile.mkdtemp(prefix="pagedbackend-w6-"))
    repo = materialize_repository(work / "repo", {"model": model_dir, "max_model_len": "1024"})
    server = TritonServer(repo, work, free_port(), free_port(), free_port())
    log = open(work / "tritonserver.log", "w")
    server.start(stdout=log, stderr=log)
    try:
        server.wait_ready(timeout=300)
        counts = [0] * len(prompts)

        def one(i, ids, max_tokens):
            with TritonLLMClient(server.grpc_url, model=model) as c:
                kw = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True)
                if model == "engine":
                    counts[i] = sum(d.num_output_tokens for d in c.stream(input_ids=ids, **kw))
                else:
                    counts[i] = sum(d.num_output_tokens for d in c.stream(ids, **kw))

        one(0, prompts[0], 4)                                 # warm-up
        threads = [threading.Thread(target=one, args=(i, p, n_out)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0, sum(counts)
    finally:
        server.stop()
        log.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--len", type=int, default=64)
    a = ap.parse_args()
    prompts = random_prompts(a.requests, a.len)
    secs_t, toks_t = run_triton(a.model_dir, prompts, a.len, "engine")
    assert toks_t == a.requests * a.len, toks_t
    from pagedbackend import LLM
    llm = LLM(a.model_dir, max_model_len=1024)
    _, secs_o = timed_greedy(llm, [{"prompt_token_ids": p} for p in prompts], a.len,
                             warmup_tokens=4)
    tps_t, tps_o = toks_t / secs_t, a.requests * a.len / secs_o
    res = {"requests": a.requests, "prompt_len": a.len, "output_len": a.len,
           "output_tokens_per_s": tps_t, "baseline_output_tokens_per_s": tps_o,
           "baseline": "offline LLM.generate, same requests, same run", "ratio": tps_t / tps_o,
           "roofline_fraction": None}
    write_result("W6-triton", "smollm2-135m", res)
    print_table([{"workload": "W6 via Triton", "triton_tok_s": tps_t, "offline_tok_s": tps_o,
                  "ratio": tps_t / tps_o}], "W6 through Triton vs offline (CPU)")


if __name__ == "__main__":
    main()
