"""What structured outputs cost: the same requests free, under a JSON schema and under a regex,
in one process (same engine settings, one engine per variant), reported per output token.

A grammar row costs a bitmask fill on the host per step (xgrammar) and, with async scheduling,
the overlap of that row's steps (a request with a grammar is never launched with a step in
flight). Grammars need the model's tokenizer, which the dummy-weight configs of perf/configs
lack: SmolLM2 (default), or any model directory that has one.
"""
from __future__ import annotations

import argparse
import os

from common import ROOT, print_table, random_prompts, timed, write_result

# A JSON object whose one string can run on: the output is held to the grammar at every token
# without the grammar ending early.
SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
VARIANTS = {"free": None, "json_schema": {"json": SCHEMA}, "regex": {"regex": "[a-z ]{1,400}"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"),
                    help="a model directory with its tokenizer")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--len", type=int, default=64, help="prompt and max output tokens")
    a = ap.parse_args()
    from pagedbackend import LLM, SamplingParams
    prompts = [{"prompt_token_ids": p} for p in random_prompts(a.requests, a.len)]
    rows = []
    for name, spec in VARIANTS.items():
        llm = LLM(a.model, max_model_len=4 * a.len)
        params = SamplingParams(temperature=0, max_tokens=a.len, structured_outputs=spec)
        llm.generate(prompts[:2], params.clone(max_tokens=4))           # warm-up, compile
        llm.engine.timing_summary(reset=True)
        outs, secs = timed(llm.generate, prompts, params)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        split = llm.engine.timing_summary()
        rows.append({"variant": name, "output_tokens": tokens, "seconds": secs,
                     "output_tokens_per_s": tokens / secs, "step_ms": split["step_ms"],
                     "host_ms": split["host_ms"], "steps": split["steps"],
                     "async": llm.engine.async_scheduling})
        llm.engine.shutdown()
        del llm
    free = rows[0]["output_tokens_per_s"]
    for r in rows:
        r["vs_free"] = r["output_tokens_per_s"] / free
    write_result("structured", os.path.basename(os.path.normpath(a.model)),
                 {"requests": a.requests, "len": a.len, "variants": rows,
                  "output_tokens_per_s": free, "roofline_fraction": None})
    print_table(rows, f"structured outputs, {a.requests} requests x {a.len} tokens")


if __name__ == "__main__":
    main()
