"""Draft-model proposer: a smaller model of the same vocabulary proposes k tokens greedily.

It has its own KV cache with the target's block layout and shares the target's block ids: a
request's draft K/V for position p lives in the same (block, offset) as its target K/V, so the
scheduler's allocation (including the k slots it reserves for drafts) serves both and nothing
more is allocated or freed. The draft cache holds a request's positions [0, valid): it
catches up lazily (the whole prompt on the first proposal, recomputed after a preemption; it
never trusts blocks found in the prefix cache, whose draft K/V may never have been written),
then runs k - 1 one-token steps. Drafts a verification rejects leave valid at the last
accepted one."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedbackend.config import check
from pagedbackend.worker.step_inputs import HostInputs


class DraftRunner:
    def __init__(self, engine_config: Any, engine: Any):
        from pagedbackend.engine.model_files import load_model_files
        from pagedbackend.worker.model_runner import ModelRunner

        spec = engine_config.speculative_config
        cfg = engine_config.replace(model=spec.model, tokenizer=None, speculative_config=None,
                                    quantization=None)
        files = load_model_files(cfg)
        target = engine.runner
        check(files.info.vocab_size == engine.info.vocab_size,
              "speculative_config.model", spec.model,
              f"a model with the target's vocabulary (vocab_size {engine.info.vocab_size}, "
              f"the draft has {files.info.vocab_size})")
        if files.tokenizer is not None and engine.tokenizer is not None:
            check(files.tokenizer.get_vocab() == engine.tokenizer.get_vocab(),
                  "speculative_config.model", spec.model,
                  "a model with the target's tokenizer (their vocabularies differ)")
        limit = int(files.hf_config.get("max_position_embeddings", 2048))
        check(limit >= engine.info.max_model_len, "speculative_config.model", spec.model,
              f"a model with max_position_embeddings >= max_model_len "
              f"({engine.info.max_model_len}; the draft has {limit})")
        self.runner = ModelRunner(cfg, files.hf_config, str(target.device),
                                  files.info.dtype)
        self.runner.allocate_kv_cache(target.num_kv_blocks)
        self.block_size = engine_config.block_size
        if self.runner.device.type == "cuda":
            self._capture(engine_config, engine.info)
        self.scheduler = engine.scheduler
        # request id -> (valid, its num_preemptions then, the Request): ids can be reused
        self.valid: dict[str, tuple[int, int, Any]] = {}

    def _capture(self, engine_config: Any, info: Any) -> None:
        """CUDA graphs for the draft's one-token steps (k - 1 of them per proposal) and for
        one sequence's catch-up (the tokens a verification accepted, or its prompt), and its
        kernels compiled now rather than during the first request."""
        from pagedbackend.kernels.common import COMPILES
        r = self.runner
        COMPILES.disarm()
        if not engine_config.enforce_eager:     # its config has no speculative_config
            r.capture_graphs(info.max_num_batched_tokens, info.max_model_len)
        r.warmup(info.max_model_len)
        COMPILES.arm()

    def _valid(self, req: Any) -> int:
        v, preempted, owner = self.valid.get(req.request_id, (0, 0, None))
        return v if owner is req and preempted == req.num_preemptions else 0

    @torch.inference_mode()
    def propose(self, sched: Any) -> None:
        """Fill each verifying row's spec_token_ids (placeholders) with the draft's tokens."""
        rows = [s for s in sched.scheduled if s.spec_token_ids]
        reqs = [s.request for s in rows]
        ks = [len(s.spec_token_ids) for s in rows]
        # catch up to the last known token; its logits give the first draft
        starts = [self._valid(r) for r in reqs]
        ends = [r.num_tokens for r in reqs]
        tokens = np.concatenate([r.all_token_ids[a:b] for r, a, b in zip(reqs, starts, ends)])
        drafts = [self._step(rows, tokens, starts, ends)]
        live = list(range(len(rows)))
        for j in range(1, max(ks)):
            live = [i for i in live if ks[i] > j]
            pos = [ends[i] - 1 + j for i in live]
            ids = self._step([rows[i] for i in live], None, pos, [p + 1 for p in pos],
                             prev_rows=live, prev=drafts[-1])
            full = drafts[-1].clone()
            full[torch.tensor(live, dtype=torch.long, device=full.device)] = ids
            drafts.append(full)
        table = torch.stack(drafts, dim=1).tolist()        # the one sync: [R, max k]
        for s, row, k, end in zip(rows, table, ks, ends):
            s.spec_token_ids[:] = row[:k]
            # fed: positions up to end + k - 2 (the last draft is never fed)
            self.valid[s.request.request_id] = (end + k - 1, s.request.num_preemptions,
                                                s.request)
        if len(self.valid) > 2 * len(self.scheduler.requests) + 64:
            live = self.scheduler.requests
            self.valid = {r: v for r, v in self.valid.items() if live.get(r) is v[2]}

    def _step(self, rows: list, tokens, starts: list[int], ends: list[int],
              prev_rows: list[int] = (), prev: Any = None) -> torch.Tensor:
        """One draft forward: row i feeds positions [starts[i], ends[i]) (tokens given, or one
        token per row read from prev[prev_rows[i]] on the device); returns the greedy next
        token of each row (on the device)."""
        bs = self.block_size
        q = np.array(ends, np.int64) - np.array(starts, np.int64)
        st = np.array(starts, np.int64)
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
        width = max(-(-e // bs) for e in ends)
        table = np.zeros((len(rows), width), np.int32)
        for i, (s, e) in enumerate(zip(rows, ends)):
            n = -(-e // bs)
            table[i, :n] = s.block_ids[:n]
        ph_dst = ph_src = None
        if tokens is None:
            tokens = np.zeros(len(rows), np.int64)
            ph_dst, ph_src = np.arange(len(rows), dtype=np.int64), np.array(prev_rows, np.int64)
        h = HostInputs(np.asarray(tokens, np.int64), positions, q, st, table,
                       list(range(len(rows))), bs, ph_dst, ph_src)
        self.runner.prev_sampled = prev
        logits = self.runner.forward_logits(h)
        return logits.argmax(dim=-1)

    def verified(self, req: Any, num_accepted: int, start: int) -> None:
        """A verification of req's drafts (scheduled from position start) accepted
        num_accepted: draft K/V past the last accepted draft is not the request's."""
        entry = self.valid.get(req.request_id)
        if entry is not None and entry[2] is req:
            self.valid[req.request_id] = (min(entry[0], start + 1 + num_accepted), *entry[1:])
