"""The host tier's bookkeeping without torch: swap on preemption, offload of evicted prefix blocks,
the copies each step hands the runner, checked against a fake device that applies them in the
runner's order and verifies every step reads only KV that was written (or copied) for it."""
import random
from types import SimpleNamespace

import pytest

from pagedbackend.config import EngineConfig
from pagedbackend.core.host_pool import HostBlockPool
from pagedbackend.core.host_tier import HostTier, PreemptionCost
from pagedbackend.core.kv_cache_manager import KVCacheManager
from pagedbackend.core.request import Request, RequestStatus
from pagedbackend.core.scheduler import Scheduler, SchedulerOutput

# swap anything longer than 6 tokens, recompute shorter ones
COST = PreemptionCost(prefill_s_per_token=1.0, attention_s_per_token2=0.0,
                      swap_s_per_token=0.5, swap_s_fixed=3.0)


def make_req(rid, prompt, max_tokens=4, t=0.0, salt=None, priority=0):
    params = SimpleNamespace(min_tokens=0, ignore_eos=True, stop_token_ids=[])
    return Request(rid, prompt, params, max_tokens=max_tokens, eos_token_ids=[0],
                   arrival_time=t, cache_salt=salt, priority=priority)


class FakeDevice:
    """KV as what produced it: slot content = (salt, the tokens up to and including it)."""

    def __init__(self, num_gpu, num_host, block_size):
        self.bs = block_size
        self.gpu = [[None] * block_size for _ in range(num_gpu)]
        self.host = [[None] * block_size for _ in range(num_host)]

    def run(self, out):
        for g, h in out.blocks_to_swap_out:
            self.host[h] = list(self.gpu[g])
        for g, h in out.blocks_to_swap_in:
            self.gpu[g] = list(self.host[h])
        for s in out.scheduled:                       # the forward writes its tokens first
            toks, salt = s.request.all_token_ids, s.request.cache_salt
            for p in range(s.start, s.start + s.num_new_tokens):
                self.gpu[s.block_ids[p // self.bs]][p % self.bs] = (salt, tuple(toks[:p + 1]))
        for s in out.scheduled:                       # then attends over its whole context
            toks, salt = s.request.all_token_ids, s.request.cache_salt
            for p in range(s.start + s.num_new_tokens):
                got = self.gpu[s.block_ids[p // self.bs]][p % self.bs]
                assert got == (salt, tuple(toks[:p + 1])), \
                    f"{s.request.request_id} read wrong KV at position {p}"


def make_sched(num_gpu=8, num_host=16, bs=2, mode="swap", budget=64, seqs=8, caching=True,
               policy="fcfs"):
    kv = KVCacheManager(num_gpu, bs, enable_caching=caching)
    tier = HostTier(kv, num_host, mode, COST)
    return (Scheduler(kv, seqs, budget, policy=policy, host_tier=tier),
            FakeDevice(num_gpu, num_host, bs))


def step(sched, dev, token=lambda req: 7):
    out = sched.schedule()
    dev.run(out)
    sched.on_launched(out)
    sampled = {s.request.request_id: token(s.request) for s in out.scheduled if s.samples}
    sched.update_from_output(out, sampled)
    check(sched)
    return out


def check(sched, idle=False):
    sched.kv.check_invariants(idle=idle)
    return sched.host.check_invariants({r.request_id for r in sched.swapped}, idle=idle)


def drain(sched, dev, limit=500):
    for _ in range(limit):
        if not sched.has_unfinished():
            break
        step(sched, dev)
    assert not sched.has_unfinished()
    check(sched, idle=True)


def test_swap_preemption_keeps_kv_and_resumes_without_recompute():
    sched, dev = make_sched(num_gpu=6, bs=2)
    sched.add_request(make_req("old", list(range(1, 7)), max_tokens=6, t=0))
    sched.add_request(make_req("new", list(range(10, 16)), max_tokens=6, t=1))
    step(sched, dev)                  # 3 blocks each: the pool is full
    out = step(sched, dev)            # "old" needs a 4th block: "new" is swapped out
    assert out.preempted_req_ids == ["new"]
    new = sched.requests["new"]
    assert new.status == RequestStatus.SWAPPED and new.num_computed_tokens == 6
    # its 3 blocks, then the offload of a cached block the allocation for "old" evicted
    assert [h for _, h in out.blocks_to_swap_out[:3]] == sched.host.host_blocks["new"]
    assert sched.num_swapped == 1 and sched.host.preemptions == {"swap": 1, "recompute": 0}
    while new.status == RequestStatus.SWAPPED:
        out = step(sched, dev)
    # back with its 6 computed tokens: one decode token, its blocks copied in, nothing recomputed
    assert [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled
            if s.request is new] == [("new", 6, 1)]
    assert len(out.blocks_to_swap_in) == 3
    drain(sched, dev)
    assert new.num_output_tokens == 6 and sched.host.num_swap_in_blocks == 3


def test_auto_recomputes_short_contexts_and_swaps_long_ones():
    assert not COST.prefers_swap(4) and COST.prefers_swap(12)
    kv = KVCacheManager(16, 2)
    tier = HostTier(kv, 16, "auto", COST)
    short, long = make_req("short", [1, 2, 3, 4]), make_req("long", list(range(1, 13)))
    for req in (short, long):
        kv.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
    assert not tier.swap_out(short) and kv.block_ids("short")      # untouched: recompute it
    assert tier.swap_out(long) and not kv.block_ids("long")
    assert len(tier.host_blocks["long"]) == 6 and tier.preemptions["swap"] == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
@pytest.mark.parametrize("seed", range(5))
def test_random_load_reads_only_written_kv(mode, seed, policy):
    """Shared prefixes, salts, priorities, a GPU pool of a few blocks, a small host tier,
    aborts at random: every step reads exactly the KV its tokens made, and no block of either
    tier leaks."""
    rng = random.Random(seed)
    sched, dev = make_sched(num_gpu=10, num_host=12, bs=2, mode=mode, budget=12, seqs=4,
                            policy=policy)
    shared = [rng.randrange(1, 50) for _ in range(8)]
    ids = iter(range(1000))
    for t in range(40):
        if rng.random() < 0.9:
            body = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))]
            prompt = shared[:rng.randrange(0, 9)] + body
            salt = rng.choice([None, None, "a"])
            sched.add_request(make_req(f"r{next(ids)}", prompt, rng.randrange(1, 6), t, salt,
                                       priority=rng.randrange(3)))
        if rng.random() < 0.1 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            check(sched)
        step(sched, dev, token=lambda req: rng.randrange(1, 50))
    drain(sched, dev)
    assert sched.num_preemptions > 0, "the pool was meant to force preemption"
    assert sched.host.prefix_hits > 0 and sched.host.num_swap_in_blocks > 0
    if mode == "swap":
        assert sched.host.preemptions["swap"] > 0


def test_evicted_prefix_is_offloaded_and_copied_back():
    sched, dev = make_sched(num_gpu=6, num_host=16, bs=2)
    prompt = list(range(1, 8))                       # 3 full blocks + 1 token
    sched.add_request(make_req("a", prompt, max_tokens=1))
    drain(sched, dev)
    for i in range(3):                               # evict a's blocks from the GPU pool
        sched.add_request(make_req(f"x{i}", [40 + i] * 9, max_tokens=1))
        drain(sched, dev)
    assert sched.kv.get_computed_blocks(make_req("probe", prompt))[1] == 0
    assert sched.host.pool.num_cached >= 3
    sched.add_request(make_req("b", prompt + [9], max_tokens=2))
    out = step(sched, dev)
    (s,) = out.scheduled
    assert s.start == 6 and s.num_new_tokens == 2   # 3 blocks from the host, 2 tokens computed
    assert len(out.blocks_to_swap_in) == 3
    assert sched.host.prefix_hits == 6 and s.request.num_cached_tokens == 6
    drain(sched, dev)


def test_salted_prefix_never_hits_across_salts_on_the_host():
    sched, dev = make_sched(num_gpu=6, num_host=16, bs=2)
    prompt = list(range(1, 8))
    sched.add_request(make_req("a", prompt, max_tokens=1, salt="tenant-1"))
    drain(sched, dev)
    for i in range(3):
        sched.add_request(make_req(f"x{i}", [40 + i] * 9, max_tokens=1))
        drain(sched, dev)
    for salt, hits in (("tenant-2", 0), (None, 0), ("tenant-1", 6)):
        sched.add_request(make_req(f"b-{salt}", prompt, max_tokens=1, salt=salt))
        before = sched.host.prefix_hits
        step(sched, dev)
        assert sched.host.prefix_hits - before == hits, salt
        drain(sched, dev)


def test_full_host_tier_falls_back_to_recompute():
    sched, dev = make_sched(num_gpu=6, num_host=2, bs=2)
    sched.add_request(make_req("old", list(range(1, 7)), max_tokens=6, t=0))
    sched.add_request(make_req("new", list(range(10, 16)), max_tokens=6, t=1))
    step(sched, dev)
    out = step(sched, dev)
    assert out.preempted_req_ids == ["new"] and "new" not in sched.host.host_blocks
    assert sched.requests["new"].status == RequestStatus.WAITING
    assert sched.host.preemptions == {"swap": 0, "recompute": 1}
    drain(sched, dev)


def test_abort_while_swapped_out_frees_both_tiers():
    sched, dev = make_sched(num_gpu=6, bs=2)
    sched.add_request(make_req("old", list(range(1, 7)), max_tokens=6, t=0))
    sched.add_request(make_req("new", list(range(10, 16)), max_tokens=6, t=1))
    step(sched, dev)
    step(sched, dev)
    assert sched.requests["new"].status == RequestStatus.SWAPPED
    sched.finish_requests(["new"], RequestStatus.FINISHED_ABORTED)
    assert sched.num_swapped == 0 and not sched.host.host_blocks
    check(sched)
    drain(sched, dev)
    check(sched, idle=True)


def test_abort_while_swapping_in_frees_both_tiers():
    sched, dev = make_sched(num_gpu=6, bs=2)
    sched.add_request(make_req("old", list(range(1, 7)), max_tokens=3, t=0))
    sched.add_request(make_req("new", list(range(10, 16)), max_tokens=6, t=1))
    step(sched, dev)
    step(sched, dev)
    while True:                        # the step that swaps "new" back in, before it runs
        out = sched.schedule()
        if out.blocks_to_swap_in:
            break
        dev.run(out)
        sched.on_launched(out)
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled})
    sched.finish_requests(["new"], RequestStatus.FINISHED_ABORTED)
    dev.run(out)                       # the copies still run (into blocks now free)
    check(sched)
    assert not sched.kv.block_ids("new")
    drain(sched, dev)
    check(sched, idle=True)


def test_swap_in_takes_blocks_the_gpu_prefix_cache_still_holds():
    kv = KVCacheManager(16, 2)
    tier = HostTier(kv, 16, "swap")
    req = make_req("a", [1, 2, 3, 4, 5], max_tokens=2)
    kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    gpu_before = kv.block_ids("a")
    assert tier.swap_out(req)
    assert len(tier._swap_out) == 3
    kv.pool.allocate(1)                 # evicts nothing of a's: the free queue has room
    copied = tier.swap_in(req, 1)
    # the two full blocks come back from the GPU prefix cache; the partial one is copied
    assert kv.block_ids("a")[:2] == gpu_before[:2] and copied == kv.block_ids("a")[2:3]
    assert tier._swap_in == [(copied[0], tier._held[2])]


def test_copies_of_a_step_that_runs_nothing_wait_for_the_next():
    kv = KVCacheManager(4, 2)
    tier = HostTier(kv, 4, "swap")
    req = make_req("a", [1, 2, 3], max_tokens=2)
    kv.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    assert tier.swap_out(req)
    empty = SchedulerOutput()
    tier.end_step(empty)
    assert not empty.blocks_to_swap_out
    tier.begin_step()
    nxt = SchedulerOutput(scheduled=[object()])
    tier.end_step(nxt)
    assert nxt.blocks_to_swap_out == list(zip([0, 1], tier.host_blocks["a"]))


def test_host_pool_lru_and_holds():
    pool = HostBlockPool(3)
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.free(a)
    assert pool.num_available == 3 and pool.num_cached == 2
    pool.touch(b"h0")                  # h1 is now the least recently used
    pool.hold([a[0]])
    assert pool.allocate(3) is None    # h0 is held
    got = pool.allocate(2)
    assert sorted(got) == [1, 2] and pool.lookup(b"h1") is None and pool.lookup(b"h0") == 0
    pool.free(got + [a[0]])
    assert pool.check_invariants() == {"free": 2, "cached": 1, "owned": 0, "total": 3}


def test_bad_settings_name_the_fields():
    with pytest.raises(ValueError, match=r"swap_space=-1 is invalid: must be a number of GiB"):
        EngineConfig(model="m", swap_space=-1)
    with pytest.raises(ValueError, match=r"swap_space=1000000 is invalid.*\[0, 4096\]"):
        EngineConfig(model="m", swap_space=1000000)
    with pytest.raises(ValueError, match=r"swap_space='4'"):
        EngineConfig(model="m", swap_space="4")
    with pytest.raises(ValueError, match=r"preemption_mode='swap' is invalid with swap_space=0"):
        EngineConfig(model="m", preemption_mode="swap")
    with pytest.raises(ValueError, match=r"preemption_mode='fast' is invalid"):
        EngineConfig(model="m", swap_space=1, preemption_mode="fast")
    assert EngineConfig(model="m", swap_space=2).resolved_preemption_mode == "auto"
    assert EngineConfig(model="m").resolved_preemption_mode == "recompute"
    assert EngineConfig(model="m", swap_space=0.5,
                        preemption_mode="recompute").resolved_preemption_mode == "recompute"
