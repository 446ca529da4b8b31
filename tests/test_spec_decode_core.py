"""Speculative decoding without a model: the config's checks, the n-gram proposer, the
scheduler's draft slots and their rollback, and the rejection sampler's distribution."""
import math
from types import SimpleNamespace

import pytest
import torch

from pagedbackend.config import EngineConfig
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.core.request import Request
from pagedbackend.core.scheduler import Scheduler
from pagedbackend.layers.sampling_metadata import SamplingMetadata
from pagedbackend.sampling_params import SamplingParams
from pagedbackend.spec_decode.config import SpeculativeConfig
from pagedbackend.spec_decode.ngram import NgramProposer
from pagedbackend.spec_decode.verify import rejection_sample


# -- config --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, match", [
    ({"num_speculative_tokens": 0}, r"speculative_config.num_speculative_tokens=0 is invalid: "
                                    r"must be an integer in \[1, 16\]"),
    ({"num_speculative_tokens": 100}, r"num_speculative_tokens=100 is invalid"),
    ({"method": "eagle"}, r"speculative_config.method='eagle' is invalid: must be one of"),
    ({"method": "draft_model"}, r"speculative_config.model=None is invalid: must be the draft"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min=4 is invalid: "
                                                       r"must be <= prompt_lookup_max=2"),
    ({"prompt_lookup_max": 0}, r"prompt_lookup_max=0 is invalid"),
    ({"disable_by_batch_size": 0}, r"disable_by_batch_size=0 is invalid"),
    ({"backoff": "yes"}, r"speculative_config.backoff='yes' is invalid: must be true or false"),
    ({"n_predict": 5}, r"speculative_config.n_predict is invalid: must be one of"),
    ("{not json", r"speculative_config='\{not json' is invalid: must be a JSON object"),
    (5, r"speculative_config=5 is invalid: must be a dict"),
])
def test_bad_speculative_config_names_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", speculative_config=value)


def test_speculative_config_defaults_json_and_tp():
    c = EngineConfig(model="m", speculative_config='{"num_speculative_tokens": 3, '
                                                   '"prompt_lookup_max": 4}').speculative_config
    assert c == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=4,
                                  prompt_lookup_max=4)
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    with pytest.raises(ValueError, match=r"^speculative_config=.* is invalid: must be None with "
                                         r"tensor_parallel_size > 1"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config={})


def test_ngram_takes_the_longest_latest_match():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert p.propose([9, 2, 3, 8, 1, 2, 3, 7, 2, 3], 2) == [7, 2]   # latest of the 2-gram
    assert p.propose([1, 2, 3, 4], 3) == []
    # the match is 3 tokens back: its continuation runs into the end and repeats with period 3
    assert p.propose([5, 1, 2, 5], 5) == [1, 2, 5, 1, 2]
    assert p.propose([7, 7, 7], 4) == [7, 7, 7, 7]                 # a token repeated
    assert NgramProposer(2, 2).propose([3, 4, 9, 4], 2) == []       # 1-gram hits not wanted


def test_ngram_matches_a_brute_force_search():
    import random

    def brute(ids, k, lo, hi):
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            for s in range(len(ids) - n - 1, -1, -1):
                if ids[s:s + n] == ids[-n:]:
                    text = list(ids)        # copy token by token: past the end, the copy's own
                    for i in range(k):      # tokens
                        text.append(text[s + n + i])
                    return text[len(ids):]
        return []
    rng = random.Random(0)
    for _ in range(500):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 5)
        assert NgramProposer(lo, hi).propose(ids, k) == brute(ids, k, lo, hi), (ids, k, lo, hi)


# -- scheduler -----------------------------------------------------------------------------
def make(num_blocks=8, budget=64, block_size=4, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return kv, Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget)


def request(rid="a", prompt=(1, 2, 3, 4, 5, 6), max_tokens=20):
    p = SimpleNamespace(min_tokens=0, ignore_eos=False, stop_token_ids=[50])
    return Request(rid, prompt, p, max_tokens=max_tokens, eos_token_ids=[0])


def step(sched, sampled, accepted=None):
    out = sched.schedule()
    sched.on_launched(out)
    return out, sched.update_from_output(out, sampled, accepted or {})


def test_drafts_take_slots_and_rejected_ones_are_rolled_back():
    kv, sched = make()
    req = request()
    sched.add_request(req)
    step(sched, {"a": 7})                        # prefill: 6 tokens + 7
    req.spec_token_ids = [8, 9, 10]
    out = sched.schedule()
    s, = out.scheduled
    assert (s.num_new_tokens, s.spec_token_ids, s.samples) == (4, [8, 9, 10], True)
    assert len(s.block_ids) == 3                 # positions 6..9 reach the third block
    sched.on_launched(out)
    sched.update_from_output(out, {"a": 11}, {"a": [8]})    # 8 accepted, then 11
    assert req.output_token_ids == [7, 8, 11]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    assert len(kv.block_ids("a")) == 2           # the rejected drafts' block went back
    # only verified tokens are in the prefix cache
    assert kv.num_cached_blocks["a"] * 4 <= req.num_tokens
    kv.check_invariants()
    sched.finish_requests(["a"], req.status.FINISHED_ABORTED)
    kv.check_invariants(idle=True)


def test_drafts_fit_the_budget_and_give_way_before_preemption():
    kv, sched = make(budget=3)
    req = request()
    sched.add_request(req)
    step(sched, {})                              # 3 of the 6 prompt tokens
    step(sched, {"a": 7})
    req.spec_token_ids = [8, 9, 10]
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [8, 9]         # 1 + 2 drafts = the budget
    sched.on_launched(out)
    sched.update_from_output(out, {"a": 12}, {"a": [8, 9]})
    assert req.output_token_ids == [7, 8, 9, 12] and req.num_computed_tokens == 9
    kv.check_invariants()
    # a pool with room for the known token only: the drafts go, nobody is preempted
    kv2, sched2 = make(num_blocks=3, budget=64)
    a, b = request("a", (1, 2, 3)), request("b", (4, 5, 6, 7, 8))
    for r in (a, b):
        sched2.add_request(r)
    step(sched2, {"a": 7, "b": 7})               # a: blocks 1, b: blocks 2 (pool full)
    a.spec_token_ids = [1, 2]
    out = sched2.schedule()
    assert not out.preempted_req_ids
    assert [(s.request.request_id, s.num_new_tokens, s.spec_token_ids)
            for s in out.scheduled] == [("a", 1, []), ("b", 1, [])]


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    kv, sched = make()
    req = request()
    sched.add_request(req)
    step(sched, {"a": 7})
    req.spec_token_ids = [50, 9]                 # 50 is a stop token id
    _, (progressed, finished) = step(sched, {"a": 3}, {"a": [50, 9]})
    assert finished == [req] and req.output_token_ids == [7, 50]
    kv.check_invariants(idle=True)


# -- rejection sampling --------------------------------------------------------------------
# 99.9% quantiles of chi-square with 5 and 3 degrees of freedom (a fixed seed: no flakes)
CHI2_999 = {5: 20.52, 3: 16.27}


def chi_square(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=None),
    SamplingParams(temperature=0.7, top_k=4, seed=None),
])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Rows verify drafts d0, d1 against logits at 3 positions: the first token must follow
    p0; given it accepted d0, the next must follow p1 (the target's law without drafts)."""
    torch.manual_seed(0)
    V, N = 6, 40000
    logits3 = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.2, 0.9],
                            [0.1, 1.2, 0.3, 0.0, -1.0, 0.4],
                            [0.0, 0.0, 0.7, 0.2, 0.1, -0.3]])
    d0, d1 = 1, 4
    logits = logits3.repeat(N, 1)
    drafts = torch.tensor([d0, d1, -1]).repeat(N)
    rows = torch.arange(N).repeat_interleave(3)
    pos = torch.arange(3).repeat(N)
    meta = SamplingMetadata.build([params] * (3 * N), [[1]] * (3 * N), [[]] * (3 * N),
                                  [None] * (3 * N), [[]] * (3 * N), V, torch.device("cpu"))
    out = rejection_sample(logits, meta, drafts, rows, pos, N, 3)

    def target(row):
        x = row / params.temperature
        if params.top_k > 0:
            x = x.masked_fill(x < x.topk(params.top_k).values[-1], -math.inf)
        return torch.softmax(x, -1).tolist()

    first = torch.bincount(out[:, 0], minlength=V).tolist()
    p0 = target(logits3[0])
    dof = sum(p > 0 for p in p0) - 1
    assert chi_square(first, p0) < CHI2_999[dof]
    acc = out[:, 0] == d0
    second = torch.bincount(out[acc, 1], minlength=V).tolist()
    p1 = target(logits3[1])
    assert chi_square(second, p1) < CHI2_999[sum(p > 0 for p in p1) - 1]
    # after a rejection the row ends (-1); a third token only after both drafts were taken
    assert (out[~acc, 1:] == -1).all()
    assert ((out[:, 2] >= 0) == (acc & (out[:, 1] == d1))).all()


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0],
                           [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0)
    meta = SamplingMetadata.build([params] * 5, [[1]] * 5, [[]] * 5, [None] * 5, [[]] * 5, 3,
                                  torch.device("cpu"))
    # row 0: drafts 1, 2 (argmax 1, 0: the second is rejected); row 1: draft 0 accepted + bonus
    out = rejection_sample(logits, meta, torch.tensor([1, 2, -1, 0, -1]),
                           torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1]), 2, 3)
    assert out.tolist() == [[1, 0, -1], [0, 1, -1]]


# -- metrics -------------------------------------------------------------------------------
def test_spec_decode_counters_publish_the_growth_of_the_engine_totals():
    from test_serving_metrics import FakeFamilies

    from pagedbackend.serving.metrics import ServingMetrics
    from pagedbackend.spec_decode.drafter import SpecDecodeStats

    fams = FakeFamilies()
    m = ServingMetrics(fams, "m", num_speculative_tokens=2)

    def snap(drafts, tokens, accepted, per_pos):
        return SimpleNamespace(num_running=1, num_waiting=0, kv_cache_usage=0.1,
                               num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                               spec_decode=SpecDecodeStats(drafts, tokens, accepted, per_pos))
    m.apply_batch([("stats", snap(3, 6, 4, [3, 1]))])
    m.apply_batch([("stats", snap(5, 10, 7, [5, 2]))])
    m.apply_batch([("stats", snap(5, 10, 7, [5, 2]))])          # nothing new: no calls

    def total(name, **labels):
        return fams.metrics[(name, tuple(sorted({"model_name": "m", **labels}.items())))].total
    assert total("vllm:spec_decode_num_drafts_total") == 5
    assert total("vllm:spec_decode_num_draft_tokens_total") == 10
    assert total("vllm:spec_decode_num_accepted_tokens_total") == 7
    assert [total("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(2)] == [5, 2]
    plain = FakeFamilies()
    ServingMetrics(plain, "m")
    assert not any("spec_decode" in name for name, _ in plain.metrics)


def test_backoff_doubles_the_rounds_sat_out_and_an_acceptance_ends_it():
    from pagedbackend.spec_decode.drafter import BACKOFF_MAX, Backoff
    b = Backoff()
    req, other = SimpleNamespace(request_id="a"), SimpleNamespace(request_id="a")
    sat = []
    for _ in range(6):          # six verifications in a row that accept nothing
        b.verified(req, 0)
        n = 0
        while b.sits_out(req):
            n += 1
        sat.append(n)
    assert sat == [1, 2, 4, 8, 8, 8] and BACKOFF_MAX == 8
    b.verified(req, 0)
    assert not b.sits_out(other)        # a new request reusing the id is not held back
    assert b.sits_out(req)
    b.verified(req, 2)                  # an accepted draft ends the backoff
    assert not b.sits_out(req)
