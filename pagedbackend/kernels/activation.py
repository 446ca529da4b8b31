"""SiLU(gate) * up over the packed gate|up projection in one pass: the torch version runs two
elementwise kernels over strided halves (silu into a temporary, then the multiply), reading and
writing the [T, I] activations five times; this reads each half once and writes once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedbackend.kernels.common import pdl_enter, pdl_launch

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    # Round silu(gate) to the activation dtype before the multiply, as torch's two kernels do.
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] holding gate | up -> silu(gate) * up [..., I]."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0 and x.stride(-1) == 1
    n = two_i // 2
    x2 = x.reshape(-1, two_i)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    o2 = out.view(-1, n)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, BLOCK))](
            x2, o2, n, x2.stride(0), o2.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_launch(x2))
    return out
