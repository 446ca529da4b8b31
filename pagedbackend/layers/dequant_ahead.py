"""Dequantize ahead: AWQ / GPTQ weights on wide steps, the next layer's weight dequantized on a
second stream while this one's matmul runs.

At W2's 512-row decode steps an AWQ layer's matmul runs as dequantize + cuBLAS (the tuner's
choice: the triton W4A16 GEMMs reach half of cuBLAS's rate there), and the dequantization
alone is ~70% of the bf16 GEMM's time (H100 call 64): the whole of W2 AWQ's gap to bf16. Here
the step's matmuls run cuBLAS on a weight dequantized beforehand into one of DEPTH 16-bit
buffers, the dequantization of weight i + DEPTH - 1 queued on a side stream as soon as the
matmul that last read its buffer (i - 1) is done, so it runs beside matmuls i .. i + DEPTH - 2
and the attention, norms and activation between them. DEPTH 3: gate|up's dequantization (the
largest, ~120 us on an H100) then runs beside q|k|v, the attention and o_proj (~90 us), where
with two buffers it had only o_proj (~30 us) to hide behind.

- Only steps of at least MIN_ROWS rows (below that the W4A16 tiles, which read 0.5 bytes a
  weight, beat any 16-bit matmul) and only on even groups (act order's row-parallel shards
  keep the plain path).
- The order is the model's module order, which is the order a forward calls the layers; a call
  out of that order ends the look-ahead for the step (its matmul and the rest run the plain
  way), so an architecture that calls them otherwise loses the overlap, not correctness.
- Buffers: DEPTH of the largest layer's N x K in the activations' dtype (0.70 GB for
  llama-3.1-8b's gate|up in bf16), allocated with the model, before the KV cache is sized.
- Under CUDA-graph capture the side stream forks from the capture stream at the step's start
  and joins it at its end; every wait is on an event recorded in the same step.
- Off by default (PAGEDBACKEND_DEQUANT_AHEAD=1 turns it on) until W2 with it is measured
  against W2 without it in one process (perf/run_gpu.sh's w2awq stage).

On the CPU (tests) the dequantization runs inline: the same buffers and order, no overlap.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

ENABLED = os.environ.get("PAGEDBACKEND_DEQUANT_AHEAD", "0") == "1"
MIN_ROWS = 256
DEPTH = 3


class DequantAhead:
    """The look-ahead over one model's PackedWeights, in the order a forward calls them."""

    def __init__(self, weights: list, dtype: torch.dtype, device: torch.device):
        self.weights = weights
        self.index = {id(w): i for i, w in enumerate(weights)}
        size = max(w.shape[0] * w.shape[1] for w in weights)
        self.depth = max(2, min(DEPTH, len(weights)))
        self.buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(self.depth)]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.side = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(self.depth)]
            self.free = [torch.cuda.Event() for _ in range(self.depth)]
        self.next: int | None = None        # the weight expected next; None: not active
        self.freed = [False] * self.depth    # buffer b's matmul recorded free[b] this step
        self.served = 0                      # matmuls run on a buffer (tests, logs)

    def begin(self, rows: int) -> None:
        """A step of `rows` tokens starts: dequantize its first DEPTH - 1 weights (from here on
        the side stream is ordered after everything queued before the step)."""
        self.next = None
        if rows < MIN_ROWS:
            return
        self.next, self.freed = 0, [False] * self.depth
        if self.cuda:
            self.side.wait_stream(torch.cuda.current_stream())
        for i in range(self.depth - 1):
            self._launch(i)

    def linear(self, pw, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """x @ W.T (+ bias) on pw's dequantized weight when it is the one expected next (weight
        i + DEPTH - 1's dequantization queued behind it), else None (the look-ahead ends)."""
        i = self.index.get(id(pw))
        if self.next is None or i != self.next:
            self.end()
            return None
        b = i % self.depth
        main = torch.cuda.current_stream() if self.cuda else None
        if self.cuda:
            main.wait_event(self.ready[b])
        self.next = i + 1 if i + 1 < len(self.weights) else None
        if i + self.depth - 1 < len(self.weights):
            self._launch(i + self.depth - 1)
        y = F.linear(x, self._view(i), bias)
        if self.cuda:
            self.free[b].record(main)
            self.freed[b] = True
        self.served += 1
        if self.next is None and self.cuda:     # the last weight: the side stream is done
            main.wait_stream(self.side)
        return y

    def end(self) -> None:
        """The step ends (or leaves the expected order): join the side stream."""
        if self.next is not None and self.cuda:
            torch.cuda.current_stream().wait_stream(self.side)
        self.next = None

    def _view(self, i: int) -> torch.Tensor:
        n, k = self.weights[i].shape
        return self.buffers[i % self.depth][:n * k].view(n, k)

    def _launch(self, i: int) -> None:
        w, out, b = self.weights[i], self._view(i), i % self.depth
        if not self.cuda:
            out.copy_(w.dequantize(out.dtype))
            return
        from pagedbackend.kernels.gemv_w4 import dequantize_packed
        with torch.cuda.stream(self.side):
            if self.freed[b]:       # the matmul that read this buffer last
                self.side.wait_event(self.free[b])
            dequantize_packed(w, out.dtype, out)
            self.ready[b].record(self.side)


def attach(model: nn.Module, dtype: torch.dtype, force: bool = False) -> DequantAhead | None:
    """Give model's PackedWeights (in module order) one DequantAhead, kept as
    `model.dequant_ahead` and on each weight (`pw.ahead`), when ENABLED (or force) on CUDA
    (force: any device) and every layer has even groups; returns it or None."""
    weights = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    if not weights or not (ENABLED or force) or any(w.g_idx is not None for w in weights):
        return None
    device = weights[0].qweight.device
    if device.type != "cuda" and not force:
        return None
    ahead = DequantAhead(weights, dtype, device)
    for w in weights:
        w.ahead = ahead
    model.dequant_ahead = ahead
    return ahead
