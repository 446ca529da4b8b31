"""W5: the W3 requests through transformers `generate` (static batches: left padding, no paged
cache) and through our engine, on the same GPU in the same run. Reports the ratio.

transformers runs first (its memory is freed before our engine sizes its KV pool). Its static
batch is timed for at most --hf-max-seconds (generate's max_time); only the tokens each request
asked for count, so padding and over-generation are not credited.
"""
from __future__ import annotations

import argparse
import gc
import time

from common import (dummy_model_dir, engine_overrides, output_tokens, print_table,
                    profile_generate, timed, write_result)
from w3_mix import requests


def run_transformers(model_dir: str, prompts, params, batch_size: int, max_seconds: float) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    useful, t_total, steps_all = 0, 0.0, []
    deadline = time.perf_counter() + max_seconds
    for i in range(0, len(prompts), batch_size):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        ids = [p["prompt_token_ids"] for p in prompts[i:i + batch_size]]
        want = [p.max_tokens for p in params[i:i + batch_size]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids], device="cuda")
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device="cuda")
        with torch.no_grad():
            out, secs = timed(model.generate, input_ids=input_ids, attention_mask=mask,
                              max_new_tokens=max(want), min_new_tokens=max(want),
                              do_sample=True, temperature=0.6, top_k=0, pad_token_id=0,
                              max_time=left)
        steps = out.shape[1] - width
        steps_all.append(steps)
        useful += sum(min(w, steps) for w in want)
        t_total += secs
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"output_tokens_per_s": useful / t_total, "seconds": t_total, "tokens": useful,
            "steps_per_batch": steps_all, "batch_size": batch_size}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hf-batch-size", type=int, default=256)
    ap.add_argument("--hf-max-seconds", type=float, default=60.0)
    ap.add_argument("--profile", action="store_true",
                    help="after the timed run, the same mix (seed 1: new prompts, so no prefix "
                         "cache hits) under torch.profiler: where our time goes, by kernel")
    a = ap.parse_args()
    prompts, params = requests()
    mdir = dummy_model_dir(a.model)
    hf = run_transformers(mdir, prompts, params, a.hf_batch_size, a.hf_max_seconds)
    from pagedbackend import LLM
    llm = LLM(mdir, load_format="dummy", max_model_len=4096, max_num_seqs=512,
              **engine_overrides())
    llm.generate(prompts[:4], [p.clone(max_tokens=8) for p in params[:4]])   # warm-up
    llm.engine.timing_summary(reset=True)
    outs, secs = timed(llm.generate, prompts, params)
    step_split = llm.engine.timing_summary()
    ours = output_tokens(outs) / secs
    res = {"output_tokens_per_s": ours, "seconds": secs,
           "baseline_output_tokens_per_s": hf["output_tokens_per_s"],
           "ratio": ours / hf["output_tokens_per_s"], "baseline": hf,
           "step_split": step_split, "roofline_fraction": None}
    write_result("W5", a.model, res)
    if a.profile:
        profile_generate(llm, *requests(seed=1), "W5", rows=28)
    print_table([{"workload": "W5", "model": a.model, "ours_tok_s": ours,
                  "transformers_tok_s": hf["output_tokens_per_s"], "ratio": res["ratio"],
                  "hf_steps": str(hf["steps_per_batch"])}], "W5")


if __name__ == "__main__":
    main()
