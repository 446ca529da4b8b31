"""Row-wise argmax over the vocabulary for greedy decoding. torch's reduction gives one row to
one block, so a batch-1 step spent ~28 us in it on 128k logits (the largest non-matmul kernel
of the step); here each row is cut into chunks that run in parallel, and a second (tiny) pass
picks the best chunk. Ties go to the lowest index, as torch.argmax."""
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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (any float dtype, last dim contiguous) -> [B] int64, torch.argmax(x, -1)."""
    b, v = x.shape
    assert x.stride(1) == 1
    chunks = triton.cdiv(v, CHUNK)
    vals = torch.empty((b, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((b, chunks), dtype=torch.int32, device=x.device)
    if b:
        _chunk_max_kernel[(b, chunks)](x, vals, idx, v, x.stride(0), chunks, CHUNK=CHUNK,
                                       num_warps=8, **pdl_launch(x))
    best = vals.argmax(dim=1, keepdim=True)
    return idx.gather(1, best).squeeze(1).long()
