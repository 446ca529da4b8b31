"""Allocator, prefix cache and scheduler, without torch: a handful of blocks and fake requests."""
import sys
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from pagedbackend.core.block_pool import BlockPool, hash_block
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.core.request import Request, RequestStatus
from pagedbackend.core.scheduler import Scheduler


def params(min_tokens=0, ignore_eos=False, stop_token_ids=()):
    return SimpleNamespace(min_tokens=min_tokens, ignore_eos=ignore_eos,
                           stop_token_ids=list(stop_token_ids))


def make_req(rid, prompt, max_tokens=4, t=0.0, priority=0, salt=None, **kw):
    return Request(rid, prompt, params(**kw), max_tokens=max_tokens, eos_token_ids=[0],
                   arrival_time=t, priority=priority, cache_salt=salt)


def run_step(sched, token=7):
    """Fake model: every request that samples gets `token` (never EOS unless asked)."""
    out = sched.schedule()
    sched.on_launched(out)
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    return out, sched.update_from_output(out, sampled)


def test_core_does_not_import_torch():
    import subprocess
    code = ("import sys, pagedbackend.core.scheduler, pagedbackend.core.kv_cache_manager;"
            "assert 'torch' not in sys.modules, 'core imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hash_is_chained_salted_and_stable():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6]) != hash_block(None, [5, 6])
    assert hash_block(None, [1, 2], salt="t1") != hash_block(None, [1, 2], salt="t2")
    assert len(a) == 32


def test_pool_lru_eviction_is_lazy():
    pool = BlockPool(3)
    b = pool.allocate(2)
    pool.cache_block(b[0], b"h0")
    pool.free(b)
    counts = pool.check_invariants()
    assert counts == {"free": 2, "cached_evictable": 1, "in_use": 0, "total": 3}
    assert pool.lookup(b"h0") == b[0]          # still reusable after free
    pool.allocate(2)                           # block 2, then b[0] (LRU head) evicted
    assert pool.lookup(b"h0") is None
    pool.check_invariants()


def test_prefix_hit_never_covers_last_token_and_respects_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r1 = make_req("a", list(range(1, 13)))         # 12 tokens = 3 full blocks
    assert kv.allocate_slots(r1, 12) is not None
    r2 = make_req("b", list(range(1, 13)))
    blocks, n = kv.get_computed_blocks(r2)
    assert n == 8 and blocks == kv.block_ids("a")[:2]   # last block would hold the last token
    r3 = make_req("c", list(range(1, 13)), salt="tenant")
    assert kv.get_computed_blocks(r3) == ([], 0)
    r4 = make_req("d", list(range(1, 10)) + [99, 98, 97])
    assert kv.get_computed_blocks(r4)[1] == 8
    kv.free(r1)
    kv.check_invariants(idle=True)


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r1 = make_req("a", list(range(1, 13)))
    assert kv.allocate_slots(r1, 12) is not None
    r2 = make_req("b", list(range(20, 32)))
    before = (list(kv.pool.ref_cnt), dict(kv.req_blocks))
    assert kv.allocate_slots(r2, 12) is None
    assert (kv.pool.ref_cnt, kv.req_blocks) == before
    kv.check_invariants()


def test_decode_first_and_token_budget_with_chunked_prefill():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    s.add_request(make_req("long", list(range(1, 26)), max_tokens=3))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 10)]
    s.add_request(make_req("short", [1, 2, 3], max_tokens=3, t=1.0))
    out, _ = run_step(s)
    # the running chunked prefill takes the whole budget; the newcomer waits
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("long", 10)]
    while s.has_unfinished():
        out, _ = run_step(s)
        assert out.num_scheduled_tokens <= 10
    kv.check_invariants(idle=True)


def test_budget_is_shared_and_requests_join_any_step():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    s.add_request(make_req("a", [1, 2, 3, 4], max_tokens=5))
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [4]
    s.add_request(make_req("b", [5, 6, 7, 8, 9, 10, 11], max_tokens=2, t=1))
    out, _ = run_step(s)
    # the running decode goes first (1 token), the newcomer's prefill takes the other 5
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 5)]
    assert not out.scheduled[1].samples
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 2)]
    assert out.scheduled[1].samples


def test_stop_rules_eos_min_tokens_stop_ids_length():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    s.add_request(make_req("eos", [1, 2], max_tokens=8))
    s.add_request(make_req("min", [1, 2], max_tokens=8, min_tokens=2))
    s.add_request(make_req("ign", [1, 2], max_tokens=3, ignore_eos=True))
    s.add_request(make_req("sid", [1, 2], max_tokens=8, stop_token_ids=[0, 5]))
    _, (_, fin) = run_step(s, token=0)
    assert {r.request_id for r in fin} == {"eos", "sid"}
    assert [r.status for r in fin] == [RequestStatus.FINISHED_STOPPED] * 2
    _, (_, fin) = run_step(s, token=0)
    assert {r.request_id for r in fin} == {"min"}
    _, (_, fin) = run_step(s, token=0)
    assert [(r.request_id, r.status) for r in fin] == [("ign", RequestStatus.FINISHED_LENGTH)]
    kv.check_invariants(idle=True)


def test_preemption_recomputes_newest_first_and_requeues_at_front():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    s.add_request(make_req("old", [1, 2, 3], max_tokens=6, t=0))
    s.add_request(make_req("new", [4, 5, 6], max_tokens=6, t=1))
    run_step(s)                      # both prefilled: 2 blocks each, pool full
    run_step(s)                      # 4th token still fits in 2 blocks
    out, _ = run_step(s)             # each needs a 3rd block for its 5th token -> preempt "new"
    assert out.preempted_req_ids == ["new"]
    assert [x.request.request_id for x in out.scheduled] == ["old"]
    assert s.num_preemptions == 1
    assert s.waiting.peek().request_id == "new" and s.requests["new"].num_computed_tokens == 0
    while s.has_unfinished():
        run_step(s)
    assert s.requests == {}
    kv.check_invariants(idle=True)


def test_priority_policy_orders_admission_and_preempts_lowest_priority():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    s.add_request(make_req("low", [1, 2], t=0, priority=5))
    s.add_request(make_req("high", [3, 4], t=1, priority=-1))
    s.add_request(make_req("high2", [3, 4], t=2, priority=-1))
    out, _ = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]
    assert [r.request_id for r in s.waiting] == ["high2", "low"]
    kv2 = KVCacheManager(num_blocks=4, block_size=2)
    s2 = Scheduler(kv2, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    s2.add_request(make_req("vip", [1, 2, 3], max_tokens=6, t=1, priority=0))
    s2.add_request(make_req("bulk", [4, 5, 6], max_tokens=6, t=0, priority=9))
    run_step(s2)
    run_step(s2)
    out, _ = run_step(s2)
    assert out.preempted_req_ids == ["bulk"]


def test_abort_frees_blocks_at_once():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    s.add_request(make_req("a", list(range(1, 10)), max_tokens=50))
    s.add_request(make_req("w", list(range(1, 10)), max_tokens=50))
    s.max_num_seqs = 1
    run_step(s)
    assert kv.pool.num_used_blocks > 0
    done = s.finish_requests(["a", "w", "missing"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["a", "w"]
    assert not s.has_unfinished()
    kv.check_invariants(idle=True)


def test_shared_prefix_is_computed_once():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(1, 17))
    s.add_request(make_req("a", prefix + [20], max_tokens=2))
    s.add_request(make_req("b", prefix + [21], max_tokens=2, t=1))
    out, _ = run_step(s)
    # b hits a's four blocks, registered when a was scheduled in this same step
    assert [x.num_new_tokens for x in out.scheduled] == [17, 1]
    assert kv.prefix_cache_hits == 16 and kv.prefix_cache_queries == 34


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]),
                         st.integers(1, 40), st.integers(1, 6), st.integers(0, 3)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 24), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(8, 48), policy=st.sampled_from(["fcfs", "priority"]),
       caching=st.booleans())
def test_random_add_step_abort_keeps_invariants(ops, num_blocks, block_size, budget, policy,
                                                caching):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, policy=policy)
    n = 0
    for op, length, max_tokens, prio in ops:
        if op == "add":
            # prompts share prefixes so the cache is exercised; must fit the pool alone
            length = min(length, (num_blocks * block_size) - max_tokens - 1)
            if length < 1:
                continue
            s.add_request(make_req(f"r{n}", [(i % 5) + 1 for i in range(length)],
                                   max_tokens=max_tokens, t=n, priority=prio))
            n += 1
        elif op == "step":
            out, _ = run_step(s, token=3)
            assert out.num_scheduled_tokens <= budget
            assert len(s.running) <= 4
        elif s.requests:
            s.finish_requests([sorted(s.requests)[length % len(s.requests)]],
                              RequestStatus.FINISHED_ABORTED)
        kv.check_invariants()
    for _ in range(2000):
        if not s.has_unfinished():
            break
        run_step(s, token=3)
    assert not s.has_unfinished(), "requests left unfinished: no progress"
    kv.check_invariants(idle=True)
