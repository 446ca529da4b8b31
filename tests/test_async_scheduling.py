"""Async scheduling (step N+1 launched before step N's ids reach the host) gives exactly what the
synchronous engine gives: greedy and seeded tokens, stops, aborts, logprobs (of prompts too),
penalties, blocks.

On the CPU the device work is synchronous, but the engine's bookkeeping is the one the GPU runs:
pending tokens, rows whose input id is read from the previous step's sampled ids on the device,
one wasted token per stop, blocks freed while a step is in flight."""
import random

import pytest

from pagedbackend import LLM, EngineConfig, SamplingParams
from pagedbackend.engine.llm_engine import LLMEngine
from pagedbackend.testing import TINY_CONFIGS, drain, make_hf_checkpoint

VOCAB = TINY_CONFIGS["llama"]["vocab_size"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async_llama")
    make_hf_checkpoint("llama", path, seed=5, std=0.15)
    return str(path)


def prompts(seed, count=10):
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(9)]
    out = []
    for i in range(count):
        body = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        out.append(shared + body if i % 2 else body)
    return [{"prompt_token_ids": p} for p in out]


def both(path, batch, params, **kw):
    """The same requests through a synchronous and an async engine (same settings)."""
    res = []
    for mode in (False, True):
        llm = LLM(path, dtype="float32", async_scheduling=mode, **kw)
        assert llm.engine.async_scheduling is mode
        outs = llm.generate(batch, params)
        llm.engine.check_invariants()
        assert llm.engine.stats().num_used_blocks == 0
        res.append((llm, outs))
    return res


def tokens(outs):
    return [[(o.token_ids, o.finish_reason, o.stop_reason) for o in r.outputs] for r in outs]


def test_async_is_off_by_default_on_the_cpu_and_refused_with_tp(tiny_dir):
    assert LLMEngine(EngineConfig(model=tiny_dir, num_kv_blocks=64)).async_scheduling is False
    with pytest.raises(ValueError, match=r"^async_scheduling=True is invalid: must be off"):
        EngineConfig(model=tiny_dir, async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^async_scheduling='yes' is invalid"):
        EngineConfig(model=tiny_dir, async_scheduling="yes")


def test_greedy_equal_under_preemption_chunking_and_prefix_cache(tiny_dir):
    batch = prompts(1)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    (s_llm, sync), (a_llm, asyn) = both(tiny_dir, batch, params, block_size=4, num_kv_blocks=36,
                                        max_num_batched_tokens=20, max_num_seqs=8,
                                        max_model_len=96)
    assert tokens(asyn) == tokens(sync)
    assert all(len(r.outputs[0].token_ids) == 14 for r in asyn)
    st = a_llm.engine.stats()
    assert st.num_preemptions > 0, "the pool was meant to force preemption"
    assert st.prefix_cache_hits > 0


def test_stop_tokens_max_tokens_and_model_len_equal(tiny_dir):
    batch = prompts(2, count=6)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(tiny_dir, dtype="float32", num_kv_blocks=128).generate(batch, greedy)
    # Stop each request on its own 5th greedy token: async has launched the next step by then.
    per_req = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                              stop_token_ids=[r.outputs[0].token_ids[4]]) for r in ref]
    (_, sync), (_, asyn) = both(tiny_dir, batch, per_req, num_kv_blocks=128)
    assert tokens(asyn) == tokens(sync)
    assert all(r.outputs[0].finish_reason == "stop" for r in asyn)
    assert all(len(r.outputs[0].token_ids) <= 5 for r in asyn)
    # max_model_len ends a request by length while its last token is in flight.
    to_the_end = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    (_, sync), (_, asyn) = both(tiny_dir, batch, to_the_end, num_kv_blocks=128, max_model_len=48)
    assert tokens(asyn) == tokens(sync)
    assert all(len(r.prompt_token_ids) + len(r.outputs[0].token_ids) == 48 for r in asyn)


def test_seeded_sampling_min_tokens_penalties_and_logprobs_equal(tiny_dir):
    batch = prompts(3, count=6)
    params = [
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=10, ignore_eos=True,
                       logprobs=3),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6, ignore_eos=False,
                       stop_token_ids=list(range(VOCAB // 2))),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=9, max_tokens=12, presence_penalty=0.5,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=10, max_tokens=9, ignore_eos=True,
                       logprobs=2, prompt_logprobs=2),
    ]
    (_, sync), (_, asyn) = both(tiny_dir, batch, params, num_kv_blocks=128,
                                max_num_batched_tokens=16)
    assert tokens(asyn) == tokens(sync)
    assert len(asyn[5].prompt_logprobs) == len(batch[5]["prompt_token_ids"])
    assert [sorted(e) if e else e for e in asyn[5].prompt_logprobs] == \
        [sorted(e) if e else e for e in sync[5].prompt_logprobs]
    # min_tokens holds the stop ids back for exactly 6 tokens, then one of them stops it
    mt = asyn[2].outputs[0]
    assert len(mt.token_ids) >= 6 and mt.finish_reason in ("stop", "length")
    for a, s in zip(asyn, sync):
        for ao, so in zip(a.outputs, s.outputs):
            assert (ao.logprobs is None) == (so.logprobs is None)
            if ao.logprobs is not None:
                assert [sorted(x) for x in ao.logprobs] == [sorted(x) for x in so.logprobs]
                assert ao.cumulative_logprob == pytest.approx(so.cumulative_logprob, abs=1e-4)


def test_streamed_deltas_abort_in_flight_and_blocks(tiny_dir):
    eng = LLMEngine(EngineConfig(model=tiny_dir, dtype="float32", block_size=4,
                                 num_kv_blocks=64, async_scheduling=True))
    p = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    for rid, prompt in (("a", [5, 6, 7]), ("b", [9, 10]), ("c", [11, 12, 13, 14])):
        eng.add_request(rid, prompt, p)

    def abort_b(eng, steps):
        if steps == 3:
            assert eng._inflight is not None, "a step should be in flight between calls"
            eng.abort("b")          # its in-flight token must be dropped, its blocks freed
            eng.check_invariants()
    deltas, finals = drain(eng, abort_b)
    assert finals["b"].outputs[0].finish_reason == "abort"
    assert len(finals["b"].outputs[0].token_ids) < 9
    for rid in ("a", "c"):
        assert len(finals[rid].outputs[0].token_ids) == 9
    for rid in deltas:
        assert deltas[rid] == finals[rid].outputs[0].token_ids
    ref = LLM(tiny_dir, dtype="float32", num_kv_blocks=64).generate(
        [{"prompt_token_ids": [5, 6, 7]}], p)[0].outputs[0].token_ids
    assert finals["a"].outputs[0].token_ids == ref
    # The engine drains: the last call lands the step in flight and nothing is left behind.
    eng.step()
    assert eng._inflight is None
    eng.check_invariants()
    assert eng.stats().num_used_blocks == 0


def test_warmup_scratch_writes_do_not_change_outputs(tiny_dir):
    """The start-up warm-up (run on CUDA, before any block is owned or cached) writes scratch
    K/V into blocks; requests afterwards must not see it."""
    batch = prompts(4, count=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = tokens(LLM(tiny_dir, dtype="float32", block_size=4, num_kv_blocks=64)
                 .generate(batch, params))
    llm = LLM(tiny_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    llm.engine.runner.warmup()
    assert tokens(llm.generate(batch, params)) == ref


def test_timing_summary_counts_steps_by_path(tiny_dir):
    """The step split says how each step ran: on the CPU (no graphs) a step of decode rows
    alone is "eager", one where a new prompt joins running decodes is "mixed_eager"; the
    counts add up to the steps timed (the start-up warm-up not among them) and reset with the
    rest. path_ms gives the mean time a step of each path that ran took (wall time on the
    CPU): within the mean step time of the whole split, summed over paths."""
    llm = LLM(tiny_dir, dtype="float32", block_size=4, num_kv_blocks=64)
    eng = llm.engine
    eng.runner.warmup()         # as on CUDA at start: its steps are not counted
    assert set(eng.timing_summary()["path_steps"].values()) == {0}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": [3, 4, 5, 6, 7]}, params)
    for _ in range(3):
        eng.step()
    eng.add_request("b", {"prompt_token_ids": [8, 9, 10, 11]}, params)
    drain(eng)
    split = eng.timing_summary(reset=True)
    paths = split["path_steps"]
    assert paths["decode_graph"] == paths["prefill_graph"] == 0
    assert paths["mixed_eager"] >= 1 and paths["eager"] >= 3
    assert sum(paths.values()) == split["steps"]
    ms = split["path_ms"]
    assert set(ms) == {"eager", "mixed_eager"} and all(v > 0 for v in ms.values())
    total = split["step_ms"] * split["steps"]
    assert sum(ms[k] * paths[k] for k in ms) <= total * 1.05
    assert set(eng.timing_summary()["path_steps"].values()) == {0}
    assert "path_ms" in eng.timing_summary() and not eng.timing_summary()["path_ms"]
