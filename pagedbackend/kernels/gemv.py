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
The norm's 1/rms is a per-row scalar, so it multiplies the finished dot products: one pass over
the input, but the normalized activations are not rounded to bf16 on the way (the separate
kernel rounds them), so the fused result differs from norm-then-matmul by about one bf16
rounding (~1e-3 relative). A first version computed the mean square in a pass before the
matmul, rounding exactly as the separate kernel; that pass cost q|k|v ~3 us on the H200 and
gate|up more than the norm kernel it replaced.
Whether the kernel replaces cuBLAS is measured for the fused form: the fused kernel against the
separate norm / activation kernel plus cuBLAS.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedbackend.kernels.common import (dot_precision, l2_prefetch, mma, pdl_launch,
                                         pdl_trigger, pdl_wait, prefetch_programs)

logger = logging.getLogger("pagedbackend")

MAX_ROWS = 4
# (BLOCK_N, BLOCK_K at one row, num_warps, num_stages); BLOCK_K shrinks as rows grow so the
# partial products stay at <= 64 fp32 registers per thread.
CANDIDATES = ((8, 1024, 4, 3), (16, 512, 4, 3), (16, 512, 4, 4), (32, 256, 4, 4),
              (32, 512, 8, 3), (64, 128, 4, 5), (4, 1024, 2, 4))
# The same kernel with the products on the tensor cores (tl.dot of a 16-row input tile, rows
# past M masked to zero, against the weight tile), for 2-4 rows, where the fp32 broadcast
# products of a [rows, BLOCK_N, BLOCK_K] tile lost to cuBLAS on the H200 by 1.2-2x. The input
# tile is rounded to the weights' dtype on its way into the dot (after the norm's gain; 1/rms
# still scales the finished products). Marked by a fifth element.
DOT_CANDIDATES = ((16, 256, 4, 4, True), (32, 256, 4, 4, True), (64, 128, 4, 4, True),
                  (32, 128, 4, 6, True))
# The tensor-core tiles compute any row count up to this (BLOCK_M = rows rounded up to a power
# of two, at least 16); the engine hands the kernel at most MAX_ROWS. perf/gemm_bench.py
# --triton times them against cuBLAS at wider steps.
MAX_DOT_ROWS = 64
MARGIN = 0.97      # the kernel must take < 97% of cuBLAS's time to replace it
ENABLED = os.environ.get("PAGEDBACKEND_SKINNY_GEMM", "1") != "0"
# Narrow steps (MAX_ROWS < rows <= NARROW_ROWS; W4's ~30-40 rows, W5's tail): cuBLAS runs
# q|k|v, o_proj and down there at 2.2-3.0 TB/s, the same time from 1 to 128 rows (perf/RESULTS.md,
# calls 30 and 31). With NARROW_ROWS > MAX_ROWS a plain matmul of such a step takes the best
# tensor-core tile where it beats cuBLAS by MARGIN, as everywhere else: o_proj and the LM head
# on the H200. Taking tiles within 10% of cuBLAS, in the hope that PDL's overlap in the decode
# graphs would make up the difference, lost 0.9% on W5's requests (call 36). Off
# (NARROW_ROWS = MAX_ROWS) until measured in the engine; PAGEDBACKEND_NARROW_ROWS=64 (at most
# MAX_DOT_ROWS) turns it on.
NARROW_ROWS = min(int(os.environ.get("PAGEDBACKEND_NARROW_ROWS", str(MAX_ROWS))), MAX_DOT_ROWS)


# What the kernel does to its input on the way in (PROLOGUE): nothing; RMSNorm; residual add +
# RMSNorm (program 0 also writes the sum, the next residual); SiLU(gate) * up over gate|up.
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3


@triton.jit
def _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K,
                EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] fp32 input tile at columns k, and (for the norms) the rows' sums
    of squares over it. SiLU(gate) * up and the residual sum are rounded to the activation dtype
    exactly as the separate kernels round them; the RMSNorm's 1/rms is applied to the finished
    dot products instead (a scalar per row), so no pass over the row is needed first."""
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
    if PROLOGUE == 2:
        r = tl.load(r_rows + k[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(r_out_rows + k[None, :], x, mask=ok & store_ok)
    xf = x.to(tl.float32)
    sq = tl.sum(xf * xf, axis=1)
    if PROLOGUE == 1 or PROLOGUE == 2:
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        xf = xf * g[None, :]
    return xf, sq


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, r_out_ptr, g_ptr, eps, M, N, K,
                   stride_xm, stride_wn, stride_ym, stride_rm, stride_rom, prefetch_programs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                   PROLOGUE: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
                   USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
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
    pdl_trigger(USE_PDL)
    if PREFETCH:        # the first programs' weight rows (contiguous) start towards L2 now
        if pid < prefetch_programs:
            l2_prefetch(w_ptr + pid * BLOCK_N * stride_wn,
                        BLOCK_N * K * w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    pdl_wait(USE_PDL)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_DOT:          # BLOCK_M >= 16, rows past M zero
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif BLOCK_M == 1:   # one row: a plain 2-D tile, the layout triton handles best
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x, sq = _input_tile(x_rows, r_rows, r_out_rows, g_ptr, k, store_ok, m_ok, K, EVEN_K,
                            PROLOGUE)
        if PROLOGUE == 1 or PROLOGUE == 2:
            ss += sq
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_rows + k[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + k[None, :], mask=n_ok, other=0.0,
                            eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok & (k < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        if USE_DOT:
            acc2 += mma(x.to(w.dtype), tl.trans(w), PRECISION)
        elif BLOCK_M == 1:
            acc1 += tl.sum(x, axis=0)[None, :] * w.to(tl.float32)
        else:
            acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    if USE_DOT:
        y = acc2                                                        # [BLOCK_M, BLOCK_N]
    elif BLOCK_M == 1:
        y = tl.sum(acc1, axis=1)[None, :]                               # [1, BLOCK_N]
    else:
        y = tl.sum(acc, axis=2)                                         # [BLOCK_M, BLOCK_N]
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=m_ok & (n < N)[None, :])


def rows_bucket(m: int) -> int:
    return triton.next_power_of_2(m)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: tuple, prologue: int = PLAIN,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (M <= MAX_ROWS, or MAX_DOT_ROWS with a DOT_CANDIDATES tile; rows contiguous),
    weight [N, K] contiguous, bias [N] or None -> [M, N] in x's dtype, with one of CANDIDATES
    or DOT_CANDIDATES as the tile.

    prologue NORM: y = rms_norm(x, norm_weight, eps) @ W.T; ADD_NORM: the same over x + residual,
    returning (y, x + residual); SILU_MUL: x is [M, 2K] holding gate | up and
    y = (silu(gate) * up) @ W.T."""
    m = x.shape[0]
    n, k = weight.shape
    block_n, block_k1, warps, stages, *dot = config
    use_dot = bool(dot and dot[0])
    assert 1 <= m <= (MAX_DOT_ROWS if use_dot else MAX_ROWS) and x.stride(1) == 1
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k)
    assert weight.is_contiguous() and (bias is None or bias.is_contiguous())
    block_m = max(16, rows_bucket(m)) if use_dot else rows_bucket(m)
    block_k = min(block_k1 if use_dot else max(block_k1 // block_m, 16),
                  max(triton.next_power_of_2(k), 16))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    r = r_out = x
    if prologue in (NORM, ADD_NORM):
        assert norm_weight is not None and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    if prologue == ADD_NORM:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        r, r_out = residual, torch.empty_like(x)
    even_n = n % block_n == 0
    # a program's weight rows are contiguous: block_n * k elements (all in bounds if EVEN_N)
    pf = prefetch_programs(weight, block_n * k * weight.element_size(), prologue == PLAIN) \
        if even_n else 0
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, r, r_out,
        norm_weight if norm_weight is not None else weight, eps, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0), r.stride(0), r_out.stride(0), pf,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        EVEN_N=even_n, EVEN_K=k % block_k == 0, PROLOGUE=prologue, PREFETCH=pf > 0,
        USE_DOT=use_dot, PRECISION=dot_precision(weight.dtype), num_warps=warps,
        num_stages=stages, **pdl_launch(x))
    return (y, r_out) if prologue == ADD_NORM else y


# (device index, rows bucket, N, K, dtype, prologue) -> the chosen config, or None for cuBLAS.
# NORM (the first layer's, no residual) shares ADD_NORM's entry.
_CHOICE: dict[tuple, tuple | None] = {}


_FLUSH: dict[int, torch.Tensor] = {}     # per device: a buffer larger than the L2 cache
_REPS = 8


def _replay_us(graph: torch.cuda.CUDAGraph, times: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(times):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return sorted(samples)[len(samples) // 2]


def _time_us(fn) -> float:
    """Device time of fn as it runs inside a CUDA graph (the way decode steps run it), with the
    L2 cache flushed before each call: replays of [flush, fn] x _REPS minus replays of the
    flushes alone. Timing eager launches instead (triton.testing.do_bench) measures the host's
    launch overhead too, which for a 10-60 us kernel was most of the figure and made the
    choice noisy."""
    dev = torch.cuda.current_device()
    flush = _FLUSH.get(dev)
    if flush is None:
        flush = _FLUSH[dev] = torch.empty(128 << 20, dtype=torch.int8, device="cuda")
    fn()                                    # compiled and warm before capture
    torch.cuda.synchronize()
    try:
        both, alone = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(both):
            for _ in range(_REPS):
                flush.zero_()
                fn()
        with torch.cuda.graph(alone):
            for _ in range(_REPS):
                flush.zero_()
        return max(_replay_us(both) - _replay_us(alone), 0.0) / _REPS
    except RuntimeError as e:                 # not capturable here: time eager launches
        logger.warning("skinny GEMM tuning falls back to eager timing: %s", e)
        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def _pattern(rows: int, k: int, phase: float, dtype, device) -> torch.Tensor:
    # a fixed pattern, not torch.randn: tuning must not move the sampler's CUDA generator
    xs = torch.arange(rows * k, device=device, dtype=torch.float32).mul_(0.618).add_(phase).sin_()
    return xs.view(rows, k).to(dtype)


def _tune(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int):
    """The fastest tile for the kernel with this prologue, kept only if it beats what it
    replaces: cuBLAS, after the separate norm / activation kernel if any. Every tile is timed
    in its fused form (a tile's register and load pattern changes with the prologue: the
    fastest plain tile lost gate|up's fused form on the H200 where a wider one might not)."""
    from pagedbackend.layers.activation import silu_and_mul
    from pagedbackend.layers.norm import fused_add_rms_norm
    n, k = weight.shape
    rows = rows_bucket(x.shape[0])
    dt, dev = x.dtype, x.device
    xs = _pattern(rows, k, 0.0, dt, dev)
    if prologue == ADD_NORM:
        what = "rms_norm+"
        rs, g = _pattern(rows, k, 1.0, dt, dev), _pattern(1, k, 2.0, dt, dev).view(k).add_(1)

        def baseline():
            return F.linear(fused_add_rms_norm(xs, rs, g, 1e-6)[0], weight, bias)

        def kernel(cfg):
            return skinny_linear(xs, weight, bias, cfg, ADD_NORM, rs, g, 1e-6)[0]
    elif prologue == SILU_MUL:
        what = "silu_mul+"
        gu = _pattern(rows, 2 * k, 1.0, dt, dev)

        def baseline():
            return F.linear(silu_and_mul(gu), weight, bias)

        def kernel(cfg):
            return skinny_linear(gu, weight, bias, cfg, SILU_MUL)
    else:
        what = "plain"

        def baseline():
            return F.linear(xs, weight, bias)

        def kernel(cfg):
            return skinny_linear(xs, weight, bias, cfg)
    ref = baseline().float()
    base = _time_us(baseline)
    best, best_us = None, float("inf")
    narrow = rows > MAX_ROWS          # only the tensor-core tiles take more than MAX_ROWS
    for cfg in (() if narrow else CANDIDATES) + (DOT_CANDIDATES if rows > 1 else ()):
        try:
            # a tile that is wrong here (e.g. a miscompile) or fails is never chosen; the
            # fused norm skips one bf16 rounding, hence the tolerance
            agree = torch.allclose(kernel(cfg).float(), ref, rtol=2e-2, atol=2e-2)
            us = _time_us(lambda cfg=cfg: kernel(cfg)) if agree else float("inf")
        except Exception as e:      # noqa: BLE001
            logger.warning("skinny GEMM %s %s at %dx%dx%d failed: %s", what, cfg, rows, n, k, e)
            continue
        if not agree:
            logger.warning("skinny GEMM %s %s at %dx%dx%d disagrees with cuBLAS; skipped",
                           what, cfg, rows, n, k)
        elif us < best_us:
            best, best_us = cfg, us
    if best is not None and best_us >= base * MARGIN:
        best = None
    logger.info("skinny GEMM rows<=%d N=%d K=%d %s %s: cuBLAS %.1f us, %s", rows, n, k,
                str(dt).replace("torch.", ""), what, base,
                f"triton {best} {best_us:.1f} us (chosen)" if best
                else f"kept cuBLAS (best triton {best_us:.1f} us)")
    return best


def _choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            prologue: int = PLAIN) -> tuple | None:
    """The tile measured faster than cuBLAS for this (rows, weight, prologue), or None for
    cuBLAS."""
    k_in = 2 * weight.shape[1] if prologue == SILU_MUL else weight.shape[1]
    max_rows = max(MAX_ROWS, NARROW_ROWS) if prologue == PLAIN else MAX_ROWS
    if not ENABLED or x.dim() != 2 or x.shape[0] > max_rows or x.stride(1) != 1 \
            or not weight.is_contiguous() or x.shape[1] != k_in:
        return None
    kind = ADD_NORM if prologue == NORM else prologue
    key = (x.device.index, rows_bucket(x.shape[0]), *weight.shape, x.dtype, kind)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _CHOICE[key] = _tune(x, weight, bias, kind)
    return _CHOICE[key]


def maybe_skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor | None:
    """The skinny kernel's result where it was measured faster than cuBLAS for this shape, else
    None (the caller runs F.linear). An unseen shape is tuned here unless a CUDA graph is being
    captured (then cuBLAS, until an eager step of that shape has run)."""
    cfg = _choice(x, weight, bias)
    return None if cfg is None else skinny_linear(x, weight, bias, cfg)


def maybe_skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                             norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                             bias: torch.Tensor | None):
    """(rms_norm(x [+ residual]) @ W.T + b, the new residual) in one kernel where the skinny
    kernel was chosen for W's shape, else None. Without residual the new residual is x."""
    if norm_weight.dtype != x.dtype or (
            residual is not None and (residual.dtype != x.dtype or residual.stride(1) != 1)):
        return None
    cfg = _choice(x, weight, bias, ADD_NORM)
    if cfg is None:
        return None
    if residual is None:
        return skinny_linear(x, weight, bias, cfg, NORM, None, norm_weight, eps), x
    return skinny_linear(x, weight, bias, cfg, ADD_NORM, residual, norm_weight, eps)


def maybe_skinny_silu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """(silu(gate) * up) @ W.T over x = gate | up in one kernel where the skinny kernel was
    chosen for W's shape, else None."""
    cfg = _choice(x, weight, None, SILU_MUL)
    return None if cfg is None else skinny_linear(x, weight, None, cfg, SILU_MUL)
