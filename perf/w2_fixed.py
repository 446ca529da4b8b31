"""W2: fixed lengths, offline, all requests at once (ignore_eos, greedy):
128/128 x 1024, 128/2048 x 512, 2048/128 x 512. Reports output tokens/s."""
from __future__ import annotations

import argparse

from common import (AB_HELP, LIMITS, cuda_alloc_stats, dummy_model_dir, engine_overrides,
                    output_tokens, print_table, profile_generate, random_prompts, run_variants,
                    result_model, timed, write_result)

SHAPES = {"128-128": (128, 128, 1024), "128-2048": (128, 2048, 512), "2048-128": (2048, 128, 512)}


def run(llm, model_name: str, shape: str, suffix: str = "") -> dict:
    from pagedbackend import SamplingParams
    isl, osl, n = SHAPES[shape]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(n, isl)]
    params = SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True)
    llm.engine.timing_summary(reset=True)
    outs, secs = timed(llm.generate, prompts, params)
    step_split = llm.engine.timing_summary()
    toks = output_tokens(outs)
    assert toks == n * osl, (toks, n * osl)
    tps = toks / secs
    res = {"shape": shape, "requests": n, "seconds": secs, "output_tokens_per_s": tps,
           "total_tokens_per_s": (toks + n * isl) / secs,
           "step_split": step_split, "roofline_fraction": tps / LIMITS[f"W2-{shape}"],
           "preemptions": llm.engine.stats().num_preemptions, "cuda_alloc": cuda_alloc_stats()}
    write_result(f"W2-{shape}", model_name, res, suffix)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--shapes", default="128-128,128-2048,2048-128")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--suffix", default="", help="result file suffix (A/B runs)")
    ap.add_argument("--quantization", default=None, help="e.g. fp8: every engine's weights")
    ap.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8: every engine's cache")
    ap.add_argument("--ab-shapes", default="",
                    help="the shapes the --ab variants run (default: --shapes), e.g. to leave "
                         "the long 128-2048 to the default engine")
    ap.add_argument("--profile", action="store_true",
                    help="also profile --profile-shape (default: one wave of W2 128/128: "
                    "8 prefill steps, 128 decode steps of 512 rows)")
    ap.add_argument("--profile-shape", default="128-128-512",
                    help="ISL-OSL-REQUESTS of the profiled run")
    ap.add_argument("--ab", default="", help=AB_HELP)
    a = ap.parse_args()
    from pagedbackend import LLM

    def make_llm(**kw):
        return LLM(dummy_model_dir(a.model), load_format="dummy", max_model_len=4096,
                   **engine_overrides(), **{"quantization": a.quantization,
                                            "kv_cache_dtype": a.kv_cache_dtype, **kw},
                   max_num_seqs=a.max_num_seqs,
                   gpu_memory_utilization=a.gpu_memory_utilization)
    rows = []

    def body(llm, label):
        model, lab = result_model(a.model, "" if label == "default" else label)
        suffix = "-".join(filter(None, (a.suffix, lab)))
        shapes = a.shapes if label == "default" else (a.ab_shapes or a.shapes)
        rows.extend({"variant": label, **run(llm, model, s, suffix)}
                    for s in shapes.split(","))
        if a.profile and label == "default":
            from pagedbackend import SamplingParams
            isl, osl, n = (int(x) for x in a.profile_shape.split("-"))
            profile_generate(llm, [{"prompt_token_ids": p}
                                   for p in random_prompts(n, isl, seed=1)],
                             SamplingParams(temperature=0, max_tokens=osl, ignore_eos=True), "W2",
                             rows=28)
    run_variants(a.ab, make_llm, body)
    print_table(rows, "W2")


if __name__ == "__main__":
    main()
