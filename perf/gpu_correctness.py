"""GPU correctness: greedy output of small random-weight models of each architecture against
transformers on the same weights (a mixed batch of 8 prompts, 256 tokens each), and the same
prompts run alone (batch composition must not change outputs). --kv-cache-dtype fp8 reports
how far greedy output with an fp8 cache follows transformers (bf16/fp32 K/V there): agreement
is not expected to be exact, batch vs alone still is."""
from __future__ import annotations

import random
import tempfile

import torch

from common import print_table, write_result

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
             max_position_embeddings=1024)


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


# --quantization values that write a checkpoint (scripts/quantize.py, groups of 128) for the
# engine and give transformers the reference dequantization of its weights
GROUPED = {"awq": ["--method", "awq"], "gptq": ["--method", "gptq"],
           "gptq-act": ["--method", "gptq", "--desc-act", "--no-sym"]}


def quantized_checkpoint(hf, src: str, kind: str) -> str:
    import os
    import sys

    from safetensors.torch import load_file

    from pagedbackend.layers.quant_formats import dequantize_awq, dequantize_gptq
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "scripts"))
    import quantize
    out = tempfile.mkdtemp()
    quantize.main(GROUPED[kind] + ["--group-size", "128", src, out])
    t = load_file(os.path.join(out, "model.safetensors"))
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name in [n for n in t if n.endswith(".qweight")]:
            base = name[:-len(".qweight")]
            q, z, s = t[name], t[base + ".qzeros"], t[base + ".scales"]
            w = dequantize_awq(q, z, s, 128) if kind == "awq" \
                else dequantize_gptq(q, z, s, t[base + ".g_idx"], 4)
            params[base + ".weight"].copy_(w)
    return out


def check(arch: str, dtype: str, n: int = 256, kv_cache_dtype: str = "auto",
          quantization: str | None = None) -> dict:
    from pagedbackend import LLM, SamplingParams
    from pagedbackend.testing import make_hf_checkpoint
    d = tempfile.mkdtemp()
    extra = {"head_dim": 64} if arch == "qwen3" else {}
    hf = make_hf_checkpoint(arch, d, seed=1, std=0.05, **SHAPE, **extra)
    requested = quantization
    if quantization in GROUPED:     # an AWQ / GPTQ checkpoint; transformers gets its weights
        d, quantization = quantized_checkpoint(hf, d, quantization), None
    hf = hf.to("cuda", getattr(torch, dtype))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randrange(3, 300))] for _ in range(8)]
    # max_num_seqs=8: four decode graphs to capture per engine, not thirty
    llm = LLM(d, dtype=dtype, block_size=16, max_model_len=1024, max_num_seqs=8,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
             for p in prompts]
    ref = [hf_greedy(hf, p, n) for p in prompts]

    def agree(a, b):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        return same

    first_div = [agree(a, b) for a, b in zip(batch, ref)]
    res = {"arch": arch, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
           "quantization": requested,
           "first32_identical": all(x >= 32 for x in first_div),
           "min_agree_prefix": min(first_div), "mean_agree_prefix_of_256": sum(first_div) / 8,
           "batch_vs_alone_identical": batch == alone,
           "batch_vs_alone_min_prefix": min(agree(a, b) for a, b in zip(batch, alone))}
    del llm, hf
    torch.cuda.empty_cache()
    return res


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated; fp32 alone is where all 256 tokens must agree")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    ap.add_argument("--quantization", default=None,
                    help="fp8: our weights in e4m3 (transformers keeps the model's dtype); "
                         "awq, gptq, gptq-act: a 4-bit checkpoint written by "
                         "scripts/quantize.py (transformers runs its dequantized weights)")
    ap.add_argument("--w4-tuned-rows", type=int, default=None,
                    help="awq: time the 4-bit tiles only up to this many rows (the engine's "
                         "MAX_TUNED_ROWS otherwise); wider steps then run dequantize + cuBLAS. "
                         "In fp32 the tiny model's tiles at every rows bucket took the stage's "
                         "300 s before its first architecture finished (H100 call 89); 8 keeps "
                         "the decode steps' one-row tiles and their prologues in the check")
    a = ap.parse_args()
    if a.w4_tuned_rows is not None:
        from pagedbackend.kernels import gemv_w4_tuning
        gemv_w4_tuning.MAX_TUNED_ROWS = a.w4_tuned_rows
    dtypes = a.dtypes.split(",")
    rows = []
    for dtype in dtypes:
        for arch in ("llama", "qwen2", "qwen3", "mistral"):
            try:
                rows.append(check(arch, dtype, kv_cache_dtype=a.kv_cache_dtype,
                                  quantization=a.quantization))
            except Exception as e:  # report and go on: one broken arch must not hide the rest
                rows.append({"arch": arch, "dtype": dtype, "error": repr(e)[:200]})
            print("correctness row:", rows[-1], flush=True)   # kept if the stage is cut short
    suffix = "-".join(([] if len(dtypes) > 1 else dtypes)
                      + ([] if a.kv_cache_dtype == "auto" else [a.kv_cache_dtype + "kv"])
                      + ([a.quantization + "w"] if a.quantization else []))
    write_result("gpu-correctness", "tiny-random", {"rows": rows}, suffix)
    print_table(rows, "GPU correctness (greedy vs transformers)")


if __name__ == "__main__":
    main()
