"""W6: SmolLM2-135M-Instruct on the CPU, 16 concurrent requests of 64 prompt / 64 output tokens:
our engine (LLM.generate) vs transformers `generate` on the same batch, in the same run."""
from __future__ import annotations

import argparse
import os

import torch

from common import ROOT, print_table, random_prompts, timed, timed_greedy, write_result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--len", type=int, default=64)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from pagedbackend import LLM
    prompts = random_prompts(a.requests, a.len)
    gen = dict(max_new_tokens=a.len, do_sample=False, pad_token_id=0)
    baselines = {}
    # transformers as loaded by default (the checkpoint's float32), and in bf16 like our engine.
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None     # like ignore_eos: every request runs a.len
        with torch.no_grad():
            hf.generate(torch.tensor(prompts[:2]), max_new_tokens=4, do_sample=False,
                        pad_token_id=0)
            out, secs = timed(hf.generate, torch.tensor(prompts), **gen)
        baselines[str(dtype).split(".")[-1]] = (out, secs)
        del hf
    hf_out, hf_secs = baselines["float32"]
    hf_tps = a.requests * a.len / hf_secs
    bf16_tps = a.requests * a.len / baselines["bfloat16"][1]
    llm = LLM(a.model)
    outs, secs = timed_greedy(llm, [{"prompt_token_ids": p} for p in prompts], a.len,
                              warmup_tokens=4, warmup_prompts=2)
    tps = a.requests * a.len / secs
    same = sum(o.outputs[0].token_ids == baselines["bfloat16"][0][i, a.len:].tolist()
               for i, o in enumerate(outs))
    res = {"requests": a.requests, "prompt_len": a.len, "output_len": a.len,
           "threads": torch.get_num_threads(), "output_tokens_per_s": tps, "seconds": secs,
           "baseline_output_tokens_per_s": hf_tps, "baseline_seconds": hf_secs,
           "ratio": tps / hf_tps, "dtype": llm.engine.info.dtype,
           "baseline_bf16_output_tokens_per_s": bf16_tps, "ratio_vs_bf16_baseline": tps / bf16_tps,
           "greedy_outputs_equal_to_bf16_baseline": f"{same}/{a.requests}",
           "roofline_fraction": None}
    write_result("W6", "smollm2-135m", res)
    print_table([{"workload": "W6", "ours_tok_s": tps, "ours_dtype": res["dtype"],
                  "hf_f32_tok_s": hf_tps, "ratio": res["ratio"], "hf_bf16_tok_s": bf16_tps,
                  "ratio_vs_bf16": res["ratio_vs_bf16_baseline"],
                  "same_as_hf_bf16": res["greedy_outputs_equal_to_bf16_baseline"]}],
                "W6 (CPU)")


if __name__ == "__main__":
    main()
