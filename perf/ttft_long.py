"""Time to first token of long prompts, one request at a time (no other load): the prefill path
alone (chunked at max_num_batched_tokens), llama-3.1-8b dummy weights by default.

    python perf/ttft_long.py [--lengths 2048,8192,16384] [--ab pagedkv]

For each prompt length: a warm-up request, then three timed ones with prompts of their own (no
prefix-cache hits), max_tokens 1; the median TTFT is reported, with the prefill rate it implies.
`--ab pagedkv` runs the same with the prefill kernel gathering the step's keys from the cache
(prefill.CONTIG_KV off) in the same process.
"""
from __future__ import annotations

import argparse

from common import (AB_HELP, dummy_model_dir, engine_overrides, print_table, random_prompts,
                    run_variants, write_result)


def run(llm, model_name: str, lengths: list[int], suffix: str = "") -> list[dict]:
    from pagedbackend import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rows = []
    for n in lengths:
        prompts = random_prompts(4, n, seed=n)
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        ttfts = []
        for p in prompts[1:]:
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            ttfts.append((out.first_token_time - out.arrival_time) * 1e3)
        ttft = sorted(ttfts)[1]
        rows.append({"prompt_tokens": n, "ttft_ms": ttft, "prefill_tokens_per_s": n / ttft * 1e3,
                     "ttft_runs_ms": ttfts})
    write_result("TTFT-long", model_name, {"output_tokens_per_s": None, "rows": rows}, suffix)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--lengths", default="2048,8192,16384")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--ab", default="", help=AB_HELP)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    from pagedbackend import LLM

    def make_llm(**kw):
        return LLM(dummy_model_dir(a.model), load_format="dummy", max_model_len=a.max_model_len,
                   **engine_overrides(), **kw)
    table = []

    def body(llm, label):
        for r in run(llm, a.model, lengths, "" if label == "default" else label):
            table.append({"variant": label, **{k: v for k, v in r.items()
                                               if k != "ttft_runs_ms"}})
    run_variants(a.ab, make_llm, body)
    print_table(table, "TTFT of long prompts")


if __name__ == "__main__":
    main()
