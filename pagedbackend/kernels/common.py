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
    compile in the middle of serving stalls every running request for about a second."""

    def __init__(self) -> None:
        self.after_arm: list[str] = []
        self.armed = False

    def arm(self) -> None:
        knobs = getattr(triton, "knobs", None)
        if self.armed or knobs is None or INTERPRET:
            return
        prev = knobs.runtime.jit_cache_hook

        def hook(**kw):
            what = str(kw.get("repr", kw.get("fn", "?")))
            self.after_arm.append(what)
            logging.getLogger("pagedbackend").warning(
                "triton compiles a kernel variant after warm-up (serving stalls meanwhile): %s",
                what[:400])
            return prev(**kw) if prev is not None else None

        knobs.runtime.jit_cache_hook = hook
        self.armed = True


COMPILES = CompileWatch()
