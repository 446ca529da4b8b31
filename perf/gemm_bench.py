"""How fast cuBLAS runs llama-3.1-8b's projections at the row counts W2 steps have (one GPU, bf16).

    python perf/gemm_bench.py [--rows 256,512,...]

Each GEMM is timed inside a CUDA graph with the L2 cache flushed before it (the skinny tuner's
`_time_us`), so the figures are device time as a decode step replays it. Prints µs and TFLOP/s
per projection and row count, and for each row count the whole model's GEMM time per token:
the bound the GEMMs put on W2's throughput (a step of M rows needs at least this much).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedbackend.kernels.gemv import _time_us  # noqa: E402

LAYERS = 32
# (name, N, K, per model): llama-3.1-8b, hidden 4096, 32 q / 8 kv heads x 128, intermediate 14336
SHAPES = (("qkv", 6144, 4096, LAYERS), ("o_proj", 4096, 4096, LAYERS),
          ("gate_up", 28672, 4096, LAYERS), ("down", 4096, 14336, LAYERS),
          ("lm_head", 128256, 4096, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256,384,512,768,1024,2048,4096,8192")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for name, n, k, _ in SHAPES}
    table = []
    for m in rows:
        per_token_us, line = 0.0, [f"M={m:<5}"]
        for name, n, k, count in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = weights[name]
            us = _time_us(lambda: F.linear(x, w))
            tflops = 2 * m * n * k / (us * 1e-6) / 1e12
            line.append(f"{name} {us:8.1f} us {tflops:5.0f} TF/s")
            per_token_us += us * count / m
        # lm_head runs for every decode row; prefill rows only need it for their last token
        table.append((m, per_token_us))
        print("  ".join(line), flush=True)
    print("\nrows | GEMM us per token (all 32 layers + LM head) | tok/s bound from GEMMs alone")
    for m, us in table:
        print(f"{m:5d} | {us:8.2f} | {1e6 / us:9.0f}")


if __name__ == "__main__":
    main()
