"""Helpers for the model/loader tests: tiny random HF checkpoints of each supported architecture
and a small paged-KV driver that builds AttentionMetadata by hand."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pagedbackend.layers.attention import AttentionMetadata, TorchAttentionBackend
from pagedbackend.models import build_model, load_weights

from pagedbackend.testing import ARCHS, TINY_CONFIGS, make_hf_checkpoint  # noqa: F401


def load_ours(model_dir, load_format: str = "auto", dtype=torch.float32, **tp):
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    model = build_model(cfg, dtype, torch.device("cpu"), TorchAttentionBackend(), **tp)
    load_weights(model, str(model_dir), load_format)
    return model


def make_meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
              block_size: int) -> AttentionMetadata:
    """Metadata for one flattened step: request i appends query_lens[i] tokens, ending at
    position seq_lens[i] - 1 of its context."""
    slots = []
    for ql, sl, table in zip(query_lens, seq_lens, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(sl - ql, sl)]
    width = max(len(t) for t in tables)
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))


@dataclass
class Seq:
    tokens: list[int]                      # every token fed so far (prompt + generated)
    table: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)   # one row per fed token


class PagedDriver:
    """Runs a model over a shared paged KV pool whose blocks are handed out in shuffled order."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        self.model, self.block_size = model, block_size
        n_kv, d = model.num_kv_heads, model.head_dim
        dtype = next(model.parameters()).dtype
        self.caches = [(torch.full((num_blocks, block_size, n_kv, d), 1e4, dtype=dtype),
                        torch.full((num_blocks, block_size, n_kv, d), 1e4, dtype=dtype))
                       for _ in range(model.args.num_hidden_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = self.free.tolist()

    def new_seq(self, max_len: int) -> Seq:
        n = -(-max_len // self.block_size)
        table, self.free = self.free[:n], self.free[n:]
        return Seq([], table)

    @torch.no_grad()
    def step(self, work: list[tuple[Seq, list[int]]]) -> None:
        """Feed each (seq, new_tokens) in one flattened batch; logits land in seq.logits."""
        ids, pos = [], []
        for seq, new in work:
            pos += range(len(seq.tokens), len(seq.tokens) + len(new))
            seq.tokens += new
            ids += new
        qls = [len(new) for _, new in work]
        meta = make_meta(qls, [len(s.tokens) for s, _ in work], [s.table for s, _ in work],
                         self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.caches)
        logits = self.model.compute_logits(hidden)
        for (seq, _), rows in zip(work, logits.split(qls)):
            seq.logits += list(rows)


def run_paged(model, prompts: list[list[int]], decode_steps: int) -> list[Seq]:
    """Prefill all prompts in one batch (the last one split in two chunks, the second chunk
    batched with the others' first decode), then greedy-decode; returns the sequences."""
    driver = PagedDriver(model)
    seqs = [driver.new_seq(len(p) + decode_steps + 1) for p in prompts]
    last = prompts[-1]
    cut = len(last) // 2
    driver.step([(s, list(p)) for s, p in zip(seqs[:-1], prompts[:-1])] + [(seqs[-1], last[:cut])])
    greedy = lambda s: [int(s.logits[-1].argmax())]   # noqa: E731
    driver.step([(s, greedy(s)) for s in seqs[:-1]] + [(seqs[-1], last[cut:])])
    for _ in range(decode_steps):
        driver.step([(s, greedy(s)) for s in seqs])
    return seqs


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()


PROMPTS = [[3, 5, 7, 9, 11], list(range(20, 33)), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 40, 50, 60]]


def tp_worker(rank: int, world: int, model_dir: str, init_file: str, out_dir: str) -> None:
    """One tensor-parallel rank (gloo on CPU): load its shard, run PROMPTS, save its logits."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        model = load_ours(model_dir, tp_rank=rank, tp_size=world)
        seqs = run_paged(model, PROMPTS, decode_steps=2)
        torch.save([torch.stack(s.logits) for s in seqs], os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()
