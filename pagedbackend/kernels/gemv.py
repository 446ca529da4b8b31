"""Skinny matmul y = x @ W.T (+ b) for decode batches of 1-4 rows, where a step only streams
weights: every program owns BLOCK_N output columns over the whole K (no split-K, so no second
reduction kernel), keeping BLOCK_M x BLOCK_N x BLOCK_K fp32 partial products in registers and
reducing them once at the end.

cuBLAS is already at the memory roofline for some shapes and not for others (llama-3.1-8b at one
row: gate_up at ~99% of HBM bandwidth, qkv and o_proj at 72-77% plus a split-K reduction), so
the choice is measured, per (rows bucket, N, K, dtype) on the device, the first time a shape is
seen outside CUDA-graph capture: cuBLAS and each candidate tile are timed with the L2 flushed,
and the kernel replaces cuBLAS only when it is faster by a margin.

Because no program splits K, each one sees whole input rows, so the op before the matmul can
run inside it: the RMSNorm (+ residual add) before q|k|v and gate|up, and SiLU(gate) * up before
down_proj. At one row each of those was a separate ~2 us kernel (a third of a layer's kernels).
The first weight tile is loaded before waiting on the previous kernel (programmatic dependent
launch, kernels/common.py), so a matmul's start overlaps the end of what came before.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedbackend.kernels.common import pdl_enter, pdl_launch

logger = logging.getLogger("pagedbackend")

MAX_ROWS = 4
# (BLOCK_N, BLOCK_K at one row, num_warps, num_stages); BLOCK_K shrinks as rows grow so the
# partial products stay at <= 64 fp32 registers per thread.
CANDIDATES = ((8, 1024, 4, 3), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4),
              (32, 512, 8, 3), (64, 128, 4, 5), (4, 1024, 2, 4))
MARGIN = 0.97      # the kernel must take < 97% of cuBLAS's time to replace it
ENABLED = os.environ.get("PAGEDBACKEND_SKINNY_GEMM", "1") != "0"


# What the kernel does to its input on the way in (PROLOGUE): nothing; RMSNorm; residual add +
# RMSNorm (program 0 also writes the sum, the next residual); SiLU(gate) * up over gate|up.
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3


@triton.jit
def _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, rstd, store_ok, m_ok, K,
                EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] fp32 input tile at columns k, rounded exactly as the separate
    norm / activation kernels round their outputs (so fusing changes no result)."""
    if EVEN_K:
        ok = m_ok
    else:
        ok = m_ok & (k < K)[None, :]
    x = tl.load(x_rows + k[None, :], mask=ok, other=0.0)
    dt = x.dtype
    if PROLOGUE == 3:
        up = tl.load(x_rows + K + k[None, :], mask=ok, other=0.0)
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
    elif PROLOGUE != 0:
        if PROLOGUE == 2:
            r = tl.load(r_rows + k[None, :], mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
            tl.store(r_out_rows + k[None, :], x, mask=ok & store_ok)
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * g[None, :]).to(dt)
    return x.to(tl.float32)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, r_out_ptr, g_ptr, eps, M, N, K,
                   stride_xm, stride_wn, stride_ym, stride_rm, stride_rom,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
    r_rows = r_ptr + m.to(tl.int64)[:, None] * stride_rm
    r_out_rows = r_out_ptr + m.to(tl.int64)[:, None] * stride_rom
    m_ok = (m < M)[:, None]
    n_ok = (n < N)[:, None]
    # program 0 alone writes the residual sum (rows M for it, none for the others)
    store_ok = (m < M - M * tl.minimum(pid, 1))[:, None]
    # The first weight tile is requested before waiting for the previous kernel: weights are
    # never written, and with programmatic dependent launch this overlaps its tail.
    if EVEN_K:
        if EVEN_N:
            w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok, other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_rows + kk[None, :], mask=n_ok & (kk < K)[None, :], other=0.0,
                    eviction_policy="evict_first")
    pdl_enter(USE_PDL)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        # RMSNorm needs the row's mean square before any normalized value: every program
        # reads the (L2-resident) input rows once more.
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            ok = m_ok & (k < K)[None, :]
            h = tl.load(x_rows + k[None, :], mask=ok, other=0.0)
            if PROLOGUE == 2:
                r = tl.load(r_rows + k[None, :], mask=ok, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            hf = h.to(tl.float32)
            ss += tl.sum(hf * hf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    x = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, kk, rstd, store_ok, m_ok, K, EVEN_K,
                    PROLOGUE)
    if BLOCK_M == 1:     # one row: a plain 2-D tile, the layout triton handles best
        acc1 = tl.sum(x, axis=0)[None, :] * w.to(tl.float32)
    else:
        acc = x[:, None, :] * w.to(tl.float32)[None, :, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + kk
        x = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, rstd, store_ok, m_ok, K, EVEN_K,
                        PROLOGUE)
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok, other=0.0,
                            eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok & (k < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        if BLOCK_M == 1:
            acc1 += tl.sum(x, axis=0)[None, :] * w.to(tl.float32)
        else:
            acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
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
                  config: tuple[int, int, int, int], prologue: int = PLAIN,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= MAX_ROWS, rows contiguous), weight [N, K] contiguous, bias [N] or None ->
    [M, N] in x's dtype, with one of CANDIDATES as the tile.

    prologue NORM: y = rms_norm(x, norm_weight, eps) @ W.T; ADD_NORM: the same over x + residual,
    returning (y, x + residual); SILU_MUL: x is [M, 2K] holding gate | up and
    y = (silu(gate) * up) @ W.T."""
    m = x.shape[0]
    n, k = weight.shape
    assert 1 <= m <= MAX_ROWS and x.stride(1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
    block_n, block_k1, warps, stages = config
    block_m = rows_bucket(m)
    block_k = min(max(block_k1 // block_m, 16), triton.next_power_of_2(k))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r = r_out = x
    if prologue in (NORM, ADD_NORM):
        assert norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if prologue == ADD_NORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        r, r_out = residual, torch.empty_like(x)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, r, r_out,
        norm_weight if norm_weight is not None else weight, eps, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), r.stride(0), r_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0, PROLOGUE=prologue,
        num_warps=warps, num_stages=stages, **pdl_launch(x))
    return (y, r_out) if prologue == ADD_NORM else y


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


def _choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            k_in: int) -> tuple[int, int, int, int] | None:
    """The tile measured faster than cuBLAS for this (rows, weight) shape, or None for cuBLAS.
    k_in is the input width the shape needs (K, or 2K for gate|up)."""
    if not ENABLED or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(1) != 1 \
            or not weight.is_contiguous() or x.shape[1] != k_in:
        return None
    key = (x.device.index, rows_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return None
        probe = x if k_in == weight.shape[1] else x[:, :weight.shape[1]]
        _CHOICE[key] = _tune(probe, weight, bias)
    return _CHOICE[key]


def maybe_skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """The skinny kernel's result where it was measured faster than cuBLAS for this shape, else
    None (the caller runs F.linear). An unseen shape is tuned here unless a CUDA graph is being
    captured (then cuBLAS, until an eager step of that shape has run)."""
    cfg = _choice(x, weight, bias, weight.shape[1])
    return None if cfg is None else skinny_linear(x, weight, bias, cfg)


def maybe_skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                             norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                             bias: torch.Tensor | None):
    """(rms_norm(x [+ residual]) @ W.T + b, the new residual) in one kernel where the skinny
    kernel was chosen for W's shape, else None. Without residual the new residual is x."""
    cfg = _choice(x, weight, bias, weight.shape[1])
    if cfg is None or norm_weight.dtype != x.dtype or (
            residual is not None and (residual.dtype != x.dtype or residual.stride(1) != 1)):
        return None
    if residual is None:
        return skinny_linear(x, weight, bias, cfg, NORM, None, norm_weight, eps), x
    return skinny_linear(x, weight, bias, cfg, ADD_NORM, residual, norm_weight, eps)


def maybe_skinny_silu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """(silu(gate) * up) @ W.T over x = gate | up in one kernel where the skinny kernel was
    chosen for W's shape, else None."""
    cfg = _choice(x, weight, None, 2 * weight.shape[1])
    return None if cfg is None else skinny_linear(x, weight, None, cfg, SILU_MUL)
