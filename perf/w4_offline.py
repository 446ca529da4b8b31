"""W4 offline: the same seeded W4 requests as perf/serve_bench.py (500, ShareGPT-shaped lengths,
greedy, ignore_eos), all at once through LLM.generate with the engine settings the Triton engine
model runs with (model_repository/engine/config.pbtxt parameters + the same overrides), and the
ratio Triton / offline in output tokens/s at request rate inf: the serving overhead (goal >= 0.9).

    python perf/w4_offline.py --model-dir models/dummy/llama-3.1-8b --name llama-3.1-8b \
        --setting load_format=dummy --setting dtype=bfloat16 --setting max_model_len=4096

The Triton numbers are read from perf/results/W4-<name>-<gpu>-inf.json (and -engine-) when
written after --since (epoch seconds); run serve_bench first.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

from common import ROOT, gpu_tag, output_tokens, print_table, timed, write_result
from serve_bench import make_samples
from w4_tools import fresh_result, settings_of


def engine_params(overrides: dict[str, str]) -> dict[str, str]:
    """The engine model's config.pbtxt parameters with the overrides, as Triton would pass them."""
    from pagedbackend.serving.settings import parameters_of
    with open(os.path.join(ROOT, "model_repository", "engine", "config.pbtxt")) as f:
        text = f.read()
    params = dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"',
                             text))
    params.update(overrides)
    return parameters_of({"parameters": {k: {"string_value": v} for k, v in params.items()}})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "models", "dummy", "llama-3.1-8b"))
    ap.add_argument("--name", default="llama-3.1-8b", help="model name for the result file")
    ap.add_argument("--setting", action="append", default=[], help="engine setting k=v")
    ap.add_argument("--target", default="ensemble", choices=["engine", "ensemble"],
                    help="ensemble: text prompts, tokenized by the engine (as Triton's tokenizer "
                         "model does); engine: the token ids")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--since", type=float, default=0.0)
    a = ap.parse_args()
    from pagedbackend import LLM, SamplingParams
    from pagedbackend.serving.settings import engine_config

    params = engine_params({"model": a.model_dir, **settings_of(a.setting)})
    config = engine_config(params, ROOT)
    llm = LLM(**dataclasses.asdict(config))

    def batch(samples):
        prompts = [s.prompt_text if a.target == "ensemble" else {"prompt_token_ids": s.prompt_ids}
                   for s in samples]
        sp = [SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True)
              for s in samples]
        return prompts, sp

    if a.warmup:
        llm.generate(*batch(make_samples(a.warmup, a.seed + 1, a.scale, a.target, a.model_dir)))
    samples = make_samples(a.num_prompts, a.seed, a.scale, a.target, a.model_dir)
    llm.engine.timing_summary(reset=True)
    outs, secs = timed(llm.generate, *batch(samples))
    toks = output_tokens(outs)
    res = {"num_prompts": a.num_prompts, "scale": a.scale, "seed": a.seed, "target": a.target,
           "engine_parameters": params, "offline_seconds": secs,
           "offline_request_throughput": len(outs) / secs, "offline_output_throughput": toks / secs,
           "offline_output_tokens": toks,
           "offline_input_tokens": sum(len(o.prompt_token_ids) for o in outs),
           "expected_output_tokens": sum(s.output_len for s in samples),
           "step_split": llm.engine.timing_summary(),
           "baseline": "offline LLM.generate, same requests, same settings, same run",
           "roofline_fraction": None}
    for key, name in (("", a.name), ("_engine_target", f"{a.name}-engine")):
        t = fresh_result(f"W4-{name}-{gpu_tag()}-inf", a.since)
        res[f"triton{key}_output_throughput"] = t["output_throughput"] if t else None
        res[f"triton{key}_request_throughput"] = t["request_throughput"] if t else None
        res[f"ratio{key}"] = t["output_throughput"] / res["offline_output_throughput"] if t else None
    write_result("W4-offline-vs-triton", a.name, res)
    print_table([{"offline_s": secs, "offline_req_s": res["offline_request_throughput"],
                  "offline_tok_s": res["offline_output_throughput"],
                  "triton_tok_s": res["triton_output_throughput"], "ratio": res["ratio"],
                  "engine_ratio": res["ratio_engine_target"]}],
                f"W4 offline vs Triton ({a.name}, rate inf)")


if __name__ == "__main__":
    main()
