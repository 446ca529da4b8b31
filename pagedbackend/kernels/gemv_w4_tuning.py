"""Which kernel runs an AWQ / GPTQ layer's matmul on the GPU (gemv_w4.py's tiles, or dequantize
+ cuBLAS), per (rows bucket, N, K, dtype, bits, group, prologue), timed on the device the first
time a shape is seen outside CUDA-graph capture, with gemv_tuning's timer (inside a CUDA graph,
L2 flushed).

The plain matmul tries every tile against dequantize + cuBLAS. A prologue (RMSNorm, residual
add + RMSNorm, SiLU * up) then runs inside the kernel only where that was timed faster than the
separate norm / activation kernel followed by the plain choice: a tile over the whole K has
each program recompute the prologue over the whole input row, and at 4 bits a row's input is
four times the bytes of the weight codes it multiplies, so the fused form does not pay
everywhere it pays for 16-bit weights (a split-K tile's programs each do their own split's
columns only). Only the plain matmul's fastest tiles are tried in fused form (each prologue is a
separate compilation of every tile it tries).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton

from pagedbackend.kernels import tuning_cache
from pagedbackend.kernels.gemv import ADD_NORM, NORM, PLAIN, SILU_MUL
from pagedbackend.kernels.gemv_w4 import (CANDIDATES, DOT_CANDIDATES, HALF_CANDIDATES,
                                          KSPLIT_CANDIDATES, MAX_ROWS, SPLIT_CANDIDATES,
                                          SWAP_CANDIDATES, WORDS_CANDIDATES, _block_k,
                                          half_fits, packed_gemv, poison_prologue_scratch)

logger = logging.getLogger("pagedbackend")

FUSED_TRIES = 3     # the plain matmul's fastest tiles tried with a prologue inside
# Steps of more rows run dequantize + cuBLAS untimed. At 512 rows and more it won every
# llama-3.1-8b shape on the H100 and the H200 (calls 64, 70, 73: the tiles reach ~60% of
# cuBLAS's rate), and rows buckets above the decode graphs' (prefill chunks of 1-4k tokens) are
# first seen while serving: timing ~20 tiles then stalled those steps (W2 with AWQ, call 73:
# 17 steps at 526 ms against 166, a third of the run).
MAX_TUNED_ROWS = 512
# (device, rows bucket, N, K, dtype, bits, group, prologue) -> the tile, or None: dequantize +
# cuBLAS (PLAIN) / the separate prologue kernel, then the plain choice (the others)
_CHOICE: dict[tuple, tuple | None] = {}
_RANKED: dict[tuple, list[tuple]] = {}      # the plain key -> tiles, fastest first


def packed_linear(x: torch.Tensor, pw, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) on the GPU: the skinny kernel for 1-8 rows, the tiled GEMM or
    dequantize + cuBLAS above, whichever was timed faster for the rows bucket (dequantize +
    cuBLAS always for uneven groups, act order's row-parallel shards, and above
    MAX_TUNED_ROWS)."""
    if pw.g_idx is not None or x.shape[0] > MAX_TUNED_ROWS or x.shape[0] == 0:
        return F.linear(x, pw.dequantize(x.dtype), bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = _config(x, pw, bias, PLAIN)
    if cfg is None:
        return F.linear(x, pw.dequantize(x.dtype), bias)
    return packed_gemv(x, pw, bias, cfg)


def maybe_packed_norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                             norm_weight: torch.Tensor, eps: float, pw, bias):
    """(rms_norm(x [+ residual]) @ W.T + b, the new residual) in one kernel for a decode step
    of 1-8 rows on a PackedWeight without act order, where that was timed faster than the
    norm kernel and then the matmul; else None (the caller runs the norm, then the layer)."""
    if not _fusable(x, pw) or norm_weight.dtype != x.dtype or residual is not None and (
            residual.dtype != x.dtype or residual.stride(1) != 1):
        return None
    cfg = _config(x, pw, bias, NORM if residual is None else ADD_NORM)
    if cfg is None:
        return None
    if residual is None:
        return packed_gemv(x, pw, bias, cfg, NORM, None, norm_weight, eps), x
    return packed_gemv(x, pw, bias, cfg, ADD_NORM, residual, norm_weight, eps)


def maybe_packed_silu_linear(gate_up: torch.Tensor, pw) -> torch.Tensor | None:
    """(silu(gate) * up) @ W.T over gate_up = gate | up in one kernel (as above), else None."""
    if not _fusable(gate_up, pw) or gate_up.shape[1] != 2 * pw.shape[1]:
        return None
    cfg = _config(gate_up[:, :pw.shape[1]], pw, None, SILU_MUL)
    return None if cfg is None else packed_gemv(gate_up, pw, None, cfg, SILU_MUL)


def _fusable(x: torch.Tensor, pw) -> bool:
    return pw.g_idx is None and pw.perm is None and x.dim() == 2 \
        and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1


def _key(x: torch.Tensor, pw, prologue: int) -> tuple:
    return (x.device.index, triton.next_power_of_2(x.shape[0]), *pw.shape, x.dtype, pw.bits,
            pw.group_size, prologue)


def _config(x: torch.Tensor, pw, bias, prologue: int) -> tuple | None:
    """The tile chosen for x's rows bucket (tuned at first sight, outside CUDA-graph capture:
    the graphs' eager warm-up), or None (see _CHOICE)."""
    key = _key(x, pw, prologue)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            if prologue != PLAIN:
                return None
            return CANDIDATES[0] if x.shape[0] <= MAX_ROWS else None
        plain = _key(x, pw, PLAIN)
        sets = (CANDIDATES, DOT_CANDIDATES, SPLIT_CANDIDATES, HALF_CANDIDATES,
                WORDS_CANDIDATES, KSPLIT_CANDIDATES, SWAP_CANDIDATES,
                FUSED_TRIES)
        if plain not in _CHOICE:
            def tune_plain():
                return _tune(x, pw, bias, PLAIN), _RANKED.get(plain, [])
            _CHOICE[plain], _RANKED[plain] = tuning_cache.remembered("w4", plain, sets,
                                                                     tune_plain)
        if prologue != PLAIN:
            _CHOICE[key] = tuning_cache.remembered("w4", key, sets,
                                                   lambda: _tune(x, pw, bias, prologue))
    return _CHOICE[key]


def _tiles(rows: int, pw, dtype: torch.dtype = torch.bfloat16) -> tuple:
    # broadcast products of several rows hold rows x BLOCK_N x piece fp32 partial sums: only
    # tiles that keep them to <= 64 registers a thread (SPLIT tiles hold half as many: the
    # same bound, with room to spare); SPLIT tiles read 4-bit codes only, HALF tiles one row
    # of a 16-bit input (fp16 sums) with eight code bytes a thread
    if rows > MAX_ROWS:     # the swap-AB GEMM tiles; SPLIT ones read 4-bit codes, pair ones
        # (SPLIT 2) a 16-bit input
        return tuple(c for c in SWAP_CANDIDATES if not c[6] or pw.bits == 4
                     and (c[6] != 2 or dtype != torch.float32))
    fma = CANDIDATES + (SPLIT_CANDIDATES if pw.bits == 4 else ())
    if rows == 1:
        half_ok = pw.bits == 4 and dtype != torch.float32
        row = pw.qweight.stride(0)
        half = tuple(c for c in HALF_CANDIDATES + WORDS_CANDIDATES
                     if half_fits(c, pw.group_size, row)) if half_ok else ()
        # split-K: whole groups per split, SPLIT / HALF / WORDS tiles as above
        ksplit = tuple(c for c in KSPLIT_CANDIDATES
                       if pw.bits == 4 and pw.shape[1] % (c[6] * pw.group_size) == 0
                       and (c[5] is True or half_ok and half_fits(c, pw.group_size, row)))
        return fma + half + ksplit
    return tuple(c for c in fma
                 if rows * c[0] * _block_k(c[1], pw.group_size) <= 64 * 32 * c[2]) \
        + DOT_CANDIDATES


def _tune(x: torch.Tensor, pw, bias, prologue: int) -> tuple | None:
    """The fastest tile that agrees with what it replaces and beats it (dequantize + cuBLAS;
    with a prologue, the separate kernel and the plain choice), timed as gemv_tuning times."""
    from pagedbackend.kernels.gemv_tuning import _pattern, _time_us, time_tiles
    from pagedbackend.layers.activation import silu_and_mul
    from pagedbackend.layers.norm import fused_add_rms_norm, rms_norm
    rows = triton.next_power_of_2(x.shape[0])
    n, k = pw.shape
    dt, dev = x.dtype, x.device
    xs = _pattern(rows, k, 0.0, dt, dev)
    rs, g = _pattern(rows, k, 1.0, dt, dev), _pattern(1, k, 2.0, dt, dev).view(k).add_(1)
    gu = _pattern(rows, 2 * k, 1.0, dt, dev)
    plain = _CHOICE.get(_key(x, pw, PLAIN))

    def matmul(a):
        if plain is None:
            return F.linear(a, pw.dequantize(dt), bias)
        return packed_gemv(a, pw, bias, plain)

    if prologue == PLAIN:
        what, baseline = "plain", lambda: F.linear(xs, pw.dequantize(dt), bias)
        kernel = lambda cfg: packed_gemv(xs, pw, bias, cfg)        # noqa: E731
        tiles = _tiles(rows, pw, dt)
    else:       # HALF and WORDS tiles take a prologue only where they split K
        tiles = [c for c in _RANKED.get(_key(x, pw, PLAIN), [])
                 if len(c) != 6 or c[5] in (False, True)][:FUSED_TRIES]
        if prologue == SILU_MUL:
            what, baseline = "silu_mul+", lambda: matmul(silu_and_mul(gu))
            kernel = lambda cfg: packed_gemv(gu, pw, None, cfg, SILU_MUL)       # noqa: E731
        elif prologue == NORM:
            what, baseline = "rms_norm+", lambda: matmul(rms_norm(xs, g, 1e-6))
            kernel = lambda cfg: packed_gemv(xs, pw, bias, cfg, NORM, None, g, 1e-6)  # noqa
        else:
            what, baseline = "add_rms_norm+", lambda: matmul(fused_add_rms_norm(xs, rs, g,
                                                                                 1e-6)[0])
            kernel = lambda cfg: packed_gemv(xs, pw, bias, cfg, ADD_NORM, rs, g, 1e-6)[0]  # noqa
    # the tiles are checked against the exact product where there is no prologue: the
    # dequantized bf16 weight's rounding is the reference's, not the tiles' (fp32 weights)
    ref = F.linear(xs.float(), pw.dequantize(torch.float32),
                   None if bias is None else bias.float()) if prologue == PLAIN \
        else baseline().float()
    base = _time_us(baseline)
    # each checked launch finds the split-K prologue's scratch rows NaN, not the rows the tile
    # timed before it left there from the same input: a tile that read rows it had not
    # written agreed so and was chosen (H100 call 87, fixed in 324bf4e)
    timed = time_tiles(tiles, kernel, ref, f"W{pw.bits}A16 {what}", f"{rows}x{n}x{k}",
                       before_check=lambda: poison_prologue_scratch(dev))
    if prologue == PLAIN:
        _RANKED[_key(x, pw, PLAIN)] = [cfg for us, cfg in timed]
    best, best_us = None, base
    if timed and timed[0][0] < base:
        best_us, best = timed[0]
    logger.info("W%dA16 %s rows<=%d N=%d K=%d group %d: %s %.1f us, %s; fastest tiles: %s",
                pw.bits, what, rows, n, k, pw.group_size, "dequantize + cuBLAS"
                if prologue == PLAIN else "separate kernel + the plain choice", base,
                f"triton {best} {best_us:.1f} us (chosen)" if best else "kept",
                ", ".join(f"{cfg} {us:.1f}" for us, cfg in timed[:4]) or "none")
    return best
