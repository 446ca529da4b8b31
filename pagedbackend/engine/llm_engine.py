"""LLMEngine: requests in, one scheduling + model step at a time, RequestOutputs (with deltas) out.

Single-threaded by design: whoever drives the engine (LLM.generate, the Triton engine model's
loop thread) calls add_request/step/abort from one thread.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence, Union

from pagedbackend.config import EngineConfig, check
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.core.request import Request, RequestStatus
from pagedbackend.core.scheduler import Scheduler
from pagedbackend.engine.engine_stats import EngineStats, StepTiming
from pagedbackend.engine.generation_config import default_params, load_sampling_defaults
from pagedbackend.engine.model_files import load_model_files
from pagedbackend.engine.output_processor import OutputProcessor
from pagedbackend.engine.structured_outputs import GrammarCompiler
from pagedbackend.outputs import RequestOutput
from pagedbackend.sampling_params import SamplingParams

logger = logging.getLogger("pagedbackend")

PromptType = Union[str, Sequence[int], dict]
# A tenant's name or a random token: far below what would cost hashing or memory per request.
MAX_CACHE_SALT_CHARS = 1024


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from pagedbackend.worker import make_runner  # torch lives below this line
        from pagedbackend.worker.host_kv import make_host_tier

        self.config = config
        files = load_model_files(config)
        # generation_config.json's sampling values: the defaults of fields a request leaves unset
        self.sampling_defaults = load_sampling_defaults(config.generation_config, config.model)
        self.tokenizer = files.tokenizer
        self.runner = make_runner(config, files)
        info = files.info
        num_blocks = self.runner.num_kv_blocks
        blocks_needed = -(-info.max_model_len // config.block_size)
        if num_blocks < blocks_needed:
            self.runner.shutdown()
            raise ValueError(
                f"max_model_len={info.max_model_len} needs {blocks_needed} KV blocks of "
                f"{config.block_size} tokens but only {num_blocks} fit: lower max_model_len, "
                "raise gpu_memory_utilization / num_kv_blocks / kv_cache_memory_bytes, "
                "or use more GPUs (tensor_parallel_size)")
        self.info = info.with_blocks(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %s); max concurrency at "
                    "max_model_len=%d: %.1fx", num_blocks, config.block_size,
                    num_blocks * config.block_size, config.resolved_kv_cache_dtype(info.dtype),
                    info.max_model_len, num_blocks / blocks_needed)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, info.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy,
                                   host_tier=make_host_tier(config, self.kv,
                                                            self.runner.num_host_blocks,
                                                            files.hf_config, info))
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, info.vocab_size, info.eos_token_ids)
        self.timing = StepTiming()
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = (str(info.device).startswith("cuda")
                                     and config.tensor_parallel_size == 1)
        self._inflight = None       # (SchedulerOutput, Launched) of the step on the device
        self.drafter = None         # speculative decoding (spec_decode/drafter.py)
        if config.speculative_config is not None:
            from pagedbackend.spec_decode.drafter import make_drafter
            self.drafter = make_drafter(config, self)
        self.last_step_tokens = 0   # tokens the last step() scheduled (metrics)

    def timing_summary(self, reset: bool = False) -> dict:
        """Mean per-step split: host work vs waiting for the GPU at the one sync."""
        out = self.timing.summary(getattr(self.runner, "sync_wait_s", 0.0),
                                  getattr(self.runner, "gpu_busy_s", 0.0),
                                  getattr(self.runner, "path_steps", None),
                                  (self.runner.path_s, self.runner.path_timed)
                                  if hasattr(self.runner, "path_timed") else None)
        if reset:
            self.timing = StepTiming()
            if hasattr(self.runner, "reset_timing"):    # the TP driver keeps no counters
                self.runner.reset_timing()
        return out

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    priority: int = 0, cache_salt: Optional[str] = None,
                    detokenize: bool = True, arrival_time: Optional[float] = None,
                    final_only: bool = False) -> None:
        """Validate and queue a request; raises ValueError naming the bad field.

        final_only: step() reports this request once, when it finishes (offline use).
        Without params: the model's generation_config.json defaults (default_sampling_params)."""
        params = params or self.default_sampling_params()
        check(isinstance(request_id, str) and request_id != "", "request_id", request_id,
              "a non-empty string")
        check(not self.outputs.has(request_id), "request_id", request_id,
              "unique among unfinished requests")
        check(isinstance(priority, int) and not isinstance(priority, bool), "priority", priority,
              "an integer")
        check(cache_salt is None or isinstance(cache_salt, str)
              and len(cache_salt) <= MAX_CACHE_SALT_CHARS, "cache_salt", cache_salt,
              f"a string of at most {MAX_CACHE_SALT_CHARS} characters")
        check(params.n <= self.config.max_n, "n", params.n, f"an integer in [1, {self.config.max_n}]")
        prompt_text, ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None and len(ids) > params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
            prompt_text = None            # the text no longer matches the ids
        info = self.info
        check(len(ids) < info.max_model_len, "prompt", f"<{len(ids)} tokens>",
              f"at most {info.max_model_len - 1} tokens (max_model_len={info.max_model_len})")
        room = info.max_model_len - len(ids)
        # None: up to the context, or to generation_config.json's max_new_tokens (as vLLM)
        max_tokens = min(room, self.sampling_defaults.get("max_tokens", room)) \
            if params.max_tokens is None else params.max_tokens
        check(max_tokens <= room, "max_tokens", params.max_tokens,
              f"at most {room} for this {len(ids)}-token prompt "
              f"(prompt + max_tokens <= max_model_len={info.max_model_len})")
        if not self.config.enable_chunked_prefill:
            check(len(ids) <= info.max_num_batched_tokens, "prompt", f"<{len(ids)} tokens>",
                  f"at most max_num_batched_tokens={info.max_num_batched_tokens} tokens "
                  "when chunked prefill is off")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop=[...] is invalid: must be empty for a model without a tokenizer")
        params.check_vocab(info.vocab_size)
        bad_words = self._bad_words_token_ids(params.bad_words)
        grammar = params.structured_outputs
        if grammar is not None:
            grammar_state = self.grammars.state(grammar)      # compiles it, or names the error
        now = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                child_params = params.clone(n=1, seed=seed)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, ids, child_params, max_tokens, info.eos_token_ids,
                            now, priority, cache_salt, info.max_model_len)
            child.bad_words_token_ids = bad_words
            if params.prompt_logprobs is not None and i == 0:   # one list for all n children
                child.prompt_logprobs = [None]
            if grammar is not None:
                child.grammar = grammar_state if i == 0 else self.grammars.state(grammar)
            # penalties, grammars and bad words of several tokens read every token so far
            child.needs_all_tokens = (params.uses_repetition_penalty
                                      or params.uses_output_penalties
                                      or grammar is not None
                                      or child.prompt_logprobs is not None
                                      or any(len(w) > 1 for w in bad_words))
            children.append(child)
        self.outputs.add(request_id, prompt_text, ids, params, children,
                         detokenize=detokenize and self.tokenizer is not None, arrival_time=now,
                         final_only=final_only)
        for child in children:
            self.scheduler.add_request(child)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's get_default_sampling_params: SamplingParams with the model's
        generation_config.json values (EngineConfig.generation_config="vllm": none)."""
        return default_params(self.sampling_defaults)

    def default_sampling_fields(self) -> dict:
        """The generation_config.json values a request's unset fields take (Triton requests)."""
        return dict(self.sampling_defaults)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would appear at the start of the text and after a
        space (tokenizers that mark word starts give the two different ids), without
        duplicates."""
        if not words:
            return []
        check(self.tokenizer is not None, "bad_words", words,
              "empty for a model without a tokenizer")
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(the prompt's text or None, its token ids), checked as add_request checks them: text
        is encoded with special tokens, ids must lie in the vocabulary."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            else:
                prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            check(prompt != "", "prompt", prompt, "a non-empty string")
            check(self.tokenizer is not None, "prompt", "<text>",
                  "token ids (this model has no tokenizer)")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            check(len(ids) > 0, "prompt", prompt, "text that tokenizes to at least one token")
            return prompt, ids
        ids = list(prompt)
        check(len(ids) > 0, "prompt_token_ids", ids, "a non-empty list of token ids")
        vocab = self.info.vocab_size
        for t in ids:
            check(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab,
                  "prompt_token_ids", t, f"token ids in [0, {vocab})")
        return None, ids

    def abort(self, request_id: Union[str, Sequence[str]]) -> None:
        """Stop requests now and free their blocks; their final output comes with the next step()."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            children = self.outputs.child_ids(rid)
            finished = self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            self.runner.release([r.request_id for r in finished])
            self.outputs.on_finished(finished)

    def has_unfinished(self) -> bool:
        return self.outputs.has_unfinished()

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs that changed.

        With async scheduling the step launched here runs on the device while the previous
        step's sampled ids are turned into outputs, so a request's tokens arrive one call
        later; a request that stops on a sampled token (EOS, stop string) has one extra token
        computed and dropped."""
        t0 = time.perf_counter()
        if self.drafter is not None:
            self._propose()
        sched = self.scheduler.schedule(time.monotonic())
        self.last_step_tokens = sched.num_scheduled_tokens
        t1 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        verifies = self.drafter is not None and any(s.spec_token_ids for s in sched.scheduled)
        if verifies and self.drafter.draft_runner is not None:
            self.drafter.fill(sched)         # the draft model's proposals, into these slots
        if prev is not None and (sched.is_empty or any(s.request.needs_all_tokens
                                                       for s in sched.scheduled)):
            # Nothing to overlap with, or a row whose sampling reads every earlier token
            # (penalties): land the step in flight first.
            self._land(*prev)
            prev = None
        if sched.is_empty:
            return self.outputs.collect()
        launched = self.runner.launch(sched)
        self.scheduler.on_launched(sched)
        if self.async_scheduling and not verifies:
            self._inflight = (sched, launched)
        else:
            prev = (sched, launched)
        t2 = time.perf_counter()
        if prev is not None:
            self._land(*prev)
        outputs = self.outputs.collect()
        self.timing.add(t0, t1, t2, time.perf_counter(), sched.num_scheduled_tokens)
        return outputs

    def _propose(self) -> None:
        """Drafts for this step's decodes. A draft continues the request's latest token, so a
        step in flight lands first: steps that verify drafts run without async scheduling
        (their ids are needed before the next proposal anyway)."""
        sch = self.scheduler
        if not self.drafter.active(sch.num_running + sch.num_waiting):
            self.drafter.clear(sch.running)
            return
        if self._inflight is not None:
            if not self.drafter.should_probe():
                self.drafter.clear(sch.running)
                return
            self._land(*self._inflight)
            self._inflight = None
        self.drafter.propose(sch.running)

    def _land(self, sched, launched) -> None:
        """Take a launched step's sampled ids into the requests and their outputs."""
        result = self.runner.finish(launched)
        if result.prompt_logprobs:
            by_id = {s.request.request_id: s.request for s in sched.scheduled}
            for rid, (first, entries) in result.prompt_logprobs.items():
                got = by_id[rid].prompt_logprobs
                # entries for prompt tokens first, first + 1, ...; a recomputed (preempted)
                # prefix repeats ones already kept
                got.extend(entries[max(0, len(got) - first):])
        if self.drafter is not None:
            self.drafter.record(sched, result.accepted)
        progressed, finished = self.scheduler.update_from_output(sched, result.sampled,
                                                                 result.accepted)
        stopped = self.outputs.on_tokens(progressed, result.logprobs, time.monotonic())
        if stopped:
            finished += self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.outputs.on_finished(finished)
        self.runner.release([r.request_id for r in finished])

    def stats(self) -> EngineStats:
        host = self.scheduler.host
        tier = {} if host is None else dict(
            num_swapped=self.scheduler.num_swapped, cpu_cache_usage=host.pool.usage(),
            num_host_blocks=host.pool.num_blocks, swap_out_blocks=host.num_swap_out_blocks,
            swap_in_blocks=host.num_swap_in_blocks, cpu_prefix_cache_queries=host.prefix_queries,
            cpu_prefix_cache_hits=host.prefix_hits, preemptions_swap=host.preemptions["swap"],
            preemptions_recompute=host.preemptions["recompute"])
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(), num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_kv_blocks=self.kv.num_blocks,
            num_used_blocks=self.kv.pool.num_used_blocks,
            spec_decode=self.drafter.snapshot() if self.drafter is not None else None,
            **tier)

    def check_invariants(self) -> dict[str, int]:
        idle = not self.scheduler.has_unfinished()
        counts = self.kv.check_invariants(idle=idle)
        if self.scheduler.host is not None:
            swapped = {r.request_id for r in self.scheduler.swapped}
            host = self.scheduler.host.check_invariants(swapped, idle=idle)
            counts.update({f"host_{k}": v for k, v in host.items()})
        return counts

    def shutdown(self) -> None:
        self.runner.shutdown()

