"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed on static buffers.

A decode step (every row has one new token) is padded up to the next bucket. Padded rows write
nowhere (slot -1) and attend over one token of block 0; their logits are ignored. The graphs
share one memory pool and are captured largest first, after an eager warm-up.

Steps that prefill one sequence of 2-512 tokens alone (a request arriving while nothing else
runs) replay a graph per token-count bucket too (PrefillGraphs): run eagerly, such a step is
hundreds of kernel launches from Python, several times its GPU time, and all of it is the
request's time to first token. PAGEDBACKEND_PREFILL_GRAPHS=0 runs them eagerly (A/B).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Any, Callable, Iterator

import torch

from pagedbackend.layers.attention import AttentionMetadata

logger = logging.getLogger("pagedbackend")

PREFILL_GRAPHS = os.environ.get("PAGEDBACKEND_PREFILL_GRAPHS", "1") != "0"
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def capture_graph(forward: Callable[[], torch.Tensor], device: torch.device, pool: Any
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]:
    """forward() once eagerly (warm-up: tuning, compiles, scratch, allocations), then captured
    into a graph on `pool` (None: a new one); returns (graph, its output, the pool). The garbage
    collector is paused while capturing (gc_paused says why)."""
    forward()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(g, pool=pool):
        out = forward()
    return g, out, pool if pool is not None else g.pool()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: every CUDA graph capture runs in it.
    A collection that starts mid-capture may free a dead engine (cyclic garbage, e.g. kept by a
    traceback) whose CUDA graphs and pinned host tier are released with calls that are illegal
    while a stream captures (cudaGraphExecDestroy, cudaHostUnregister): the capture is then
    invalidated and fails (cudaErrorStreamCaptureInvalidated). torch.cuda.graph no longer runs
    gc.collect() before capturing by default."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    out = [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    return sorted(set(out))


class DecodeGraphs:
    def __init__(self, model: Any, kv_caches: list, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        z = lambda *shape, dt: torch.zeros(shape, dtype=dt, device=device)
        self.input_ids = z(self.max_bs, dt=torch.long)
        self.positions = z(self.max_bs, dt=torch.long)
        self.slot_mapping = z(self.max_bs, dt=torch.long)
        self.seq_lens = z(self.max_bs, dt=torch.int32)
        self.block_tables = z(self.max_bs, max_blocks, dt=torch.int32)
        self.query_start_loc = torch.arange(self.max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_model_len, query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs),
                            self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        for bs in reversed(self.buckets):
            self.graphs[bs], self.logits[bs], self.pool = capture_graph(
                lambda: self._forward(bs), self.device, self.pool)
        torch.cuda.synchronize(self.device)
        from pagedbackend.kernels.common import pdl_active
        logger.info("captured %d decode CUDA graphs (batch sizes %s; programmatic dependent "
                    "launch %s)", len(self.graphs), self.buckets,
                    "on" if pdl_active(torch.device(self.device)) else "off")

    def bucket(self, bs: int) -> int | None:
        for b in self.buckets:
            if b >= bs:
                return b
        return None

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_lens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Replay the graph for this batch (inputs already on the device; copied into the static
        buffers in stream order); returns logits [bs, vocab] (a view, valid until the next
        replay)."""
        bs = tokens.shape[0]
        pb = self.bucket(bs)
        self.input_ids[:bs].copy_(tokens, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[:bs].copy_(slots, non_blocking=True)
        self.seq_lens[:bs].copy_(seq_lens, non_blocking=True)
        self.block_tables[:bs, :table.shape[1]].copy_(table, non_blocking=True)
        if pb > bs:
            self.slot_mapping[bs:pb].fill_(-1)
            self.seq_lens[bs:pb].fill_(1)
        self.graphs[pb].replay()
        return self.logits[pb][:bs]


class PrefillGraphs:
    """Graphs for a step that is one sequence's prefill (or a prefill chunk) of 2..max_tokens
    tokens, padded up to a bucket of PREFILL_BUCKETS. Everything that varies (the real token
    count, the context length with any cached prefix, the block table, which row samples) is
    in static device buffers: the prefill attention kernel finds its sequence's rows from
    query_start_loc on the device, padding tokens write nowhere (slot -1), and their attention
    rows are zeroed (meta.padded). Only the sampling row's hidden state reaches the LM head."""

    def __init__(self, model: Any, kv_caches: list, device: torch.device, max_tokens: int,
                 max_model_len: int, block_size: int, pool: Any = None):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.buckets = [t for t in PREFILL_BUCKETS if t <= max_tokens]
        self.max_model_len = max_model_len
        t_max = self.buckets[-1] if self.buckets else 0
        max_blocks = -(-max_model_len // block_size)
        z = lambda *shape, dt: torch.zeros(shape, dtype=dt, device=device)
        self.input_ids = z(t_max, dt=torch.long)
        self.positions = z(t_max, dt=torch.long)
        self.slot_mapping = z(t_max, dt=torch.long)
        self.seq_lens = z(1, dt=torch.int32)
        self.query_start_loc = z(2, dt=torch.int32)
        self.block_tables = z(1, max_blocks, dt=torch.int32)
        self.logits_index = z(1, dt=torch.long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.replays = 0

    def _meta(self, t: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens, block_tables=self.block_tables, max_query_len=t,
            max_seq_len=self.max_model_len, query_lens_cpu=[t],
            seq_lens_cpu=[self.max_model_len], padded=True)

    def _forward(self, t: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._meta(t),
                            self.kv_caches)
        return self.model.compute_logits(hidden.index_select(0, self.logits_index))

    @torch.inference_mode()
    def capture(self) -> None:
        self.slot_mapping.fill_(-1)             # capture writes no K/V
        for t in reversed(self.buckets):
            self.query_start_loc[1] = t
            self.seq_lens.fill_(t)
            self.logits_index.fill_(t - 1)
            self.graphs[t], self.logits[t], self.pool = capture_graph(
                lambda: self._forward(t), self.device, self.pool)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d single-sequence prefill CUDA graphs (token counts %s)",
                    len(self.graphs), self.buckets)

    def bucket(self, num_tokens: int) -> int | None:
        return next((t for t in self.buckets if t >= num_tokens), None)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            seq_len: torch.Tensor, table: torch.Tensor, logits_index: torch.Tensor
            ) -> torch.Tensor:
        """Replay the graph for one sequence's tokens (inputs on the device; seq_len [1], table
        [1, n], logits_index [1]: the row that samples); returns its logits [1, vocab], valid
        until the next replay of any graph."""
        t = tokens.shape[0]
        pb = self.bucket(t)
        self.input_ids[:t].copy_(tokens, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(slots, non_blocking=True)
        if pb > t:
            self.slot_mapping[t:pb].fill_(-1)
        self.query_start_loc[1:].fill_(t)
        self.seq_lens.copy_(seq_len, non_blocking=True)
        self.block_tables[:, :table.shape[1]].copy_(table, non_blocking=True)
        self.logits_index.copy_(logits_index, non_blocking=True)
        self.graphs[pb].replay()
        self.replays += 1
        return self.logits[pb]
