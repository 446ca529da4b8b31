"""Tensor-parallel scaling (issue 8): W1 (batch-1 decode, 128/128) and W2 128/128 at TP=1 and
TP=N in one run, llama-3.1-8b dummy weights, plus greedy equality of TP=N with TP=1 on small
random models of each architecture. Writes perf/results/W1-<model>-<gpu>-tp<N>.json and
W2-128-128-<model>-<gpu>-tp<N>.json with `speedup` = TP=N / TP=1 and the all-reduce time per step
(rank 0's collective kernels, torch.profiler over a few steps).

    python perf/tp_scaling.py --tp 2                       # on a machine with >= 2 GPUs
    python perf/tp_scaling.py --tp 2 --smoke               # CPU (gloo), tiny shapes: plumbing only
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

from common import (decode_tokens_per_s, dummy_model_dir, output_tokens, print_table,
                    random_prompts, timed_greedy, write_result)

SMOKE_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
                    intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=10240, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16")


def allreduce_ms_per_step(llm, prompts, params):
    """GPU 0's time in NCCL kernels per engine step (CUPTI sees the device side whichever host
    thread launched them). None on the CPU: gloo's work runs on rank threads the profiler of this
    thread does not record."""
    import torch
    if not torch.cuda.is_available():
        llm.generate(prompts, params)
        return None
    from torch.profiler import ProfilerActivity, profile
    steps0 = llm.engine.timing.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    steps = max(1, llm.engine.timing.steps - steps0)
    total_us = sum((getattr(e, "self_device_time_total", 0.0) or e.self_cuda_time_total)
                   for e in prof.key_averages()
                   if "nccl" in e.key.lower() and "CUDA" in str(e.device_type))
    return total_us / 1e3 / steps


def tp_matches_tp1(arch: str, tp: int) -> dict:
    """Greedy tokens of a small random model, 8 mixed prompts in one batch, TP=tp vs TP=1."""
    import random

    import torch
    from pagedbackend import LLM, SamplingParams
    from pagedbackend.testing import make_hf_checkpoint
    d = tempfile.mkdtemp()
    make_hf_checkpoint(arch, d, seed=1, std=0.1, hidden_size=256, intermediate_size=512,
                       num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                       max_position_embeddings=512,
                       **({"head_dim": 32} if arch == "qwen3" else {}))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 1024) for _ in range(rng.randrange(3, 200))]}
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = {}
    for n in (1, tp):
        llm = LLM(d, dtype="float32", tensor_parallel_size=n, max_model_len=512, max_num_seqs=8,
                  **({"num_kv_blocks": 512} if not torch.cuda.is_available() else {}))
        got[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.shutdown()
        del llm
        gc.collect()
    same = [a == b for a, b in zip(got[1], got[tp])]
    return {"arch": arch, "dtype": "float32", "prompts": len(same), "identical_32": sum(same)}


def measure(model_dir: str, tp: int, w2_requests: int, smoke: bool) -> dict:
    import torch
    from pagedbackend import LLM, SamplingParams
    kw = dict(load_format="dummy", max_model_len=4096, tensor_parallel_size=tp)
    if smoke:
        kw.update(dtype="float32", num_kv_blocks=2048)
    llm = LLM(model_dir, max_num_seqs=512, **kw)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    one = [{"prompt_token_ids": random_prompts(1, 128)[0]}]
    out, secs = timed_greedy(llm, one, 128)
    w1 = decode_tokens_per_s(out[0], secs)
    batch = [{"prompt_token_ids": p} for p in random_prompts(w2_requests, 128)]
    outs, secs = timed_greedy(llm, batch, 128)
    w2 = output_tokens(outs) / secs
    res = {"tp": tp, "w1_decode_tok_s": w1, "w2_out_tok_s": w2,
           "w1_allreduce_ms_per_step": allreduce_ms_per_step(llm, one, greedy(32)),
           "w2_allreduce_ms_per_step": allreduce_ms_per_step(llm, batch[:256], greedy(16))}
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--w2-requests", type=int, default=1024)
    ap.add_argument("--smoke", action="store_true", help="tiny model, CPU-sized (plumbing)")
    a = ap.parse_args()
    if a.smoke:
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(SMOKE_CONFIG, f)
        model_dir, name, a.w2_requests = d, "tiny-smoke", min(a.w2_requests, 32)
    else:
        model_dir, name = dummy_model_dir(a.model), a.model
    t0 = time.perf_counter()
    checks = [tp_matches_tp1(arch, a.tp) for arch in ("llama", "qwen2", "qwen3", "mistral")]
    write_result("tp-correctness", "tiny-random", {"tp_size": a.tp, "rows": checks},
                 suffix=f"tp{a.tp}")
    print_table(checks, f"TP={a.tp} vs TP=1, greedy, first 32 tokens")
    rows = [measure(model_dir, tp, a.w2_requests, a.smoke) for tp in (1, a.tp)]
    base, par = rows
    common = {"tp_size": a.tp, "tp1": base, f"tp{a.tp}": par, "seconds": time.perf_counter() - t0}
    w1 = {**common, "output_tokens_per_s": par["w1_decode_tok_s"],
          "baseline_output_tokens_per_s": base["w1_decode_tok_s"],
          "speedup": par["w1_decode_tok_s"] / base["w1_decode_tok_s"],
          "ratio": par["w1_decode_tok_s"] / base["w1_decode_tok_s"],
          "allreduce_ms_per_step": par["w1_allreduce_ms_per_step"], "roofline_fraction": None}
    w2 = {**common, "output_tokens_per_s": par["w2_out_tok_s"],
          "baseline_output_tokens_per_s": base["w2_out_tok_s"],
          "speedup": par["w2_out_tok_s"] / base["w2_out_tok_s"],
          "ratio": par["w2_out_tok_s"] / base["w2_out_tok_s"],
          "allreduce_ms_per_step": par["w2_allreduce_ms_per_step"], "roofline_fraction": None}
    write_result("W1", name, w1, suffix=f"tp{a.tp}")
    write_result("W2-128-128", name, w2, suffix=f"tp{a.tp}")
    print_table(rows, f"TP scaling, {name} (W1 goal: TP={a.tp} >= 1.6x TP=1)")
    print(f"speedup W1 {w1['speedup']:.2f}x, W2 {w2['speedup']:.2f}x")


if __name__ == "__main__":
    main()
