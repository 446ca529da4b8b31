"""Helpers shared by the triton kernels: the interpreter switch and a matmul wrapper."""
from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

# Read once at import: triton itself decides interpret-vs-compile when the kernels are decorated.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def to_cache(x, cache_ptr):
    """x cast to the element type of cache_ptr (a KV cache). Into float8 e4m3 (the fp8 KV
    cache, scale 1) values saturate at +-448, its largest finite value, as vLLM's conversion
    does, instead of overflowing to NaN."""
    dt = cache_ptr.dtype.element_ty
    if dt.is_fp8():
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(dt)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr):
    """tl.dot(a, b) with an fp32 result. The CPU interpreter multiplies bf16 operands as their
    raw uint16 bits, so there (only) the operands are widened first; on the GPU bf16/fp16 feed
    the tensor cores directly."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently use tf32 on the GPU; the fp32 path is for tests, so keep it exact.
    return "ieee" if dtype == torch.float32 else "tf32"


# Programmatic dependent launch (Hopper+): a kernel launched with it may start while the one
# before it finishes; it must call pdl_enter before touching anything that kernel wrote.
# PAGEDBACKEND_PDL=0 launches every kernel the plain way (A/B).
PDL_ENABLED = os.environ.get("PAGEDBACKEND_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _pdl_device(device_index: int) -> bool:
    """Hopper or newer, and a triton that can launch with it (the launch_pdl option)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        supported = "launch_pdl" in CUDAOptions.__dataclass_fields__ \
            and hasattr(tl.extra.cuda, "gdc_wait")
    except (ImportError, AttributeError):
        supported = False
    return supported and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_active(device: torch.device) -> bool:
    return PDL_ENABLED and not INTERPRET and device.type == "cuda" \
        and _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that takes `USE_PDL: tl.constexpr` and calls pdl_enter:
    programmatic dependent launch on Hopper or newer, the plain launch elsewhere (and always in
    the CPU interpreter)."""
    on = pdl_active(t.device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Let the next kernel's programs take free SM slots now (they wait in their own pdl_enter),
    then wait until the previous kernel has finished and its writes are visible. Everything a
    program does before this must read only what no earlier kernel writes (e.g. weights)."""
    pdl_trigger(USE_PDL)
    pdl_wait(USE_PDL)


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """pdl_enter's first half: let the next kernel's programs take free SM slots now."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """pdl_enter's second half: wait for the previous kernel's writes."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


# Weight streaming while the previous kernel runs: with PDL a program starts before the kernel
# it depends on has finished, and may read what no kernel writes (weights) before pdl_wait.
# `l2_prefetch` asks the copy engine of the SM (Hopper's bulk-async unit) to bring those bytes
# into L2 without waiting for them, so HBM stays busy through the short latency-bound kernels
# (norm, rotary + KV write, attention, split merge) that sit between the big matmuls of a
# batch-1 step. Only the first programs of a kernel prefetch, PREFETCH_BYTES in all, so the
# prefetched lines are still in L2 (50 MB on the H100/H200) when their programs read them.
# PAGEDBACKEND_PREFETCH_MB=0 turns it off (A/B).
# PREFETCH_PLAIN_BYTES (None: the same) is the budget of the matmuls without a prologue: in a
# decoder layer that is o_proj, which follows the attention kernels, the longest stretch in
# which HBM would otherwise idle.
PREFETCH_BYTES = int(float(os.environ.get("PAGEDBACKEND_PREFETCH_MB", "8")) * (1 << 20))
_plain_mb = os.environ.get("PAGEDBACKEND_PREFETCH_PLAIN_MB", "")
PREFETCH_PLAIN_BYTES = int(float(_plain_mb) * (1 << 20)) if _plain_mb else None
PREFETCH_PIECES = tl.constexpr(256)      # bulk prefetches per program (1-2 per thread)


def prefetch_programs(t: torch.Tensor, program_bytes: int, plain: bool = False) -> int:
    """How many programs of a kernel launched with pdl_launch(t) prefetch their program_bytes
    of weights with l2_prefetch (0: none, then PREFETCH=False); plain: a matmul without a
    prologue (PREFETCH_PLAIN_BYTES)."""
    budget = PREFETCH_PLAIN_BYTES if plain and PREFETCH_PLAIN_BYTES is not None \
        else PREFETCH_BYTES
    if budget <= 0 or not pdl_active(t.device) or program_bytes <= 0 \
            or program_bytes % (16 * PREFETCH_PIECES.value) or t.data_ptr() % 16:
        return 0
    return budget // program_bytes


@triton.jit
def l2_prefetch(base, nbytes):
    """Prefetch [base, base + nbytes) (bytes, a multiple of 16 * PREFETCH_PIECES, 16-byte
    aligned) into L2 in PREFETCH_PIECES bulk requests; returns at once. sm_90+ only."""
    piece = nbytes // PREFETCH_PIECES
    offs = tl.arange(0, PREFETCH_PIECES).to(tl.int64) * piece
    addr = base.to(tl.pointer_type(tl.int8)) + offs
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [addr, piece + tl.zeros([PREFETCH_PIECES], dtype=tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1)


# The start of the fp16-pair blocks over eight code bytes of a row ($16, $17: two words):
# prmt spreads bytes 0,1 (2,3) of each word to bytes 0 and 2 of t0-t3, one pair a register.
SPREAD_BYTES_PTX = """prmt.b32 t0, $16, 0, 0x4140;
prmt.b32 t1, $16, 0, 0x4342;
prmt.b32 t2, $17, 0, 0x4140;
prmt.b32 t3, $17, 0, 0x4342;
"""


def pair_sum_into_first(pair: str, first: str) -> str:
    """The end of an eight-output inline-PTX block (pack=8: outputs $0-$7, the fp32
    accumulators $8-$15 among the inputs): the fp16 pair in register `pair` widened and its
    halves added in fp32 into f0, then `first` (an instruction writing $0 from f0 and $8) and
    $9-$15 passed through to $1-$7. The block declares .reg .b16 u0, u1 and .reg .f32 f0, f1;
    this closes its brace."""
    return (f"mov.b32 {{u0, u1}}, {pair};\ncvt.f32.f16 f0, u0;\ncvt.f32.f16 f1, u1;\n"
            f"add.rn.f32 f0, f0, f1;\n{first}\n"
            + "".join(f"mov.b32 ${i}, ${i + 8};\n" for i in range(1, 8)) + "}")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in on the CPU interpreter)."""
    if device_index is None or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int, floor: int = 1) -> int:
    return max(triton.next_power_of_2(n), floor)


class CompileWatch:
    """After `arm()` (the end of the engine's warm-up), every triton JIT specialization built in
    this process (an in-memory cache miss) is recorded and logged as a warning, because a
    compile in the middle of serving stalls every running request for about a second.
    `disarm()` covers another engine's start-up in the same process (its compiles are
    expected)."""

    def __init__(self) -> None:
        self.after_arm: list[str] = []
        self.armed = False
        self._installed = False

    def arm(self) -> None:
        knobs = getattr(triton, "knobs", None)
        if knobs is None or INTERPRET:
            return
        if not self._installed:
            prev = knobs.runtime.jit_cache_hook

            def hook(**kw):
                if self.armed:
                    what = str(kw.get("repr", kw.get("fn", "?")))
                    self.after_arm.append(what)
                    logging.getLogger("pagedbackend").warning(
                        "triton compiles a kernel variant after warm-up (serving stalls "
                        "meanwhile): %s", what[:400])
                return prev(**kw) if prev is not None else None

            knobs.runtime.jit_cache_hook = hook
            self._installed = True
        self.armed = True

    def disarm(self) -> None:
        self.armed = False


COMPILES = CompileWatch()
