"""Row-wise argmax over the vocabulary for greedy decoding. torch's reduction gives one row to
one block, so a batch-1 step spent ~28 us in it on 128k logits (the largest non-matmul kernel
of the step); here each row is cut into chunks that run in parallel, and a second (tiny) pass
picks the best chunk. Ties go to the lowest index, as torch.argmax. The second pass is one
kernel too: torch's argmax, gather and cast to int64 over the chunks' maxima were three
launches, ~10 us of a batch-1 step with the gaps between them (H100, call 88)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import pdl_enter, pdl_launch

CHUNK = 4096


@triton.jit
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, num_chunks,
                      CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf"))
    x = x.to(tl.float32)
    best = tl.max(x, 0)
    # first position holding the maximum (a -inf row keeps position 0 of its chunk)
    first = tl.min(tl.where(x == best, cols, c * CHUNK + CHUNK), 0)
    first = tl.minimum(first, V - 1)      # a NaN row still yields a valid token id
    out = row * num_chunks + c
    tl.store(val_ptr + out, best)
    tl.store(idx_ptr + out, first)


@triton.jit
def _best_chunk_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """A row's first chunk holding its maximum (chunks are in column order, so the first one
    also holds the lowest column), that chunk's index into out (int64)."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    best = tl.max(v, 0)
    # (a chunk of NaN only, whose maximum compares unequal to everything, falls back to the
    # last chunk: still a valid token id, as _chunk_max_kernel's NaN rows)
    first = tl.minimum(tl.min(tl.where(ok & (v == best), c, BLOCK_C), 0), num_chunks - 1)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + first).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (any float dtype, last dim contiguous) -> [B] int64, torch.argmax(x, -1)."""
    b, v = x.shape
    assert x.stride(1) == 1
    chunks = triton.cdiv(v, CHUNK)
    vals = torch.empty((b, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((b, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(b, dtype=torch.long, device=x.device)
    if b:
        _chunk_max_kernel[(b, chunks)](x, vals, idx, v, x.stride(0), chunks, CHUNK=CHUNK,
                                       num_warps=8, **pdl_launch(x))
        _best_chunk_kernel[(b,)](vals, idx, out, chunks,
                                 BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=1,
                                 **pdl_launch(x))
    return out
