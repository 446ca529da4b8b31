"""Runs one scheduled step on one device: its inputs (step_inputs.py) onto the device, the
model, sampling.

The runner never sees the allocator: block ids arrive in the SchedulerOutput. It owns the
model, the KV cache tensors, the sampler and per-request random generators.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from pagedbackend.config import EngineConfig
from pagedbackend.core.scheduler import SchedulerOutput
from pagedbackend.layers.attention import AttentionMetadata
from pagedbackend.layers.sampler import Sampler, argmax
from pagedbackend.layers.sampling_metadata import SamplingMetadata, to_device_async
from pagedbackend.models import build_model, load_weights
from pagedbackend.worker import cuda_graph, host_kv
from pagedbackend.worker.cuda_graph import DecodeGraphs, PrefillGraphs
from pagedbackend.worker.kv_sizing import kv_bytes_per_block, num_blocks_for_device
from pagedbackend.worker.prompt_logprobs import prompt_logprobs
from pagedbackend.worker.step_inputs import (HostInputs, StepInputs, host_inputs, upload,
                                             warmup_inputs)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RunnerResult:
    sampled: dict[str, int]
    # request id -> (sampled token logprob, {token id: logprob} incl. the top-k)
    logprobs: dict[str, tuple[float, dict[int, float]]] = field(default_factory=dict)
    # request id -> (prompt index of the first entry, prompt logprob entries)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    # request id -> the draft tokens it accepted (before its sampled token)
    accepted: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Launched:
    """A step whose sampled ids are on their way to the host (see ModelRunner.launch)."""
    reqs: list                          # the requests of the sampling rows, in row order
    ids: Optional[torch.Tensor] = None  # [R] long: pinned host copy (CUDA) or the CPU result
    done: Any = None                    # CUDA event recorded after the copy
    start: Any = None                   # CUDA timing event before the step's first upload
    logprobs: Any = None
    prompt_logprobs: Any = None         # PromptLogprobs, on the device
    # a verification step (spec_decode/verify.Verification): ids is [R, 1 + k], each row's
    # tokens, -1 padded
    verified: Any = None
    path: str = ""                      # how forward_logits ran it (new_path_steps' keys)
    t_launch: float = 0.0               # perf_counter() at launch (the CPU's step time)


def make_attn_backend(device: torch.device):
    # PAGEDBACKEND_ATTENTION=torch forces the reference path on a GPU (debugging, A/B timing).
    if device.type == "cuda" and os.environ.get("PAGEDBACKEND_ATTENTION", "triton") == "triton":
        from pagedbackend.kernels import TritonAttentionBackend
        return TritonAttentionBackend()
    from pagedbackend.layers.attention import TorchAttentionBackend
    return TorchAttentionBackend()


def new_path_steps() -> dict[str, int]:
    """Step counts by path: decode_graph / prefill_graph (a CUDA graph replayed), mixed_eager
    (decode rows and prefill tokens in one step: launched kernel by kernel), eager (the
    rest: prefill-only steps no graph takes, and every step without graphs). Each kernel of
    an eager step is a launch from Python, so a serving load whose steps are mostly eager is
    bound by the host (W4: a request arriving while others decode makes a mixed step)."""
    return {"decode_graph": 0, "prefill_graph": 0, "mixed_eager": 0, "eager": 0}


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict, device: str, dtype: str,
                 tp_rank: int = 0, tp_size: int = 1, tp_group: Any = None):
        self.config = config
        self.hf_config = hf_config
        if device == "cuda":
            device = f"cuda:{tp_rank if tp_size > 1 else torch.cuda.current_device()}"
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        # the KV cache's element type: the model's, or float8 e4m3 (values saturate at +-448,
        # scale 1; the attention kernels widen them to the model's dtype as they read)
        self.kv_dtype = getattr(torch, config.resolved_kv_cache_dtype(dtype))
        self.tp_rank, self.tp_size = tp_rank, tp_size
        torch.manual_seed(config.seed)
        self.model = build_model(hf_config, self.dtype, self.device, make_attn_backend(self.device),
                                 tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        load_weights(self.model, config.model, config.load_format,
                     quantization=config.quantization, hf_config=hf_config)
        self.model.eval()
        self.sampler = Sampler()
        self.block_size = config.block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.generators: dict[str, torch.Generator] = {}
        self.num_kv_blocks = 0
        self.graphs: Optional[DecodeGraphs] = None
        self.prefill_graphs: Optional[PrefillGraphs] = None
        self.reset_timing()
        self.prev_sampled: Optional[torch.Tensor] = None    # the last launch's sampled ids
        self.prev_rows: dict[str, int] = {}                 # request id -> row in them
        self.prompt_logits: Optional[torch.Tensor] = None   # this step's, for prompt_logprobs
        self.host_kv = None                                  # the host tier (swap_space > 0)
        self.num_host_blocks = 0

    def reset_timing(self) -> None:
        """Zero what LLMEngine.timing_summary reads: the time spent waiting for the GPU at the
        per-step sync, on CUDA the sum of (first upload -> ids copied) per step, and the steps
        by how forward_logits ran them."""
        self.sync_wait_s = 0.0
        self.gpu_busy_s = 0.0
        self.path_steps = new_path_steps()
        # seconds and steps timed by path: on CUDA a step's device time (first upload -> ids
        # copied), on the CPU its wall time from launch to the ids (the forward runs there
        # synchronously); steps that sample no row (a prompt's middle chunks) are not timed
        self.path_s = dict.fromkeys(self.path_steps, 0.0)
        self.path_timed = dict.fromkeys(self.path_steps, 0)
        self._path = ""

    # -- KV cache ------------------------------------------------------------------------
    def init_kv_cache(self, max_num_batched_tokens: int, max_model_len: int,
                      agree: Optional[Callable[[int], int]] = None) -> int:
        """Size, allocate and (on CUDA) graph-capture the KV cache. Tensor-parallel ranks pass
        `agree` (their count -> the minimum over ranks) so every rank allocates the same pool."""
        if self.device.type == "cuda":
            from pagedbackend.kernels.common import COMPILES
            COMPILES.disarm()   # this start-up's compiles are expected (another engine's may not)
        per_block = kv_bytes_per_block(self.hf_config, self.block_size, self.kv_dtype,
                                       self.tp_size)
        staging = self._host_tier_staging(per_block)
        num_blocks = num_blocks_for_device(
            self.config, self.device, per_block,
            profile=lambda: self.profile_run(max_num_batched_tokens, max_model_len))
        if agree is not None:
            num_blocks = agree(num_blocks)
        self.allocate_kv_cache(num_blocks)
        if num_blocks < -(-max_model_len // self.block_size):
            # too few for one sequence: the engine refuses with the figures (llm_engine.py);
            # capturing graphs over an empty cache (0 blocks, e.g. when another engine in this
            # process holds the memory) ended in an illegal memory access instead
            return num_blocks
        if staging is not None:
            self.host_kv = host_kv.HostKVCache(self.kv_cache, self.num_host_blocks, staging,
                                               self.config.swap_space)
        if self.device.type == "cuda" and not self.config.enforce_eager:
            self.capture_graphs(max_num_batched_tokens, max_model_len)
        if self.device.type == "cuda":
            self.warmup(max_model_len)
            from pagedbackend.kernels.common import COMPILES
            COMPILES.arm()      # from here on, a kernel compile is logged as a warning
        return num_blocks

    def capture_graphs(self, max_num_batched_tokens: int, max_model_len: int) -> None:
        """The decode graphs, then (unless PAGEDBACKEND_PREFILL_GRAPHS=0) the prefill graphs,
        which with speculative decoding also verify 1 + k tokens a sequence."""
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.device,
                                   self.config.max_num_seqs, max_model_len, self.block_size)
        self.graphs.capture()
        if cuda_graph.PREFILL_GRAPHS:
            spec = self.config.speculative_config
            self.prefill_graphs = PrefillGraphs(
                self.model, self.kv_caches, self.device, max_num_batched_tokens,
                max_model_len, self.block_size, self.graphs.pool,
                rows=1 + spec.num_speculative_tokens if spec is not None else 1,
                max_seqs=self.config.max_num_seqs)
            self.prefill_graphs.capture()

    def _host_tier_staging(self, per_block: int) -> Optional[torch.Tensor]:
        """With swap_space: check the host can hold the tier, and make the device's staging
        buffer for its copies (before sizing the KV cache, which then leaves room for it)."""
        if not self.config.swap_space:
            return None
        self.num_host_blocks = host_kv.num_host_blocks(self.config.swap_space, per_block)
        host_kv.check_host_memory(self.config.swap_space, self.tp_size)
        layers = int(self.hf_config["num_hidden_layers"])
        shape = (2, layers, self.block_size, self.model.num_kv_heads,
                 self.model.head_dim * torch.empty((), dtype=self.kv_dtype).element_size())
        return host_kv.staging_buffer(shape, per_block, self.num_host_blocks, self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layers = int(self.hf_config["num_hidden_layers"])
        kv_heads = self.model.num_kv_heads
        head_dim = self.model.head_dim
        shape = (2, layers, num_blocks, self.block_size, kv_heads, head_dim)
        cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_cache = cache
        self.kv_caches = [(cache[0, i], cache[1, i]) for i in range(layers)]
        self.num_kv_blocks = num_blocks

    @torch.inference_mode()
    def profile_run(self, max_num_batched_tokens: int, max_model_len: int) -> None:
        """One full-budget prefill on a scratch cache, to measure the activation peak."""
        seq = min(max_num_batched_tokens, max_model_len)
        lens = [seq] * (max_num_batched_tokens // seq)
        if max_num_batched_tokens % seq:
            lens.append(max_num_batched_tokens % seq)
        blocks_per_seq = -(-seq // self.block_size)
        saved = self.kv_caches
        self.allocate_kv_cache(blocks_per_seq * len(lens))
        tokens = np.zeros(sum(lens), dtype=np.int64)
        positions = np.concatenate([np.arange(n) for n in lens])
        table = np.arange(blocks_per_seq * len(lens), dtype=np.int32).reshape(len(lens), -1)
        inputs = self.to_device(HostInputs(tokens, positions, np.array(lens),
                                           np.zeros(len(lens), np.int64), table,
                                           list(range(len(lens))), self.block_size))
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        self.model.compute_logits(hidden[inputs.logits_indices])
        self.kv_caches = saved
        del hidden

    @torch.inference_mode()
    def warmup(self, max_model_len: int = 1 << 30) -> None:
        """Run step_inputs.warmup_inputs' scratch steps eagerly, so every triton kernel variant
        is compiled at start. Eager even where a step of that shape would replay a graph (the
        graphs' own variants were built when they were captured; with enforce_eager there are
        none)."""
        from pagedbackend.kernels.common import num_sms
        k_cache = self.kv_caches[0][0]      # what the attention backend decides from
        wide = min(self.config.max_num_seqs,
                   num_sms(k_cache.device.index) // k_cache.shape[2] + 1)
        for h in warmup_inputs(self.block_size, self.num_kv_blocks, max_model_len, wide):
            logits = self.forward_logits(h, graphs=False)
            if logits is not None:
                # the greedy sampler's kernel, too: on the logits as they are, and widened
                # (the sampler's path when penalties or random rows share the step)
                argmax(logits)
                argmax(logits.float())
        self.reset_timing()         # the warm-up's steps are not the engine's
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one step ------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> HostInputs:
        h = host_inputs(sched.scheduled, self.block_size, self.prev_rows)
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            h.swaps = (sched.blocks_to_swap_out, sched.blocks_to_swap_in)
        return h

    def _upload_step(self, h: HostInputs) -> list[torch.Tensor]:
        """[tokens, positions, slots, cu, seq_lens, table, logits_idx] on the device (int64),
        with the ids of in-flight tokens filled in from the previous launch's samples."""
        logits_idx = h.logits_idx
        *arrays, ph_dst, ph_src = upload([h.tokens, h.positions, h.slots, h.cu, h.seq_lens,
                                          h.table, logits_idx, h.ph_dst, h.ph_src], self.device)
        if len(h.ph_dst):
            if self.prev_sampled is None:
                raise RuntimeError("a step refers to sampled ids of a previous step that did "
                                   "not sample")
            arrays[0].index_copy_(0, ph_dst, self.prev_sampled.index_select(0, ph_src))
        return arrays

    def to_device(self, h: HostInputs) -> StepInputs:
        tokens, positions, slots, cu, seq_lens, table, logits_idx_d = self._upload_step(h)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=cu.int(), seq_lens=seq_lens.int(),
            block_tables=table.int(), max_query_len=int(h.q_lens.max()),
            max_seq_len=int(h.seq_lens.max()), query_lens_cpu=h.q_lens.tolist(),
            seq_lens_cpu=h.seq_lens.tolist())
        return StepInputs(tokens, positions, meta, logits_idx_d, h.sample_rows)

    def forward_logits(self, h: HostInputs, graphs: bool = True) -> Optional[torch.Tensor]:
        """Logits of the rows that sample: a CUDA graph replay for decode steps and for one
        sequence's prefill of up to 512 tokens, else eager (graphs=False: always eager).
        Tensor-parallel workers call this alone (they take part in the collectives, not in
        sampling)."""
        if h.swaps is not None:         # the host tier's copies go ahead of the forward
            self.host_kv.swap(*h.swaps)
        # the graphs compute only the sampling rows' logits, not prompt logprobs (a one-token
        # chunk of a prompt can make a step of single tokens)
        graphs = graphs and not len(h.plp_idx)
        if graphs and self.graphs is not None and h.decode_only and not h.num_drafts \
                and self.graphs.bucket(len(h.tokens)):
            self.path_steps["decode_graph"] += 1
            self._path = "decode_graph"
            # The graph's static int32 buffers take the int64 uploads by copy (no casts here).
            tokens, positions, slots, _, seq_lens, table, rows = self._upload_step(h)
            logits = self.graphs.run(tokens, positions, slots, seq_lens, table)
            # One token per row, so the logits indices are the sampling rows (already on the
            # device: indexing with the host list would be a blocking copy).
            return logits if len(h.sample_rows) == len(h.tokens) else logits.index_select(0, rows)
        # one sequence's prefill, or a verification of drafts (1 + k logits rows a sequence)
        key = self.prefill_graphs.bucket(len(h.q_lens), len(h.tokens), len(h.logits_idx)) \
            if graphs and self.prefill_graphs is not None and h.sample_rows \
            and (len(h.q_lens) == 1 or h.num_drafts) else None
        if key is not None:
            self.path_steps["prefill_graph"] += 1
            self._path = "prefill_graph"
            tokens, positions, slots, cu, seq_lens, table, rows = self._upload_step(h)
            return self.prefill_graphs.run(key, tokens, positions, slots, cu, seq_lens, table,
                                           rows)
        mixed = not h.decode_only and bool((h.q_lens == 1).any())
        self._path = "mixed_eager" if mixed else "eager"
        self.path_steps[self._path] += 1
        inputs = self.to_device(h)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        if len(h.plp_idx):
            # every rank: the LM head's collectives; rank 0 keeps them (_sample_async)
            idx = to_device_async(torch.from_numpy(h.plp_idx), hidden.device)
            self.prompt_logits = self.model.compute_logits(hidden[idx])
        if not h.sample_rows:
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        return self.finish(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> Launched:
        """Queue the step's work on the device and return at once: the sampled ids follow in
        finish(). A row whose last token is still in flight (async scheduling) reads it from
        the previous launch's sampled ids on the device."""
        t0 = time.perf_counter()
        h = self.prepare(sched)
        start = None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        self._path = ""
        launched = self._sample_async(sched, h, self.forward_logits(h), start)
        launched.path, launched.t_launch = self._path, t0
        return launched

    @torch.inference_mode()
    def sample(self, sched: SchedulerOutput, h: HostInputs,
               logits: Optional[torch.Tensor]) -> RunnerResult:
        return self.finish(self._sample_async(sched, h, logits))

    def _sample_async(self, sched: SchedulerOutput, h: HostInputs,
                      logits: Optional[torch.Tensor], start: Any = None) -> Launched:
        plp, self.prompt_logits = self.prompt_logits, None
        if plp is not None:
            plp = prompt_logprobs(plp, h, sched.scheduled)
        if logits is None:
            self.prev_sampled, self.prev_rows = None, {}
            return Launched([], start=start, prompt_logprobs=plp)
        if h.num_drafts:
            from pagedbackend.spec_decode.verify import launch_verification
            self.prev_sampled, self.prev_rows = None, {}     # verification steps land at once
            return launch_verification(self, sched, h, logits, start, plp)
        reqs = [sched.scheduled[i].request for i in h.sample_rows]
        smeta = SamplingMetadata.build(
            params=[r.sampling_params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[self._generator(r) for r in reqs],
            min_tokens_stop_ids=[self._min_tokens_stop_ids(r) for r in reqs],
            vocab_size=logits.shape[-1], device=self.device,
            bad_words=([r.bad_words_token_ids for r in reqs]
                       if any(r.bad_words_token_ids for r in reqs) else None),
            grammars=([r.grammar for r in reqs]
                      if any(r.grammar is not None for r in reqs) else None))
        out = self.sampler(logits, smeta)
        sampled = out.sampled_token_ids
        self.prev_sampled = sampled
        self.prev_rows = {r.request_id: i for i, r in enumerate(reqs)}
        if self.device.type != "cuda":
            return Launched(reqs, sampled, logprobs=out.logprobs, prompt_logprobs=plp)
        ids = torch.empty(len(reqs), dtype=torch.long, pin_memory=True)
        ids.copy_(sampled, non_blocking=True)
        done = torch.cuda.Event(enable_timing=start is not None)
        done.record()
        return Launched(reqs, ids, done, start, out.logprobs, plp)

    def finish(self, launched: Launched) -> RunnerResult:
        """Wait for a launched step's sampled ids (the step's one device->host sync)."""
        if not launched.reqs:
            return RunnerResult({}, prompt_logprobs=launched.prompt_logprobs.tolists()
                                if launched.prompt_logprobs is not None else {})
        t0 = time.perf_counter()
        if launched.done is not None:
            launched.done.synchronize()
        ids = launched.ids.tolist()
        self.sync_wait_s += time.perf_counter() - t0
        if launched.start is not None:
            busy = launched.start.elapsed_time(launched.done) / 1e3
            self.gpu_busy_s += busy
        else:
            busy = time.perf_counter() - launched.t_launch if launched.t_launch else 0.0
        if launched.path:
            self.path_s[launched.path] += busy
            self.path_timed[launched.path] += 1
        reqs = launched.reqs
        accepted, spec_logprobs = {}, {}
        if launched.verified is not None:
            from pagedbackend.spec_decode.verify import finish_verification
            ids, accepted, spec_logprobs = finish_verification(launched.verified, reqs, ids)
        result = RunnerResult({r.request_id: t for r, t in zip(reqs, ids)}, accepted=accepted)
        if launched.prompt_logprobs is not None:
            result.prompt_logprobs = launched.prompt_logprobs.tolists()
        if launched.logprobs is not None:
            for r, tok, entry in zip(reqs, ids, launched.logprobs.tolists()):
                if entry is not None:
                    result.logprobs[r.request_id] = (entry[tok], entry)
        result.logprobs.update(spec_logprobs)     # a list of entries: one per token
        return result

    def _generator(self, req) -> Optional[torch.Generator]:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        g = self.generators.get(req.request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self.generators[req.request_id] = g
        return g

    @staticmethod
    def _min_tokens_stop_ids(req) -> list[int]:
        p = req.sampling_params
        # The token sampled now follows the ones still in flight.
        if req.num_output_tokens + req.num_pending >= p.min_tokens:
            return []
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids += list(req.eos_token_ids)
        return ids

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def shutdown(self) -> None:
        self.kv_caches = []
        if self.host_kv is not None:
            self.host_kv.close()
        self.kv_cache = self.host_kv = None
