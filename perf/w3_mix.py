"""W3: the nano-vllm mix, offline: 256 requests, seed 0, prompt length and max_tokens each
uniform in [100, 1024], token ids in [0, 10000), temperature 0.6, ignore_eos."""
from __future__ import annotations

import argparse
import random

from common import (AB_HELP, LIMITS, dummy_model_dir, engine_overrides, output_tokens,
                    print_table, run_variants, timed, write_result)


def requests(n: int = 256, seed: int = 0):
    from pagedbackend import SamplingParams
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(0, 10000)
                                             for _ in range(rng.randint(100, 1024))]})
        params.append(SamplingParams(temperature=0.6, ignore_eos=True,
                                     max_tokens=rng.randint(100, 1024)))
    return prompts, params


def run(llm, model_name: str, workload: str = "W3", suffix: str = "") -> dict:
    prompts, params = requests()
    llm.generate(prompts[:4], [p.clone(max_tokens=8) for p in params[:4]])   # warm-up
    llm.engine.timing_summary(reset=True)
    outs, secs = timed(llm.generate, prompts, params)
    step_split = llm.engine.timing_summary()
    toks = output_tokens(outs)
    assert toks == sum(p.max_tokens for p in params)
    tps = toks / secs
    res = {"requests": len(prompts), "seconds": secs, "output_tokens_per_s": tps,
           "step_split": step_split, "roofline_fraction": tps / LIMITS["W3"],
           "preemptions": llm.engine.stats().num_preemptions}
    write_result(workload, model_name, res, suffix)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--ab", default="", help=AB_HELP)
    a = ap.parse_args()
    from pagedbackend import LLM

    def make_llm(**kw):
        return LLM(dummy_model_dir(a.model), load_format="dummy", max_model_len=4096,
                   **engine_overrides(), **kw, max_num_seqs=a.max_num_seqs)
    rows = []

    def body(llm, label):
        res = run(llm, a.model, suffix="" if label == "default" else label)
        rows.append({"workload": "W3", "model": a.model, "variant": label,
                     **{k: v for k, v in res.items() if k != "step_split"}})   # in the JSON
    run_variants(a.ab, make_llm, body)
    print_table(rows, "W3")


if __name__ == "__main__":
    main()
