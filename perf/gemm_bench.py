"""How fast cuBLAS runs llama-3.1-8b's projections at the row counts W2 steps have (one GPU, bf16).

    python perf/gemm_bench.py [--rows 256,512,...]

Each GEMM is timed inside a CUDA graph with the L2 cache flushed before it (the skinny tuner's
`_time_us`), so the figures are device time as a decode step replays it. Prints µs and TFLOP/s
per projection and row count, and for each row count the whole model's GEMM time per token:
the bound the GEMMs put on W2's throughput (a step of M rows needs at least this much).
With `--chunks 1024,2048` each row count above a chunk size is also timed as GEMMs of that
many rows one after the other into one output (what a prefill step of M rows could run), and
`--blas cublaslt` times everything through cuBLASLt instead of torch's default library.
At small row counts (`--rows 8,16,32,64`: W4's and W5's narrow steps) the weights' bytes set the
time, so each figure also has its TB/s (weights + input + output bytes) against HBM's 4.27.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedbackend.kernels import gemv  # noqa: E402
from pagedbackend.kernels.gemv_tuning import _time_us  # noqa: E402

LAYERS = 32
# (name, N, K, per model): llama-3.1-8b, hidden 4096, 32 q / 8 kv heads x 128, intermediate 14336
SHAPES = (("qkv", 6144, 4096, LAYERS), ("o_proj", 4096, 4096, LAYERS),
          ("gate_up", 28672, 4096, LAYERS), ("down", 4096, 14336, LAYERS),
          ("lm_head", 128256, 4096, 1))


# (BLOCK_N, BLOCK_K, warps, stages, dot): tensor-core tiles for the narrow steps (8-64 rows).
# A swapped-operand form (the weight tile as the dot's M side) was swept too in b31903a and
# was no faster (perf/RESULTS.md, call 31); it was removed.
SWEEP = tuple((*c, True) for c in (
    (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 6), (16, 128, 4, 8),
    (32, 512, 8, 3), (64, 128, 4, 4), (64, 256, 8, 3), (16, 256, 4, 6), (32, 64, 4, 8)))


def sweep(rows: list[int]) -> None:
    for m in rows:
        assert m <= gemv.MAX_DOT_ROWS, m
        for name, n, k, _ in SHAPES[:4]:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            base = _time_us(lambda: F.linear(x, w))
            times = []
            for cfg in SWEEP:
                try:
                    y = gemv.skinny_linear(x, w, None, cfg)
                    if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2):
                        print(f"  {name} M={m} {cfg}: disagrees with cuBLAS", flush=True)
                        continue
                    times.append((_time_us(lambda c=cfg: gemv.skinny_linear(x, w, None, c)), cfg))
                except Exception as e:      # noqa: BLE001  (e.g. out of shared memory)
                    print(f"  {name} M={m} {cfg}: {type(e).__name__}", flush=True)
            times.sort()
            gb = n * k * 2 / 1e3
            best = "  ".join(f"{us:.1f} us {us and gb / us / 1e3:.2f} TB/s {c[:4]}"
                             for us, c in times[:3])
            print(f"M={m:<3} {name:8} cuBLAS {base:6.1f} us {gb / base / 1e3:.2f} TB/s | "
                  f"{best}", flush=True)


def chunked(x: torch.Tensor, w: torch.Tensor, chunk: int, out: torch.Tensor) -> torch.Tensor:
    """x @ w.T as GEMMs of `chunk` rows, each into its slice of out."""
    for i in range(0, x.shape[0], chunk):
        torch.mm(x[i:i + chunk], w.t(), out=out[i:i + chunk])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256,384,512,768,1024,2048,4096,8192")
    ap.add_argument("--triton", action="store_true",
                    help="also time the skinny kernel's tensor-core tiles (rows <= "
                         f"{gemv.MAX_DOT_ROWS}, plain prologue) and print the best beside cuBLAS")
    ap.add_argument("--sweep", action="store_true",
                    help="time SWEEP's tensor-core tiles at --rows "
                         "(each <= MAX_DOT_ROWS) on the four layer projections: the best three "
                         "per shape beside cuBLAS")
    ap.add_argument("--chunks", default="",
                    help="comma-separated chunk sizes: also time each row count above one "
                         "as GEMMs of that many rows")
    ap.add_argument("--blas", default="", help="torch.backends.cuda.preferred_blas_library")
    a = ap.parse_args()
    if a.blas:
        torch.backends.cuda.preferred_blas_library(a.blas)
    print(f"BLAS library: {torch.backends.cuda.preferred_blas_library()}", flush=True)
    chunks = [int(c) for c in a.chunks.split(",") if c]
    if a.sweep:
        return sweep([int(r) for r in a.rows.split(",")])
    rows = [int(r) for r in a.rows.split(",")]
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for name, n, k, _ in SHAPES}
    table = []
    for m in rows:
        per_token_us, line = 0.0, [f"M={m:<5}"]
        chunk_us = {c: 0.0 for c in chunks if c < m}
        for name, n, k, count in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = weights[name]
            us = _time_us(lambda: F.linear(x, w))
            tflops = 2 * m * n * k / (us * 1e-6) / 1e12
            tbps = (n * k + m * (n + k)) * 2 / (us * 1e-6) / 1e12   # bytes moved at least
            line.append(f"{name} {us:8.1f} us {tflops:5.0f} TF/s {tbps:4.2f} TB/s")
            if a.triton and m <= gemv.MAX_DOT_ROWS:
                best = min((_time_us(lambda c=c: gemv.skinny_linear(x, w, None, c)), c)
                           for c in gemv.DOT_CANDIDATES)
                line.append(f"(triton {best[0]:.1f} {best[1][:4]})")
            per_token_us += us * count / m
            for c in chunk_us:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                cus = _time_us(lambda c=c, out=out: chunked(x, w, c, out))
                line.append(f"[{c}-row chunks {cus:8.1f} us "
                            f"{2 * m * n * k / (cus * 1e-6) / 1e12:5.0f} TF/s]")
                chunk_us[c] += cus * count / m
        # lm_head runs for every decode row; prefill rows only need it for their last token
        table.append((str(m), per_token_us))
        table.extend((f"{m} in {c}s", us) for c, us in chunk_us.items())
        print("  ".join(line), flush=True)
    print("\nrows | GEMM us per token (all 32 layers + LM head) | tok/s bound from GEMMs alone")
    for m, us in table:
        print(f"{m:>12} | {us:8.2f} | {1e6 / us:9.0f}")


if __name__ == "__main__":
    main()
