"""The FP8 GEMM (quantization="fp8": e4m3 weights, per-channel scales; e4m3 inputs, per-row
scales) for steps of 1-64 rows on the tensor cores, where cuBLASLt's FP8 GEMM is built for
wide ones.

The one-row tiles of gemv.py multiply e4m3 weights by the 16-bit input (W8A16) and spend their
time widening e4m3, not waiting on memory: on the H200 they read a layer's weights at 2.5 TB/s
of 4.8 (call 72). Here nothing is widened: the input comes quantized per row (as the wide
steps' FP8 GEMMs take it: the RMSNorm / SiLU·mul kernels write it, layers/fp8_inputs.py) and
the weight tile goes from memory to the tensor cores untouched, as the first operand of a dot
with the input's rows padded to BLOCK_M = 16-64 (swap-AB: acc[BLOCK_N, BLOCK_M] = W x^T), the
per-channel and per-row scales applied to the fp32 sums. Hopper's fp8 MMA sums the exact
products at reduced precision (triton never promotes them on sm_90 by default): ~6e-4
relative at K 4,096, under a bf16 output's rounding. Split-K (KSPLIT programs over one
output tile's K, the last to finish adding the fp32 sums in split order through gemv_w4's
workspace) gives the N = 4096-6144 shapes enough programs.

This is W8A8, the arithmetic of the wide steps and of cuBLASLt's FP8 GEMM, not that of the
W8A16 tiles: a tile is timed against torch._scaled_mm on the same quantized input, must agree
with it, and replaces it only where faster (fp8_gemm), so it changes no step's arithmetic:
steps the W8A16 one-row tiles take (1-4 rows, gemv_tuning) keep them. On an H100 (call 74) the
tiles ran 1-16 rows in the same time, 1.2-1.6x torch._scaled_mm's, and 0.85-0.96x the W8A16
pair tiles at one row. PAGEDBACKEND_FP8_DECODE=w8a8 (W8A8_DECODE) also makes the skinny
matmul's tuner skip its W8A16 tiles for e4m3 weights (gemv_tuning._choice), so every decode
step runs the quantizing RMSNorm / SiLU·mul kernels and this GEMM (W1 on the H100: 281.7 tok/s
against 279.0); =cublas keeps torch._scaled_mm everywhere.
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from pagedbackend.kernels import tuning_cache
from pagedbackend.kernels.common import pdl_enter, pdl_launch
from pagedbackend.kernels.gemv_w4 import _split_k_buffers, split_k_sum

logger = logging.getLogger("pagedbackend")

_MODE = os.environ.get("PAGEDBACKEND_FP8_DECODE", "w8a16")
ENABLED = _MODE != "cublas"
W8A8_DECODE = _MODE == "w8a8"
MAX_MMA_ROWS = 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages, KSPLIT); BLOCK_N a multiple of 64 (a warpgroup's
# rows of the tensor-core instruction), KSPLIT whole BLOCK_K pieces per split
CANDIDATES = ((64, 256, 4, 4, 1), (64, 256, 4, 4, 2), (64, 256, 4, 4, 4), (64, 256, 4, 4, 8),
              (128, 256, 4, 4, 1), (128, 256, 4, 4, 2), (128, 256, 8, 4, 4),
              (64, 512, 4, 3, 2), (64, 512, 4, 3, 4), (128, 128, 4, 6, 2))


@triton.jit
def _fp8_mma_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K,
                    stride_xm, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, KSPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    ks = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    k_len = K // KSPLIT
    k_lo = tl.multiple_of(ks * k_len, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_len, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0,
                    eviction_policy="evict_first")
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    ok = n_ok[:, None] & m_ok[None, :]
    last = True
    if KSPLIT > 1:
        acc, last = split_k_sum(acc, ws_ptr, cnt_ptr, pid, ks, m[None, :] * N + n[:, None], ok,
                                M * N, KSPLIT)
    if last:        # y[m, n] = acc[n, m] * w_scale[n] * x_scale[m] (+ bias[n])
        sw = tl.load(sw_ptr + n, mask=n_ok, other=0.0)
        sx = tl.load(sx_ptr + m, mask=m_ok, other=0.0)
        y = acc * sw[:, None] * sx[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None],
                 y.to(y_ptr.dtype.element_ty), mask=ok)


def rows_tile(m: int) -> int:
    """BLOCK_M for m rows: the next power of two, 16 at least (the tensor-core instruction's
    narrowest side). Also the tuner's rows bucket: 1-16 rows run the same kernels."""
    return max(16, triton.next_power_of_2(m))


def fp8_mma_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, config: tuple) -> torch.Tensor:
    """(xq * sx) @ (wq * w_scale[:, None]).T (+ bias) -> [M, N] in dtype, xq [M <= 64, K]
    e4m3 (rows contiguous) with sx [M, 1] fp32, wq [N, K] e4m3 with w_scale [N] fp32, with a
    CANDIDATES tile (the rows padded to the next power of two, 16 at least)."""
    block_n, block_k, warps, stages, ksplit = config
    m, k = xq.shape
    n = wq.shape[0]
    assert 1 <= m <= MAX_MMA_ROWS and xq.stride(1) == 1 and wq.is_contiguous() \
        and wq.shape[1] == k and k % (block_k * ksplit) == 0, \
        f"FP8 tile {config} takes <= {MAX_MMA_ROWS} rows and K a multiple of " \
        f"{block_k * ksplit}, not {m} rows, K {k}"
    y = torch.empty((m, n), dtype=dtype, device=xq.device)
    tiles = triton.cdiv(n, block_n)
    block_m = rows_tile(m)
    ws, counts = _split_k_buffers(xq.device, ksplit * block_m * n, tiles) if ksplit > 1 \
        else (y, y)
    _fp8_mma_kernel[(tiles, ksplit)](
        xq, sx.reshape(-1), wq, w_scale.reshape(-1), bias if bias is not None else y, y, ws,
        counts, m, n, k, xq.stride(0), y.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_M=block_m, KSPLIT=ksplit, HAS_BIAS=bias is not None, num_warps=warps,
        num_stages=stages, **pdl_launch(xq))
    return y


# (device, BLOCK_M, N, K, out dtype) -> the tile, or None: torch._scaled_mm
_CHOICE: dict[tuple, tuple | None] = {}


def maybe_fp8_mma_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor,
                       w_scale: torch.Tensor, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> torch.Tensor | None:
    """The tile's result where one was timed faster than torch._scaled_mm for this shape's
    rows bucket (tuned at first sight outside CUDA-graph capture, checked against it), else
    None (the caller runs torch._scaled_mm)."""
    m = xq.shape[0]
    if not ENABLED or not xq.is_cuda or m > MAX_MMA_ROWS or xq.stride(1) != 1 \
            or not wq.is_contiguous():
        return None
    key = (xq.device.index, rows_tile(m), *wq.shape, dtype)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _CHOICE[key] = tuning_cache.remembered(
            "fp8mma", key, (CANDIDATES,), lambda: _tune(xq, sx, wq, w_scale, bias, dtype))
    cfg = _CHOICE[key]
    return None if cfg is None else fp8_mma_gemm(xq, sx, wq, w_scale, bias, dtype, cfg)


def _tune(xq, sx, wq, w_scale, bias, dtype) -> tuple | None:
    from pagedbackend.kernels.gemv_tuning import MARGIN, _pattern, _time_us, time_tiles
    from pagedbackend.kernels.quant import quantize_rows_fp8
    from pagedbackend.layers.quantization import fp8_gemm_cublas
    rows = rows_tile(xq.shape[0])
    n, k = wq.shape
    xs, ss = quantize_rows_fp8(_pattern(rows, k, 0.0, torch.bfloat16, xq.device))
    baseline = lambda: fp8_gemm_cublas(xs, ss, wq, w_scale, bias, dtype)     # noqa: E731
    tiles = [c for c in CANDIDATES if k % (c[1] * c[4]) == 0]
    base = _time_us(baseline)
    timed = time_tiles(tiles, lambda cfg: fp8_mma_gemm(xs, ss, wq, w_scale, bias, dtype, cfg),
                       baseline(), "FP8 MMA", f"{rows}x{n}x{k}")
    best = timed[0][1] if timed and timed[0][0] < MARGIN * base else None
    logger.info("FP8 GEMM rows<=%d N=%d K=%d: torch._scaled_mm %.1f us, %s", rows, n, k, base,
                f"triton {best} {timed[0][0]:.1f} us (chosen)" if best else
                f"kept (best triton {timed[0][0]:.1f} us)" if timed else "kept")
    return best
