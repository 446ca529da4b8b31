"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed on static buffers.

A decode step (every row has one new token) is padded up to the next bucket. Padded rows write
nowhere (slot -1) and attend over one token of block 0; their logits are ignored. The graphs
share one memory pool and are captured largest first, after an eager warm-up.

Steps that prefill one sequence of 2-512 tokens alone (a request arriving while nothing else
runs) replay a graph per token-count bucket too (PrefillGraphs): run eagerly, such a step is
hundreds of kernel launches from Python, several times its GPU time, and all of it is the
request's time to first token. PAGEDBACKEND_PREFILL_GRAPHS=0 runs them eagerly (A/B).
With speculative decoding the same graphs verify drafts: they then return the logits of up to
1 + k rows a sequence (its last known token and each draft), a bucket of 8 tokens is added
for 1 + k <= 8, and there are graphs for verification steps of 2-64 sequences (eagerly, a
batch-1 verification of 1 + 5 tokens took ~24 ms on the H200 against a 4.2 ms decode step in
its graph, call 50).
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
VERIFY_BUCKET = 8       # added when the graphs return several rows (speculative decoding)
VERIFY_SEQS = (2, 4, 8, 16, 32, 64)     # sequence buckets of verification steps


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
    in static device buffers: the prefill attention kernel finds its sequences' rows from
    query_start_loc on the device, padding tokens write nowhere (slot -1), and their attention
    rows are zeroed (meta.padded). Only the logits rows' hidden states reach the LM head:
    `rows` of them per sequence (1, or 1 + k to verify k drafts); a step wanting fewer pads
    the index with row 0 and gets its own rows back.

    With rows > 1 (speculative decoding) there are also graphs for verification steps of
    2..max_seqs sequences: b sequences (a bucket of VERIFY_SEQS) and b * rows tokens, any split
    of them between the sequences (1 + its drafts each; rows without drafts have one token, and
    the prefill kernel takes those too, since which rows are single is known only on the
    device). Bucket sequences past the step's have no tokens (their query_start_loc entries
    repeat the total)."""

    def __init__(self, model: Any, kv_caches: list, device: torch.device, max_tokens: int,
                 max_model_len: int, block_size: int, pool: Any = None, rows: int = 1,
                 max_seqs: int = 1):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.rows = rows
        extra = (VERIFY_BUCKET,) if 1 < rows <= VERIFY_BUCKET else ()
        self.buckets = [t for t in extra + PREFILL_BUCKETS if t <= max_tokens]
        self.seq_buckets = [b for b in VERIFY_SEQS if b <= max_seqs and b * rows <= max_tokens] \
            if rows > 1 else []
        self.max_model_len = max_model_len
        b_max = max(self.seq_buckets, default=1)
        t_max = max(self.buckets[-1] if self.buckets else 0, b_max * rows)
        max_blocks = -(-max_model_len // block_size)
        z = lambda *shape, dt: torch.zeros(shape, dtype=dt, device=device)
        self.input_ids = z(t_max, dt=torch.long)
        self.positions = z(t_max, dt=torch.long)
        self.slot_mapping = z(t_max, dt=torch.long)
        self.seq_lens = z(b_max, dt=torch.int32)
        self.query_start_loc = z(b_max + 1, dt=torch.int32)
        self.block_tables = z(b_max, max_blocks, dt=torch.int32)
        self.logits_index = z(b_max * rows, dt=torch.long)
        # (sequences, tokens) -> the graph and its logits
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = pool
        self.replays = 0

    def _meta(self, b: int, t: int) -> AttentionMetadata:
        # several sequences: rows tokens each as far as the host knows (none single, so the
        # prefill kernel runs every sequence, the one-token ones included)
        q_lens = [t] if b == 1 else [self.rows] * b
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            max_query_len=max(q_lens), max_seq_len=self.max_model_len, query_lens_cpu=q_lens,
            seq_lens_cpu=[self.max_model_len] * b, padded=True)

    def _forward(self, b: int, t: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._meta(b, t),
                            self.kv_caches)
        idx = self.logits_index[:b * self.rows]
        return self.model.compute_logits(hidden.index_select(0, idx))

    @torch.inference_mode()
    def capture(self) -> None:
        self.slot_mapping.fill_(-1)             # capture writes no K/V
        self.logits_index.zero_()               # any row in [0, t) does
        keys = [(1, t) for t in self.buckets] + [(b, b * self.rows) for b in self.seq_buckets]
        for b, t in sorted(keys, key=lambda key: -key[1]):
            per = t // b
            self.query_start_loc[:b + 1] = torch.arange(b + 1, device=self.device) * per
            self.seq_lens[:b].fill_(per)
            self.graphs[b, t], self.logits[b, t], self.pool = capture_graph(
                lambda b=b, t=t: self._forward(b, t), self.device, self.pool)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d prefill CUDA graphs (one sequence: token counts %s; "
                    "verifications of %s sequences; %d logits rows a sequence)",
                    len(self.graphs), self.buckets, self.seq_buckets, self.rows)

    def bucket(self, num_seqs: int, num_tokens: int, num_rows: int = 1
               ) -> tuple[int, int] | None:
        """The (sequences, tokens) graph for a step, or None."""
        if num_seqs == 1 and num_rows <= self.rows:
            return next(((1, t) for t in self.buckets if t >= num_tokens), None)
        need = max(num_tokens, num_rows)
        return next(((b, b * self.rows) for b in self.seq_buckets
                     if b >= num_seqs and b * self.rows >= need), None)

    def run(self, key: tuple[int, int], tokens: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, cu: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor,
            logits_index: torch.Tensor) -> torch.Tensor:
        """Replay graph `key` (bucket()'s answer for the step; inputs on the device: cu [n + 1]
        the sequences' token offsets, seq_lens [n], table [n, w], logits_index [r]: the rows
        whose logits are wanted); returns their logits [r, vocab], valid until the next replay
        of any graph."""
        t, n, r = tokens.shape[0], seq_lens.shape[0], logits_index.shape[0]
        pb, pt = key
        self.input_ids[:t].copy_(tokens, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.slot_mapping[:t].copy_(slots, non_blocking=True)
        if pt > t:
            self.slot_mapping[t:pt].fill_(-1)
        self.query_start_loc[:n + 1].copy_(cu, non_blocking=True)
        if pb > n:
            self.query_start_loc[n + 1:pb + 1].fill_(t)
            self.seq_lens[n:pb].fill_(0)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :table.shape[1]].copy_(table, non_blocking=True)
        self.logits_index[:r].copy_(logits_index, non_blocking=True)
        if r < pb * self.rows:
            self.logits_index[r:pb * self.rows].fill_(0)
        self.graphs[pb, pt].replay()
        self.replays += 1
        return self.logits[pb, pt][:r]
