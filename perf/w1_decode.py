"""W1: batch-1 decode, llama-3.1-8b dummy weights: 1 request, 128 prompt / 128 output tokens.

Reports output tokens/s and MBU = weight bytes read per step x decode tokens/s / 4.27 TB/s.
"""
from __future__ import annotations

import argparse

from common import (H200_BW, LIMITS, decode_tokens_per_s, dummy_model_dir, engine_overrides,
                    print_table, profile_generate, random_prompts, timed_greedy, write_result)


def weight_bytes_per_step(model) -> int:
    """Every parameter is read each decode step except the (untied) embedding table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.model.embed_tokens.weight
    tied = model.lm_head.weight is emb
    return total if tied else total - emb.numel() * emb.element_size()


def run(llm, model_name: str, prompt_len: int = 128, output_len: int = 128,
        suffix: str = "") -> dict:
    prompt = {"prompt_token_ids": random_prompts(1, prompt_len)[0]}
    outs, secs = timed_greedy(llm, [prompt], output_len)
    step_split = llm.engine.timing_summary()
    out = outs[0]
    decode_tps = decode_tokens_per_s(out, secs)
    wb = weight_bytes_per_step(llm.engine.runner.model)
    res = {"output_tokens_per_s": output_len / secs, "decode_tokens_per_s": decode_tps,
           "ttft_ms": (out.first_token_time - out.arrival_time) * 1e3,
           "weight_bytes_per_step": wb, "mbu": wb * decode_tps / H200_BW,
           "step_split": step_split, "roofline_fraction": decode_tps / LIMITS["W1"]}
    write_result("W1", model_name, res, suffix)
    return res


# In-process A/B variants (--ab): the same process, so the same skinny-GEMM tile choices.
def _variant(name: str) -> None:
    from pagedbackend.kernels import common, gemv
    if name == "nopdl":
        common.PDL_ENABLED = False
    elif name == "cublas":
        gemv.ENABLED = False
    else:
        raise SystemExit(f"--ab {name!r}: must be nopdl or cublas")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also profile 32 decode steps")
    ap.add_argument("--ab", default="", help="comma-separated variants to run after the main "
                    "one in the same process: nopdl (plain launches), cublas (no skinny GEMM)")
    a = ap.parse_args()
    from pagedbackend import LLM
    llm = LLM(dummy_model_dir(a.model), load_format="dummy", max_model_len=4096,
              **engine_overrides(), max_num_seqs=8, enforce_eager=a.enforce_eager)
    res = run(llm, a.model)
    if a.profile:
        from pagedbackend import SamplingParams
        profile_generate(llm, {"prompt_token_ids": random_prompts(1, 128)[0]},
                         SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), "W1",
                         cycle={"_skinny_kernel": 4})
    rows = [{"workload": "W1", "variant": "default", **res}]
    done = []
    for name in filter(None, a.ab.split(",")):
        import gc

        import torch
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        _variant(name)        # cumulative: "cublas" after "nopdl" has both
        done.append(name)
        label = "-".join(done)
        llm = LLM(dummy_model_dir(a.model), load_format="dummy", max_model_len=4096,
                  **engine_overrides(), max_num_seqs=8, enforce_eager=a.enforce_eager)
        rows.append({"workload": "W1", "variant": label, **run(llm, a.model, suffix=label)})
        if a.profile and name == "nopdl":     # kernel times are honest without PDL overlap
            from pagedbackend import SamplingParams
            profile_generate(llm, {"prompt_token_ids": random_prompts(1, 128)[0]},
                             SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                             "W1-nopdl", cycle={"_skinny_kernel": 4})
    keys = ("workload", "variant", "output_tokens_per_s", "decode_tokens_per_s", "ttft_ms", "mbu")
    print_table([{**{k: r[k] for k in keys}, "step_ms": r["step_split"]["step_ms"]}
                 for r in rows], f"W1 {a.model}")


if __name__ == "__main__":
    main()
