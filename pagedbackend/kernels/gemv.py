"""Skinny matmul y = x @ W.T (+ b) for decode batches of 1-4 rows, where a step only streams
weights: every program owns BLOCK_N output columns over the whole K (no split-K, so no second
reduction kernel), keeping BLOCK_M x BLOCK_N x BLOCK_K fp32 partial products in registers and
reducing them once at the end.

cuBLAS is already at the memory roofline for some shapes and not for others (llama-3.1-8b at one
row: gate_up at ~99% of HBM bandwidth, qkv and o_proj at 72-77% plus a split-K reduction), so
the choice is measured, per (rows bucket, N, K, dtype) on the device, the first time a shape is
seen outside CUDA-graph capture: cuBLAS and each candidate tile are timed with the L2 flushed,
and the kernel replaces cuBLAS only when it is faster by a margin.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

logger = logging.getLogger("pagedbackend")

MAX_ROWS = 4
# (BLOCK_N, BLOCK_K at one row, num_warps, num_stages); BLOCK_K shrinks as rows grow so the
# partial products stay at <= 64 fp32 registers per thread.
CANDIDATES = ((8, 1024, 4, 3), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4),
              (32, 512, 8, 3), (64, 128, 4, 5), (4, 1024, 2, 4))
MARGIN = 0.97      # the kernel must take < 97% of cuBLAS's time to replace it
ENABLED = os.environ.get("PAGEDBACKEND_SKINNY_GEMM", "1") != "0"


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    m_ok = (m < M)[:, None]
    n_ok = (n < N)[:, None]
    if BLOCK_M == 1:     # one row: a plain 2-D tile, the layout triton handles best
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_ok, other=0.0)
            if EVEN_N:
                w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok, other=0.0,
                            eviction_policy="evict_first")
        else:
            k_ok = (k < K)[None, :]
            x = tl.load(x_rows + k[None, :], mask=m_ok & k_ok, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok & k_ok, other=0.0,
                        eviction_policy="evict_first")
        if BLOCK_M == 1:
            acc1 += tl.sum(x.to(tl.float32), axis=0)[None, :] * w.to(tl.float32)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if BLOCK_M == 1:
        y = tl.sum(acc1, axis=1)[None, :]                               # [1, BLOCK_N]
    else:
        y = tl.sum(acc, axis=2)                                         # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m_ok & (n < N)[None, :])


def rows_bucket(m: int) -> int:
    return triton.next_power_of_2(m)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows contiguous), weight [N, K] contiguous, bias [N] or None ->
    [M, N] in x's dtype, with one of CANDIDATES as the tile."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1
    assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
    block_n, block_k1, warps, stages = config
    block_m = rows_bucket(m)
    block_k = min(max(block_k1 // block_m, 16), triton.next_power_of_2(k))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, num_warps=warps, num_stages=stages)
    return y


# (device index, rows bucket, N, K, dtype) -> the chosen config, or None for cuBLAS
_CHOICE: dict[tuple, tuple[int, int, int, int] | None] = {}


def _time_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def _tune(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    m, k = x.shape
    n = weight.shape[0]
    # a fixed pattern, not torch.randn: tuning must not move the sampler's CUDA generator
    rows = rows_bucket(m)
    xs = torch.arange(rows * k, device=x.device, dtype=torch.float32).mul_(0.618).sin_()
    xs = xs.view(rows, k).to(x.dtype)
    ref = F.linear(xs, weight, bias)
    base = _time_us(lambda: F.linear(xs, weight, bias))
    best, best_us = None, base * MARGIN
    for cfg in CANDIDATES:
        out = skinny_linear(xs, weight, bias, cfg)
        # a tile that is wrong here (e.g. a miscompile) is never chosen
        if not torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
            logger.warning("skinny GEMM %s at %dx%dx%d disagrees with cuBLAS; skipped",
                           cfg, xs.shape[0], n, k)
            continue
        us = _time_us(lambda cfg=cfg: skinny_linear(xs, weight, bias, cfg))
        if us < best_us:
            best, best_us = cfg, us
    logger.info("skinny GEMM rows<=%d N=%d K=%d %s: cuBLAS %.1f us, %s", xs.shape[0], n, k,
                str(x.dtype).replace("torch.", ""), base,
                f"triton {best} {best_us:.1f} us (chosen)" if best else "kept cuBLAS")
    return best


def maybe_skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """The skinny kernel's result where it was measured faster than cuBLAS for this shape, else
    None (the caller runs F.linear). An unseen shape is tuned here unless a CUDA graph is being
    captured (then cuBLAS, until an eager step of that shape has run)."""
    if not ENABLED or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(1) != 1 \
            or not weight.is_contiguous():
        return None
    key = (x.device.index, rows_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _CHOICE[key] = _tune(x, weight, bias)
    cfg = _CHOICE[key]
    return None if cfg is None else skinny_linear(x, weight, bias, cfg)
