"""W1: batch-1 decode, llama-3.1-8b dummy weights: 1 request, 128 prompt / 128 output tokens.

Reports output tokens/s and MBU = weight bytes read per step x decode tokens/s / 4.27 TB/s, for
the median of three requests (each with its own prompt, after a warm-up request).
"""
from __future__ import annotations

import argparse

from common import (AB_HELP, H200_BW, LIMITS, decode_tokens_per_s, dummy_model_dir,
                    engine_overrides, print_table, profile_generate, random_prompts,
                    result_model, run_variants, timed, write_result)


def weight_bytes_per_step(model) -> int:
    """Every parameter is read each decode step except the (untied) embedding table; AWQ /
    GPTQ layers' packed codes, scales and zeros are not parameters."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for m in model.modules():
        q = getattr(m, "quant", None)
        if q is not None:
            total += sum(t.numel() * t.element_size() for t in (q.qweight, q.scales, q.zeros))
    emb = model.model.embed_tokens.weight
    tied = model.lm_head.weight is emb
    return total if tied else total - emb.numel() * emb.element_size()


def run(llm, model_name: str, prompt_len: int = 128, output_len: int = 128,
        suffix: str = "", repeats: int = 3) -> dict:
    """One warm-up request, then `repeats` timed requests, each with a prompt of its own (no
    prefix-cache hits: the prefill is the workload's 128 tokens); the median run by output
    tokens/s is reported, every run is recorded."""
    from pagedbackend import SamplingParams
    prompts = random_prompts(repeats + 1, prompt_len, seed=11)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params.clone(max_tokens=16))
    wb = weight_bytes_per_step(llm.engine.runner.model)
    runs = []
    for p in prompts[1:]:
        llm.engine.timing_summary(reset=True)
        outs, secs = timed(llm.generate, [{"prompt_token_ids": p}], params)
        out = outs[0]
        assert len(out.outputs[0].token_ids) == output_len
        decode_tps = decode_tokens_per_s(out, secs)
        runs.append({"output_tokens_per_s": output_len / secs, "decode_tokens_per_s": decode_tps,
                     "ttft_ms": (out.first_token_time - out.arrival_time) * 1e3,
                     "step_split": llm.engine.timing_summary()})
    med = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    res = {**med, "dtype": dtype, "weight_bytes_per_step": wb,
           "mbu": wb * med["decode_tokens_per_s"] / H200_BW,
           "roofline_fraction": med["decode_tokens_per_s"] / LIMITS["W1"],
           "runs": [{k: v for k, v in r.items() if k != "step_split"} for r in runs]}
    write_result("W1", model_name, res, suffix)
    return res


def profile(llm, label: str) -> None:
    from pagedbackend import SamplingParams
    profile_generate(llm, {"prompt_token_ids": random_prompts(1, 128)[0]},
                     SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), label,
                     cycle={"_skinny_kernel": 4, "_packed_gemv_kernel": 4})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also profile 32 decode steps")
    ap.add_argument("--ab", default="", help=AB_HELP)
    ap.add_argument("--quantization", default=None, help="e.g. fp8: every engine's weights")
    ap.add_argument("--suffix", default="", help="result file suffix of every run")
    ap.add_argument("--dtype", default=None,
                    help="every engine's dtype (e.g. float16, as AWQ checkpoints run): one "
                         "engine's tuning instead of --ab fp16's two")
    ap.add_argument("--compiled-baseline", action="store_true",
                    help="then, in this process, the gpt-fast-style torch.compile decoder of the "
                         "same model in bf16 (perf/w1_compiled_baseline.py)")
    a = ap.parse_args()
    from pagedbackend import LLM

    defaults = {"quantization": a.quantization}
    if a.dtype:
        defaults["dtype"] = a.dtype

    def make_llm(**kw):     # a variant's kw (e.g. --ab fp16's dtype) over the defaults
        return LLM(dummy_model_dir(a.model), load_format="dummy", max_model_len=4096,
                   **engine_overrides(), **{**defaults, **kw},
                   max_num_seqs=8, enforce_eager=a.enforce_eager)
    rows = []

    def body(llm, label):
        model, lab = result_model(a.model, "" if label == "default" else label)
        suffix = "-".join(filter(None, (a.suffix, lab)))
        rows.append({"workload": "W1", "variant": label, **run(llm, model, suffix=suffix)})
        # without PDL the kernel times are not inflated by early starts; fp8 weights and fp16
        # compute have kernels of their own
        if a.profile and (label in ("default", "fp16") or label.endswith("nopdl")
                          or "fp8w" in label):
            profile(llm, "W1" if label == "default" else f"W1-{label}")
    run_variants(a.ab, make_llm, body)
    keys = ("workload", "variant", "output_tokens_per_s", "decode_tokens_per_s", "ttft_ms", "mbu")
    table = [{**{k: r[k] for k in keys}, "step_ms": r["step_split"]["step_ms"]} for r in rows]
    print_table(table, f"W1 {a.model}")
    if a.compiled_baseline:     # after our engines are gone: the GPU's memory is its own
        from pagedbackend.kernels.common import COMPILES
        from w1_compiled_baseline import run_baseline
        COMPILES.disarm()       # the baseline's own compiles are expected, not a stall of ours
        base = run_baseline(a.model)
        write_result("W1", a.model, base, "compiled")
        table.append({"workload": "W1", "variant": f"torch.compile {base['dtype']} (baseline)",
                      "output_tokens_per_s": None, "decode_tokens_per_s":
                      base["decode_tokens_per_s"], "ttft_ms": None, "mbu": base["mbu"],
                      "step_ms": 1e3 / base["decode_tokens_per_s"]})
        print_table(table, f"W1 {a.model} and the compiled baseline "
                           f"(compile + warm-up {base['compile_and_warmup_s']:.0f} s)")


if __name__ == "__main__":
    main()
