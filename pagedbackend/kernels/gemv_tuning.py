"""Whether the skinny matmul (gemv.py) replaces cuBLAS, per (rows bucket, N, K, dtype, prologue).

cuBLAS is already at the memory roofline for some shapes and not for others (llama-3.1-8b at one
row: gate_up at ~99% of HBM bandwidth, qkv and o_proj at 72-77% plus a split-K reduction), so
the choice is measured, per (rows bucket, N, K, dtype) on the device, the first time a shape is
seen outside CUDA-graph capture: cuBLAS and each candidate tile are timed with the L2 flushed,
and the kernel replaces cuBLAS only when it is faster by a margin.

Every tile is timed in its fused form against what it replaces: the separate norm /
activation kernel plus cuBLAS.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
import triton

from pagedbackend.kernels import fp8_mma, tuning_cache
from pagedbackend.kernels.gemv import (ADD_NORM, CANDIDATES, DOT_CANDIDATES, FP8_CANDIDATES,
                                       FP8_HALF_CANDIDATES, FP8_WIDEN_CANDIDATES,
                                       INT8_HALF_CANDIDATES, MAX_ROWS, NORM, PLAIN, SILU_MUL,
                                       byte_half_fits, rows_bucket, skinny_linear, tile_block_k)
from pagedbackend.layers import fp8_inputs
from pagedbackend.layers.fp8_inputs import fp8_norm_linear, fp8_silu_linear, fused_quant_active
from pagedbackend.layers.quantization import dequantize, scaled_linear

logger = logging.getLogger("pagedbackend")

MARGIN = 0.97      # the kernel must take < 97% of cuBLAS's time to replace it
ENABLED = os.environ.get("PAGEDBACKEND_SKINNY_GEMM", "1") != "0"
# Steps of more than MAX_ROWS rows keep cuBLAS. At 5-64 rows (W4's ~30-40, W5's tail) it runs
# the smaller projections at 2.2-3.0 TB/s, but the tensor-core tiles do no better alone: at 32-64
# rows none beats it by MARGIN, and letting tiles up to 10% slower take those steps, for PDL's
# overlap in the decode graphs, lost 0.9% on W5's requests (H200, perf/RESULTS.md call 36).


# (device index, rows bucket, N, K, dtype, weight dtype, prologue) -> the chosen config, or None
# for cuBLAS.
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
    from pagedbackend.worker.cuda_graph import gc_paused
    fn()                                    # compiled and warm before capture
    torch.cuda.synchronize()
    try:
        both, alone = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(both):
            for _ in range(_REPS):
                flush.zero_()
                fn()
        with gc_paused(), torch.cuda.graph(alone):
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


def _tune(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
          scale: torch.Tensor | None = None):
    """The fastest tile for the kernel with this prologue, kept only if it beats what it
    replaces: cuBLAS, after the separate norm / activation kernel if any (with fp8 weights,
    `scale`: the input's quantization, by the norm / activation kernel where
    layers/fp8_inputs.py fuses it, and cuBLASLt's FP8 GEMM). Every tile is timed in its
    fused form (a tile's register and load pattern changes with the prologue: the fastest
    plain tile lost gate|up's fused form on the H200 where a wider one might not)."""
    from pagedbackend.layers.activation import silu_and_mul
    from pagedbackend.layers.norm import fused_add_rms_norm
    n, k = weight.shape
    rows = rows_bucket(x.shape[0])
    dt, dev = x.dtype, x.device
    xs = _pattern(rows, k, 0.0, dt, dev)

    # the reference a tile must agree with: the same matmul on the weight the layer stands for
    # (with fp8 weights, the dequantized weight: cuBLASLt's FP8 GEMM also quantizes the input)
    exact = weight if scale is None else dequantize(weight, scale, dt)

    def matmul(a, reference=False):
        if scale is None or reference:
            return F.linear(a, exact, bias)
        return scaled_linear(a, weight, scale, bias)

    if prologue == ADD_NORM:
        what = "rms_norm+"
        rs, g = _pattern(rows, k, 1.0, dt, dev), _pattern(1, k, 2.0, dt, dev).view(k).add_(1)

        def baseline(reference):
            if scale is not None and not reference and fused_quant_active(xs, weight, g):
                return fp8_norm_linear(xs, rs, g, 1e-6, weight, scale, bias)[0]
            return matmul(fused_add_rms_norm(xs, rs, g, 1e-6)[0], reference)

        def kernel(cfg):
            return skinny_linear(xs, weight, bias, cfg, ADD_NORM, rs, g, 1e-6, scale)[0]
    elif prologue == SILU_MUL:
        what = "silu_mul+"
        gu = _pattern(rows, 2 * k, 1.0, dt, dev)

        def baseline(reference):
            if scale is not None and not reference and fused_quant_active(gu, weight):
                return fp8_silu_linear(gu, weight, scale)
            return matmul(silu_and_mul(gu), reference)

        def kernel(cfg):
            return skinny_linear(gu, weight, bias, cfg, SILU_MUL, weight_scale=scale)
    else:
        what = "plain"

        def baseline(reference):
            return matmul(xs, reference)

        def kernel(cfg):
            return skinny_linear(xs, weight, bias, cfg, weight_scale=scale)
    ref = baseline(True).float()
    base = _time_us(lambda: baseline(False))
    # the tensor-core tiles from 2 rows (at one row none beat the broadcast products' tiles on
    # the H200, bf16 or fp8: perf/RESULTS.md calls 41-42); fp8's integer-widening tiles at one
    # row (where the FMA tiles run), for e4m3 weights only (int8 ones are not e4m3 bits: on
    # the H200 every such tile failed on int8 weights, call 51)
    widen = scale is not None and weight.dtype == torch.float8_e4m3fn and rows == 1
    tiles = CANDIDATES + (FP8_CANDIDATES if scale is not None else ()) + DOT_CANDIDATES \
        + (FP8_WIDEN_CANDIDATES if widen else ()) + byte_half_tiles(rows, weight, scale, dt)
    timed = time_tiles([c for c in tiles if rows > 1 or len(c) == 4 or not c[4]], kernel, ref,
                       f"skinny GEMM {what}", f"{rows}x{n}x{k}")
    best, best_us = None, float("inf")
    if timed:
        best_us, best = timed[0]
    if best is not None and best_us >= base * MARGIN:
        best = None
    logger.info("skinny GEMM rows<=%d N=%d K=%d %s %s: cuBLAS %.1f us, %s", rows, n, k,
                str(weight.dtype).replace("torch.", ""), what, base,
                f"triton {best} {best_us:.1f} us (chosen)" if best
                else f"kept cuBLAS (best triton {best_us:.1f} us)")
    return best


def byte_half_tiles(rows: int, weight: torch.Tensor, scale: torch.Tensor | None,
                    dtype: torch.dtype) -> tuple:
    """The fp16-pair tiles (gemv.FP8_HALF_CANDIDATES / INT8_HALF_CANDIDATES) a shape may try:
    one row of a 16-bit input (an fp32 model keeps its fp32 products), one-byte weights, eight
    bytes a thread and K a multiple of the tile's BLOCK_K."""
    if rows != 1 or scale is None or dtype == torch.float32:
        return ()
    cands = FP8_HALF_CANDIDATES if weight.dtype == torch.float8_e4m3fn \
        else INT8_HALF_CANDIDATES if weight.dtype == torch.int8 else ()
    k = weight.shape[1]
    return tuple(c for c in cands
                 if byte_half_fits((c[0], tile_block_k(c[1], 1, k), c[2]), k))


def agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a tile's output matches the reference within the tolerance of a fused norm (it
    skips one bf16 rounding): 2% of each value, plus 2% of the reference's RMS where that is
    over 1. An absolute floor of 2e-2 alone failed every tile of a 4-bit down_proj (K 14,336,
    outputs of RMS ~4.7): the bf16 reference's own rounding near zero was 0.05, so the tuner
    kept dequantize + cuBLAS at 5x the time (H100, call 64)."""
    scale = max(1.0, ref.float().pow(2).mean().sqrt().item())
    return torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale)


def time_tiles(tiles, kernel, ref: torch.Tensor, what: str, shape: str,
               before_check=None) -> list[tuple]:
    """[(us, tile)] of the tiles whose kernel(tile) agrees with ref, fastest first. A tile
    that is wrong here (e.g. a miscompile) or fails is never chosen (agrees). before_check(),
    where given, runs before each tile's checked launch (not before the timed ones)."""
    timed = []
    for cfg in tiles:
        try:
            if before_check is not None:
                before_check()
            agree = agrees(kernel(cfg), ref)
            if agree:
                timed.append((_time_us(lambda cfg=cfg: kernel(cfg)), cfg))
        except Exception as e:      # noqa: BLE001
            logger.warning("%s %s at %s failed: %s", what, cfg, shape, e)
            continue
        if not agree:
            logger.warning("%s %s at %s disagrees with the reference; skipped", what, cfg, shape)
    return sorted(timed, key=lambda t: t[0])


def _choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            prologue: int = PLAIN, scale: torch.Tensor | None = None) -> tuple | None:
    """The tile measured faster than cuBLAS for this (rows, weight, prologue), or None for
    cuBLAS."""
    if weight.dtype == torch.float8_e4m3fn and fp8_mma.W8A8_DECODE:     # no W8A16 tile
        return None
    k_in = 2 * weight.shape[1] if prologue == SILU_MUL else weight.shape[1]
    if not ENABLED or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.stride(1) != 1 \
            or not weight.is_contiguous() or x.shape[1] != k_in:
        return None
    kind = ADD_NORM if prologue == NORM else prologue
    key = (x.device.index, rows_bucket(x.shape[0]), *weight.shape, x.dtype, weight.dtype, kind)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _CHOICE[key] = tuning_cache.remembered(
            "skinny", key, _candidate_sets(), lambda: _tune(x, weight, bias, kind, scale))
    return _CHOICE[key]


def _candidate_sets() -> tuple:
    """What a choice was made among, as it is now (perf/common.py's A/B swaps some)."""
    return (CANDIDATES, FP8_CANDIDATES, DOT_CANDIDATES, FP8_WIDEN_CANDIDATES,
            FP8_HALF_CANDIDATES, INT8_HALF_CANDIDATES, MARGIN, fp8_inputs.FUSED_QUANT)


def maybe_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The skinny kernel's result where it was measured faster than cuBLAS for this shape, else
    None (the caller runs F.linear, or the FP8 GEMM with `scale`). An unseen shape is tuned
    here unless a CUDA graph is being captured (then cuBLAS, until an eager step of that shape
    has run)."""
    cfg = _choice(x, weight, bias, PLAIN, scale)
    return None if cfg is None else skinny_linear(x, weight, bias, cfg, weight_scale=scale)


def maybe_skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                             norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                             bias: torch.Tensor | None, scale: torch.Tensor | None = None):
    """(rms_norm(x [+ residual]) @ W.T + b, the new residual) in one kernel where the skinny
    kernel was chosen for W's shape, else None. Without residual the new residual is x."""
    if norm_weight.dtype != x.dtype or (
            residual is not None and (residual.dtype != x.dtype or residual.stride(1) != 1)):
        return None
    cfg = _choice(x, weight, bias, ADD_NORM, scale)
    if cfg is None:
        return None
    if residual is None:
        return skinny_linear(x, weight, bias, cfg, NORM, None, norm_weight, eps, scale), x
    return skinny_linear(x, weight, bias, cfg, ADD_NORM, residual, norm_weight, eps, scale)


def maybe_skinny_silu_linear(x: torch.Tensor, weight: torch.Tensor,
                             scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """(silu(gate) * up) @ W.T over x = gate | up in one kernel where the skinny kernel was
    chosen for W's shape, else None."""
    cfg = _choice(x, weight, None, SILU_MUL, scale)
    return None if cfg is None else skinny_linear(x, weight, None, cfg, SILU_MUL,
                                                  weight_scale=scale)
