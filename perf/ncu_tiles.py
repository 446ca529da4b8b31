"""The one-row matmul tiles under Nsight Compute: why the quantized ones read below the bandwidth.

    ncu --clock-control none --nvtx --nvtx-include "ncu/" --section ... \
        python3 perf/ncu_tiles.py [--kinds awq,int8,fp8,bf16] [--shapes gate_up,down]

For each weight kind and llama-3.1-8b shape, the engine's tuner picks its one-row tile (under
ncu its timings, and so its choices, can differ from serving's; --tile names tiles instead);
each then runs once inside the NVTX range "ncu", which is all that ncu profiles (stall
reasons, issue rate, bytes in flight). It prints each tile and its time first, in the order
of the report's kernels.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.kernels_bench import DEVICE, DT, LLAMA_MATMULS, random_packed_weight  # noqa: E402


def operands(kind: str, n: int, k: int):
    """(x, weight, scale): one random bf16 row (fp16 for awq16) and kind's random weights
    [n, k]: a 4-bit PackedWeight (awq, awq16; scale None), bf16 (scale None), or e4m3 / int8
    with per-row scales."""
    from pagedbackend.layers.quantization import quantize_weight_fp8, quantize_weight_int8
    x = torch.randn(1, k, device=DEVICE, dtype=torch.float16 if kind == "awq16" else DT)
    if kind.startswith("awq"):
        return x, random_packed_weight(n, k), None
    w = torch.randn(n, k, device=DEVICE) / k ** 0.5
    if kind == "bf16":
        return x, w.to(DT), None
    return x, *(quantize_weight_fp8 if kind == "fp8" else quantize_weight_int8)(w)


def chosen(kind: str, n: int, k: int):
    """(label, a closure running the tuned one-row matmul) for kind's weights [n, k]."""
    from pagedbackend.kernels import gemv_tuning, gemv_w4_tuning
    x, w, sc = operands(kind, n, k)
    if kind == "awq":
        gemv_w4_tuning.packed_linear(x, w, None)
        cfg = gemv_w4_tuning._CHOICE[gemv_w4_tuning._key(x, w, 0)]
        return f"{cfg}", lambda: gemv_w4_tuning.packed_linear(x, w, None)
    out = gemv_tuning.maybe_skinny_linear(x, w, None, sc)
    cfg = gemv_tuning._choice(x, w, None, 0, sc)
    if out is None:
        return "cuBLAS", None
    return f"{cfg}", lambda: gemv_tuning.maybe_skinny_linear(x, w, None, sc)


def given(kind: str, n: int, k: int, cfg: tuple):
    """(label, a closure running tile cfg) for kind's weights [n, k], no tuner."""
    from pagedbackend.kernels import gemv, gemv_w4
    x, w, sc = operands(kind, n, k)
    if kind.startswith("awq"):
        return f"{cfg}", lambda: gemv_w4.packed_gemv(x, w, None, cfg)
    return f"{cfg}", lambda: gemv.skinny_linear(x, w, None, cfg, weight_scale=sc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="awq,int8,fp8,bf16")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--tile", action="append", default=[],
                    help="kind:shape:tile (a python tuple), run instead of the tuner's choices; "
                         "repeat for several")
    args = ap.parse_args()
    from pagedbackend.kernels.gemv_tuning import _time_us
    shapes = {name: (n, k) for name, n, k in LLAMA_MATMULS}
    runs = []
    for spec in args.tile:
        kind, name, cfg = spec.split(":", 2)
        n, k = shapes[name]
        label, fn = given(kind, n, k, ast.literal_eval(cfg))
        print(f"{kind} {name} N={n} K={k}: {label} {_time_us(fn):.1f} us", flush=True)
        runs.append(fn)
    for kind in args.kinds.split(",") if not args.tile else ():
        for name in args.shapes.split(","):
            n, k = shapes[name]
            label, fn = chosen(kind, n, k)
            us = _time_us(fn) if fn else float("nan")
            print(f"{kind} {name} N={n} K={k}: {label} {us:.1f} us", flush=True)
            if fn:
                runs.append(fn)
    torch.cuda.synchronize()
    for fn in runs:         # in the order printed above
        torch.cuda.nvtx.range_push("ncu")
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
