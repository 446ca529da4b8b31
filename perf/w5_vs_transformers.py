"""W5: the W3 requests through transformers `generate` (static batches: left padding, no paged
cache), through transformers' continuous batching (`ContinuousBatchingManager`: a paged cache,
requests joining and leaving every step, each with its own max_new_tokens), and through our
engine, on the same GPU in the same run. Reports our ratio against both.

transformers runs first (its memory is freed before our engine sizes its KV pool). Its static
batch is timed for at most --hf-max-seconds (generate's max_time); only the tokens each request
asked for count, so padding and over-generation are not credited. Continuous batching gets
--cb-max-seconds; if requests are still running then, only the finished ones count (the figure
is then a lower bound, and says so). A transformers without continuous batching prints
"skipped: <reason>" for it and the rest runs.
"""
from __future__ import annotations

import argparse
import gc
import time

from common import (dummy_model_dir, engine_overrides, output_tokens, print_table,
                    profile_generate, timed, write_result)
from w3_mix import requests


def run_transformers(model, prompts, params, batch_size: int, max_seconds: float) -> dict:
    import torch
    dev = model.device
    useful, t_total, steps_all = 0, 0.0, []
    deadline = time.perf_counter() + max_seconds
    for i in range(0, len(prompts), batch_size):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        ids = [p["prompt_token_ids"] for p in prompts[i:i + batch_size]]
        want = [p.max_tokens for p in params[i:i + batch_size]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids], device=dev)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=dev)
        with torch.no_grad():
            out, secs = timed(model.generate, input_ids=input_ids, attention_mask=mask,
                              max_new_tokens=max(want), min_new_tokens=max(want),
                              do_sample=True, temperature=0.6, top_k=0, pad_token_id=0,
                              max_time=left)
        steps = out.shape[1] - width
        steps_all.append(steps)
        useful += sum(min(w, steps) for w in want)
        t_total += secs
    return {"output_tokens_per_s": useful / t_total, "seconds": t_total, "tokens": useful,
            "steps_per_batch": steps_all, "batch_size": batch_size}


def run_transformers_cb(model, prompts, params, max_seconds: float, warmup: bool = True,
                        cb_config: dict | None = None) -> dict:
    """The same requests through transformers' continuous batching on `model` (loaded with
    attn_implementation="sdpa": transformers switches it to its paged form, or to flash
    attention where installed); the same sampling as run_transformers, EOS never stops a
    request (its max_new_tokens does, as ignore_eos in ours). cb_config: ContinuousBatchingConfig
    fields (None: transformers' own choices, its KV cache sized from free GPU memory).
    {"skipped": reason} where this transformers has no continuous batching."""
    import torch
    from transformers import GenerationConfig
    if not hasattr(model, "init_continuous_batching"):
        return {"skipped": "this transformers has no init_continuous_batching"}
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0,
                           max_new_tokens=max(p.max_tokens for p in params), eos_token_id=None)
    try:
        kw = {}
        if cb_config:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
            kw["continuous_batching_config"] = ContinuousBatchingConfig(**cb_config)
        manager = model.init_continuous_batching(generation_config=gen, **kw)
        if warmup and hasattr(manager, "warmup"):   # CUDA graphs captured before the clock
            manager.warmup()
        manager.start()
    except Exception as e:      # noqa: BLE001  -- an API this script does not know: say so
        return {"skipped": f"continuous batching did not start: {type(e).__name__}: {e}"}
    want = {f"w5-{i}": p.max_tokens for i, p in enumerate(params)}
    t0 = time.perf_counter()
    try:
        for (rid, n), prompt in zip(want.items(), prompts):
            manager.add_request(prompt["prompt_token_ids"], request_id=rid, max_new_tokens=n,
                                eos_token_id=-1)
        useful, done, errors = 0, 0, []
        deadline = t0 + max_seconds
        while done + len(errors) < len(want) and time.perf_counter() < deadline:
            r = manager.get_result(timeout=1.0)
            if r is None or not r.is_finished():
                if r is None and not manager.is_running():
                    errors.append("the generation thread stopped")
                    break
                continue
            if r.error is not None:
                errors.append(str(r.error)[:200])
            else:
                useful += min(len(r.generated_tokens), want[r.request_id])
                done += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=60, hard_stop=True)
    return {"output_tokens_per_s": useful / secs, "seconds": secs, "tokens": useful,
            "finished": done, "requests": len(want), "partial": done < len(want),
            "errors": errors[:5], "attn_implementation": model.config._attn_implementation}


def load_transformers(model_dir: str, device: str = "cuda", dtype=None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.bfloat16,
                                                attn_implementation="sdpa").eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--hf-batch-size", type=int, default=256)
    ap.add_argument("--hf-max-seconds", type=float, default=60.0)
    ap.add_argument("--cb-max-seconds", type=float, default=90.0,
                    help="transformers' continuous batching: the time it gets for the requests")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed run, the same mix (seed 1: new prompts, so no prefix "
                         "cache hits) under torch.profiler: where our time goes, by kernel")
    a = ap.parse_args()
    import torch
    prompts, params = requests()
    mdir = dummy_model_dir(a.model)
    model = load_transformers(mdir)
    hf = run_transformers(model, prompts, params, a.hf_batch_size, a.hf_max_seconds)
    gc.collect()
    torch.cuda.empty_cache()    # continuous batching sizes its KV cache from free memory
    cb = run_transformers_cb(model, prompts, params, a.cb_max_seconds)
    if "skipped" in cb:
        print(f"transformers continuous batching skipped: {cb['skipped']}")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    from pagedbackend import LLM
    llm = LLM(mdir, load_format="dummy", max_model_len=4096, max_num_seqs=512,
              **engine_overrides())
    llm.generate(prompts[:4], [p.clone(max_tokens=8) for p in params[:4]])   # warm-up
    llm.engine.timing_summary(reset=True)
    outs, secs = timed(llm.generate, prompts, params)
    step_split = llm.engine.timing_summary()
    ours = output_tokens(outs) / secs
    cb_tps = cb.get("output_tokens_per_s")
    res = {"output_tokens_per_s": ours, "seconds": secs,
           "baseline_output_tokens_per_s": hf["output_tokens_per_s"],
           "ratio": ours / hf["output_tokens_per_s"], "baseline": hf,
           "cb_baseline_output_tokens_per_s": cb_tps,
           "ratio_vs_cb": ours / cb_tps if cb_tps else None, "cb_baseline": cb,
           "step_split": step_split, "roofline_fraction": None}
    write_result("W5", a.model, res)
    if a.profile:
        profile_generate(llm, *requests(seed=1), "W5", rows=28)
    print_table([{"workload": "W5", "model": a.model, "ours_tok_s": ours,
                  "transformers_tok_s": hf["output_tokens_per_s"], "ratio": res["ratio"],
                  "hf_steps": str(hf["steps_per_batch"])},
                 {"workload": "W5", "model": a.model, "ours_tok_s": ours,
                  "transformers_tok_s": cb_tps, "ratio": res["ratio_vs_cb"],
                  "hf_steps": "continuous batching" + (
                      f" (skipped: {cb['skipped']})" if "skipped" in cb else
                      f", {cb['finished']}/{cb['requests']} finished, "
                      f"{cb['attn_implementation']}")}], "W5")


if __name__ == "__main__":
    main()
