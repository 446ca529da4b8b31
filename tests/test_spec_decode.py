"""Speculative decoding through the engine on tiny random models: greedy output with drafts
equals the output without (n-gram and draft model, each architecture, under preemption, prefix
hits and chunked prefill), seeded sampling repeats, aborts, opt-outs, and no KV block leaks."""
import random

import pytest

from pagedbackend import LLM, SamplingParams
from pagedbackend.engine.llm_engine import LLMEngine
from pagedbackend.config import EngineConfig
from pagedbackend.testing import ARCHS, TINY_CONFIGS, drain, make_hf_checkpoint

VOCAB = TINY_CONFIGS["llama"]["vocab_size"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        out[arch] = str(tmp_path_factory.mktemp(f"spec_{arch}"))
        make_hf_checkpoint(arch, out[arch], seed=5, std=0.15)
    out["draft"] = str(tmp_path_factory.mktemp("spec_draft"))
    make_hf_checkpoint("llama", out["draft"], seed=6, std=0.15, num_hidden_layers=1)
    return out


def repeating_prompts(seed, count=6):
    """Prompts that repeat a short pattern (so the n-gram proposer finds matches) and random
    ones (so it finds few), some sharing a prefix (prefix cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(9)]
    out = []
    for i in range(count):
        pattern = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 7))]
        body = pattern * rng.randrange(2, 5) if i % 3 else \
            [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 20))]
        out.append(shared + body if i % 2 else body)
    return [{"prompt_token_ids": p} for p in out]


def no_leak(llm):
    """Every block back in the pool (free or cached-evictable), tables consistent."""
    eng = llm.engine if isinstance(llm, LLM) else llm
    eng.check_invariants()
    assert eng.stats().num_used_blocks == 0
    assert eng.kv.pool.num_free_blocks == eng.kv.num_blocks


def run(path, batch, params, spec=None, **kw):
    llm = LLM(path, dtype="float32", speculative_config=spec, **kw)
    outs = llm.generate(batch, params)
    no_leak(llm)
    return llm, [[(o.token_ids, o.finish_reason) for o in r.outputs] for r in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ngram_and_draft_model_equal_no_speculation(ckpts, arch):
    batch = repeating_prompts(1)
    _, ref = run(ckpts[arch], batch, GREEDY, num_kv_blocks=64)
    # a draft of another architecture (the 1-layer llama) with the same vocabulary
    draft = {"method": "draft_model", "model": ckpts["draft"], "num_speculative_tokens": 2}
    _, got = run(ckpts[arch], batch, GREEDY, draft, num_kv_blocks=64)
    assert got == ref
    llm, got = run(ckpts[arch], batch, GREEDY, NGRAM, num_kv_blocks=64)
    assert got == ref
    st = llm.engine.drafter.stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens <= st.num_draft_tokens
    assert st.num_accepted_tokens == sum(st.accepted_per_pos)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equal_under_preemption_prefix_hits_and_chunked_prefill(ckpts, method):
    batch = repeating_prompts(2, count=8)
    kw = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=12, max_num_seqs=8,
              max_model_len=96)
    # the draft model is the target itself: a draft K/V cache out of step with the request
    # (after a preemption, a prefix hit, rejected drafts) would show as a rejected draft
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": ckpts["llama"],
                                            "num_speculative_tokens": 3}
    _, ref = run(ckpts["llama"], batch, GREEDY, **kw)
    llm, got = run(ckpts["llama"], batch, GREEDY, spec, **kw)
    assert got == ref
    st = llm.engine.stats()
    assert st.num_preemptions > 0, "the pool was meant to force preemption"
    assert st.prefix_cache_hits > 0
    sd = llm.engine.drafter.stats
    assert sd.num_drafts > 0
    if method == "draft_model":
        assert sd.num_accepted_tokens == sd.num_draft_tokens


def test_draft_identical_to_target_accepts_every_draft(ckpts):
    spec = {"method": "draft_model", "model": ckpts["llama"], "num_speculative_tokens": 4}
    batch = repeating_prompts(3, count=4)
    _, ref = run(ckpts["llama"], batch, GREEDY, num_kv_blocks=64)
    llm, got = run(ckpts["llama"], batch, GREEDY, spec, num_kv_blocks=64)
    assert got == ref
    st = llm.engine.drafter.stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens
    # (near max_tokens a row proposes fewer than 4)
    assert st.accepted_per_pos[0] == st.num_drafts >= st.accepted_per_pos[3] > 0


def test_draft_model_with_another_vocabulary_is_refused(ckpts, tmp_path):
    make_hf_checkpoint("llama", tmp_path, seed=1, vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match=r"^speculative_config.model='.*' is invalid: must be a "
                                         r"model with the target's vocabulary \(vocab_size 160, "
                                         r"the draft has 168\)"):
        LLM(ckpts["llama"], dtype="float32", num_kv_blocks=32,
            speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_seeded_sampling_repeats_and_n_children_each_speculate(ckpts):
    batch = repeating_prompts(4, count=4)
    params = [SamplingParams(temperature=0.8, top_k=8, seed=11, max_tokens=16, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=12, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=13, max_tokens=16,
                             ignore_eos=True)]
    _, first = run(ckpts["llama"], batch, params, NGRAM, num_kv_blocks=96)
    llm, again = run(ckpts["llama"], batch, params, NGRAM, num_kv_blocks=96)
    assert first == again
    assert llm.engine.drafter.stats.num_drafts > 0
    assert len({tuple(t) for t, _ in first[1]}) > 1, "n=3 children should differ"
    _, ref = run(ckpts["llama"], batch[2:3], params[2], num_kv_blocks=96)
    assert first[2] == ref[0]


def test_opt_out_rows_and_logprobs_match_no_speculation(ckpts):
    """Penalties and min_tokens rows run without drafts beside rows with them; logprobs rows
    speculate and get one entry per accepted token, as without drafts."""
    batch = repeating_prompts(5, count=4)
    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, min_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    ref_llm = LLM(ckpts["llama"], dtype="float32", num_kv_blocks=96)
    ref = ref_llm.generate(batch, params)
    llm = LLM(ckpts["llama"], dtype="float32", num_kv_blocks=96, speculative_config=NGRAM)
    got = llm.generate(batch, params)
    no_leak(llm)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in ref]
    g, w = got[1].outputs[0], ref[1].outputs[0]
    assert len(g.logprobs) == len(g.token_ids)
    assert [sorted(x) for x in g.logprobs] == [sorted(x) for x in w.logprobs]
    for a, b in zip(g.logprobs, w.logprobs):
        assert [a[t] for t in sorted(a)] == pytest.approx([b[t] for t in sorted(b)], abs=1e-4)
    assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
    assert llm.engine.drafter.stats.num_drafts > 0


def test_abort_in_the_middle_of_a_verification_frees_everything(ckpts):
    """b is aborted while a step verifying its drafts is on the device (between launch and
    the step's ids landing, as an abort from the serving loop can): its result is dropped,
    its blocks (draft slots included) freed, the others unchanged."""
    eng = LLMEngine(EngineConfig(model=ckpts["llama"], dtype="float32", block_size=4,
                                 num_kv_blocks=64, speculative_config=NGRAM))
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {"a": [5, 6, 7] * 4, "b": [9, 10] * 5, "c": [11, 12, 13, 14] * 3}
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, p)
    finish, aborted = eng.runner.finish, []

    def finish_after_abort(launched):
        if launched.verified and not aborted and any(
                r.request_id == "b" and r.spec_token_ids for r in launched.reqs):
            eng.abort("b")
            aborted.append(True)
            eng.check_invariants()
        return finish(launched)
    eng.runner.finish = finish_after_abort
    deltas, finals = drain(eng)
    assert aborted, "b should have been aborted during a verification"
    assert finals["b"].outputs[0].finish_reason == "abort"
    ref = LLM(ckpts["llama"], dtype="float32", num_kv_blocks=64).generate(
        [{"prompt_token_ids": prompts[r]} for r in ("a", "c")], p)
    assert [finals[r].outputs[0].token_ids for r in ("a", "c")] == \
        [o.outputs[0].token_ids for o in ref]
    for rid in deltas:
        assert deltas[rid] == finals[rid].outputs[0].token_ids
    no_leak(eng)


def test_async_scheduling_with_drafts_equals_without(ckpts):
    """Async scheduling on (as on a GPU): steps while the drafter is off (too many requests)
    overlap, steps with it land first; greedy output as without speculation."""
    batch = repeating_prompts(7, count=4)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 8, 20, 20)]
    _, ref = run(ckpts["llama"], batch, params, num_kv_blocks=96)
    llm, got = run(ckpts["llama"], batch, params, dict(NGRAM, disable_by_batch_size=3),
                   num_kv_blocks=96, async_scheduling=True)
    assert llm.engine.async_scheduling is True
    assert got == ref
    assert llm.engine.drafter.stats.num_drafts > 0
    # a proposer that never finds drafts: most steps keep the async overlap (a round that
    # waits for the step in flight only every PROBE_EVERY steps), output unchanged
    from pagedbackend.spec_decode.drafter import PROBE_EVERY

    class Nothing:
        calls = 0

        def propose(self, token_ids, k):
            Nothing.calls += 1
            return []
    llm = LLM(ckpts["llama"], dtype="float32", num_kv_blocks=96, async_scheduling=True,
              speculative_config=NGRAM)
    llm.engine.drafter.proposer = Nothing()
    outs = llm.generate(batch[2:3], params[2])
    assert outs[0].outputs[0].token_ids == ref[2][0][0]
    assert 0 < Nothing.calls <= 20 // PROBE_EVERY + 2
    no_leak(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rejected_drafts_back_off_and_output_is_unchanged(ckpts, async_scheduling):
    """Drafts that are never accepted: with backoff (the default) a request sits out 1, 2, 4,
    8, 8, ... proposal rounds after each verification that accepted nothing, so 40 tokens
    take 7 verifications instead of 40; without it every step verifies. Output unchanged."""
    batch = repeating_prompts(8, count=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, ref = run(ckpts["llama"], batch, params, num_kv_blocks=64)

    class Wrong:        # drafts this model's greedy run never picks (checked below)
        def propose(self, token_ids, k):
            return [VOCAB - 1 - (token_ids[-1] % 2)] * k

    counts = {}
    for backoff in (True, False):
        llm = LLM(ckpts["llama"], dtype="float32", num_kv_blocks=64,
                  async_scheduling=async_scheduling,
                  speculative_config=dict(NGRAM, backoff=backoff))
        llm.engine.drafter.proposer = Wrong()
        got = [[(o.token_ids, o.finish_reason) for o in r.outputs]
               for r in llm.generate(batch, params)]
        assert got == ref
        st = llm.engine.drafter.stats
        assert st.num_accepted_tokens == 0 or not backoff
        counts[backoff] = st.num_drafts
        no_leak(llm)
    # each verification gives one token (none accepted): 40 tokens, 1 + 1 + 2 + 4 + 8 + 8 + 8
    # rounds sat out after the first 6 misses (the first token comes from the prefill). Async
    # scheduling (the GPU's default) gave 34 before a round without any request able to take
    # drafts (the prefill) stopped counting as one that found none.
    assert counts[False] >= 35 and counts[True] <= 8, counts


def test_disable_by_batch_size_turns_drafts_off(ckpts):
    batch = repeating_prompts(6, count=4)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 8, 24, 24)]
    _, ref = run(ckpts["llama"], batch, params, num_kv_blocks=96)
    # up to 2 requests in the engine: drafts; 3 or more: none (the tail of the run speculates)
    llm, got = run(ckpts["llama"], batch, params, dict(NGRAM, disable_by_batch_size=3),
                   num_kv_blocks=96)
    assert got == ref
    assert llm.engine.drafter.stats.num_drafts > 0
    llm, _ = run(ckpts["llama"], batch, params, dict(NGRAM, disable_by_batch_size=1),
                 num_kv_blocks=96)
    assert llm.engine.drafter.stats.num_drafts == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_tokens_follow_the_same_law_with_and_without_drafts(tmp_path, async_scheduling):
    """On an 8-token vocabulary, 300 unseeded samples of a request's third and fourth tokens
    with drafts (a draft model with the target's weights: its greedy drafts are accepted about
    half the time at temperature 1) against 300 without: two-sample chi-squares below their
    99.9% quantile (7 degrees of freedom: 24.32). Each engine's seed is fixed: no flakes."""
    make_hf_checkpoint("llama", tmp_path, seed=3, std=0.3, vocab_size=8)
    prompt = {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    counts = []
    for spec in (None, {"method": "draft_model", "model": str(tmp_path),
                        "num_speculative_tokens": 2}):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=256, seed=1, max_num_seqs=300,
                  speculative_config=spec, async_scheduling=async_scheduling)
        outs = llm.generate([prompt] * 300, params)
        no_leak(llm)
        c = [[0] * 8, [0] * 8]
        for r in outs:
            c[0][r.outputs[0].token_ids[2]] += 1
            c[1][r.outputs[0].token_ids[3]] += 1
        counts.append(c)
    st = llm.engine.drafter.stats       # async: no drafts at all on the GPU before the fix
    assert st.acceptance_rate is not None
    assert 0.2 < st.acceptance_rate < 0.8 and st.accepted_per_pos[1] > 50
    for a, b in zip(*counts):
        stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)
        assert stat < 24.32, (a, b)
