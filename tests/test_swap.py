"""The host KV tier end to end on the CPU (the host tier is just other memory there): swap on
preemption and offloaded prefixes give the same greedy tokens as a run without them, the
copies are bit-exact, aborts free both tiers, TP=2 swaps each rank's shard; block accounting is
checked after every step of every test."""
import random

import pytest
import torch

from pagedbackend import LLM, SamplingParams
from pagedbackend.testing import ARCHS, TINY_CONFIGS, make_hf_checkpoint

VOCAB = TINY_CONFIGS["llama"]["vocab_size"]
# A pool of 14 blocks of 4 tokens for many 20-40-token requests: heavy preemption.
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=14, max_num_batched_tokens=32,
              max_num_seqs=6, max_model_len=56)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GIB_PER_BLOCK = 2 * 2 * 4 * 2 * 16 * 4 / (1 << 30)      # tiny llama: 2 layers, 2 kv heads x 16


def prompts(seed=0, count=10):
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    return [{"prompt_token_ids": (shared if i % 2 else [])
             + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(12, 28))]}
            for i in range(count)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(f"swap-{arch}")
        make_hf_checkpoint(arch, path, std=0.15,
                           **({"num_key_value_heads": 2} if arch == "mistral" else {}))
        out[arch] = str(path)
    return out


def generate(llm, batch, params=GREEDY):
    """llm.generate, with both tiers' accounting checked after every step."""
    engine = llm.engine
    ids = [f"g{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch):
        engine.add_request(rid, p, params)
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        engine.check_invariants()
    counts = engine.check_invariants()
    assert counts["in_use"] == 0, counts
    return [tokens[r] for r in ids]


def swap_llm(path, swap_space=64 * GIB_PER_BLOCK, **kw):
    return LLM(path, **{**ENGINE, "swap_space": swap_space, **kw})


@pytest.mark.parametrize("arch", ARCHS)
def test_swap_gives_recompute_tokens_under_heavy_preemption(checkpoints, arch):
    batch = prompts(count=8)
    want = generate(LLM(checkpoints[arch], **ENGINE), batch)
    llm = swap_llm(checkpoints[arch], preemption_mode="swap")
    assert generate(llm, batch) == want
    st = llm.engine.stats()
    assert st.preemptions_swap > 0 and st.swap_in_blocks > 0 and st.num_swapped == 0
    assert st.preemptions_swap + st.preemptions_recompute == st.num_preemptions


def test_auto_and_async_scheduling_give_the_same_tokens(checkpoints, monkeypatch):
    """auto with a fixed cost per swap that makes the tiny model swap contexts of 24 tokens or
    more and recompute shorter ones: both kinds in one run, the same tokens. The CPU's rates
    stand in for the device's (on a GPU the tiny model would never swap)."""
    from pagedbackend.worker import host_kv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setitem(host_kv.RATES, device, {**host_kv.RATES["cpu"], "fixed_s": 2.8e-5})
    batch = prompts(1, count=8)
    want = generate(LLM(checkpoints["llama"], **ENGINE), batch)
    for kw in (dict(preemption_mode="auto"), dict(preemption_mode="swap", async_scheduling=True)):
        llm = swap_llm(checkpoints["llama"], **kw)
        cost = llm.engine.scheduler.host.cost
        assert not cost.prefers_swap(23) and cost.prefers_swap(24)
        assert generate(llm, batch) == want, kw
        st = llm.engine.stats()
        assert st.preemptions_swap > 0, kw
        if kw["preemption_mode"] == "auto":
            assert st.preemptions_recompute > 0


def test_swapped_kv_equals_the_original_bit_for_bit(checkpoints):
    """Every copy of every step, out and back in, moves the block's bytes unchanged."""
    llm = swap_llm(checkpoints["qwen3"], preemption_mode="swap")
    tier = llm.engine.runner.host_kv
    swap, checked = tier.swap, {"out": 0, "in": 0}

    def checked_swap(swap_out, swap_in):
        dev = tier.device_blocks
        sources = {g: dev[g].to("cpu", copy=True) for g, _ in swap_out}    # on the host
        swap(swap_out, swap_in)
        if dev.is_cuda:
            torch.cuda.synchronize()            # the copies run on a side stream
        for g, h in swap_out:
            assert torch.equal(tier.host[h], sources[g]), ("out", g, h)
        for g, h in swap_in:
            assert torch.equal(dev[g].cpu(), tier.host[h]), ("in", g, h)
        checked["out"] += len(swap_out)
        checked["in"] += len(swap_in)

    tier.swap = checked_swap
    want = generate(LLM(checkpoints["qwen3"], **ENGINE), prompts(2, count=7))
    assert generate(llm, prompts(2, count=7)) == want
    assert checked["out"] > 0 and checked["in"] > 0, checked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_copies_are_bit_exact_and_ordered_after_earlier_writes(dtype):
    """HostKVCache alone, on the GPU when there is one: a step's copies, out then in, with host
    blocks in runs and not, chunked through a staging buffer smaller than the step; a write
    queued on the compute stream before the swap-out is what the host gets."""
    from pagedbackend.worker.host_kv import HostKVCache
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = torch.randn(2, 3, 12, 4, 2, 6, device=device).to(dtype)   # 12 blocks
    raw = cache.view(torch.uint8).permute(2, 0, 1, 3, 4, 5)
    staging = torch.empty((3, *raw.shape[1:]), dtype=torch.uint8, device=device)
    tier = HostKVCache(cache, 10, staging, 0.001)
    raw = tier.device_blocks                # [blocks, 2, layers, ...] of wide integers
    assert raw.dtype == (torch.int32 if dtype == torch.bfloat16 else torch.int64)
    try:
        cache[:, :, 5].fill_(7.0)           # queued before the swap-out that reads block 5
        want = raw.clone()
        out = [(5, 2), (0, 3), (7, 4), (3, 9), (11, 0)]
        tier.swap(out, [])
        back = [(1, 2), (2, 3), (4, 4), (6, 9), (8, 0)]       # into other GPU blocks
        tier.swap([(9, 6)], back)            # one more out, then the ins, in one step
        if device == "cuda":
            torch.cuda.synchronize()
        for g, h in out:
            assert torch.equal(tier.host[h], want[g].cpu()), (g, h)
        for (g, h), (src, _) in zip(back, out):
            assert torch.equal(raw[g], want[src]), (g, src)
        assert torch.equal(tier.host[6], want[9].cpu())
    finally:
        tier.close()


def test_offloaded_prefix_hit_equals_a_cold_run_and_counts(checkpoints):
    path = checkpoints["llama"]
    rng = random.Random(5)
    doc = [rng.randrange(1, VOCAB) for _ in range(30)]
    question = {"prompt_token_ids": doc + [7, 8, 9]}
    cold = generate(LLM(path, **ENGINE), [question])
    llm = swap_llm(path)
    generate(llm, [{"prompt_token_ids": doc + [1]}])
    # other prompts push the document's blocks out of the GPU pool (to the host)
    generate(llm, [{"prompt_token_ids": [rng.randrange(1, VOCAB) for _ in range(40)]}
                   for _ in range(2)])
    st0 = llm.engine.stats()
    assert st0.swap_out_blocks >= 7
    assert generate(llm, [question]) == cold
    st = llm.engine.stats()
    assert st.cpu_prefix_cache_hits - st0.cpu_prefix_cache_hits == 28     # 7 blocks of 4
    assert st.prefix_cache_hits == st0.prefix_cache_hits                  # none on the GPU


def test_salted_prefix_never_hits_across_salts(checkpoints):
    path = checkpoints["llama"]
    rng = random.Random(6)
    doc = {"prompt_token_ids": [rng.randrange(1, VOCAB) for _ in range(30)]}
    llm = swap_llm(path, swap_space=256 * GIB_PER_BLOCK)
    engine = llm.engine
    one = GREEDY.clone(max_tokens=1)

    def run(salt):
        """The document's host hits with this salt, then it is pushed out of the GPU pool."""
        before = engine.stats().cpu_prefix_cache_hits
        engine.add_request("r", doc, one, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
        hits = engine.stats().cpu_prefix_cache_hits - before
        for i in range(2):
            engine.add_request(f"x{i}", [rng.randrange(1, VOCAB) for _ in range(40)], one)
        while engine.has_unfinished():
            engine.step()
        return hits

    assert [run(salt) for salt in ("alice", "bob", None, "alice", "bob")] == [0, 0, 0, 28, 28]


def test_abort_while_swapped_out_and_while_swapping_in(checkpoints):
    """Async scheduling: the step that swaps a request back in is still in flight when it is
    aborted."""
    llm = swap_llm(checkpoints["llama"], preemption_mode="swap", async_scheduling=True)
    engine = llm.engine
    sched = engine.scheduler
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, GREEDY)
    aborted = {}
    while engine.has_unfinished():
        swapped = {r.request_id for r in sched.swapped}
        engine.step()
        back = [r.request_id for r in sched.running if r.request_id in swapped]
        if back and "in" not in aborted:
            aborted["in"] = back[0]
            engine.abort(back[0])
        elif sched.num_swapped and "out" not in aborted:
            aborted["out"] = next(iter(sched.swapped)).request_id
            engine.abort(aborted["out"])
            assert aborted["out"] not in sched.host.host_blocks
        engine.check_invariants()
    assert set(aborted) == {"out", "in"}
    counts = engine.check_invariants()
    assert counts["in_use"] == 0 and not sched.host.host_blocks


def test_full_host_tier_falls_back_to_recompute(checkpoints):
    batch = prompts(4)
    want = generate(LLM(checkpoints["llama"], **ENGINE), batch)
    llm = swap_llm(checkpoints["llama"], swap_space=4 * GIB_PER_BLOCK, preemption_mode="swap")
    assert generate(llm, batch) == want
    st = llm.engine.stats()
    assert st.num_host_blocks == 4 and st.preemptions_recompute > 0


def test_tp2_swaps_each_ranks_shard_and_matches_tp1(checkpoints):
    """Each rank copies its own KV heads: two ranks with swap give one rank's tokens."""
    batch = prompts(5, count=8)
    want = generate(LLM(checkpoints["qwen2"], **ENGINE), batch)
    llm = swap_llm(checkpoints["qwen2"], preemption_mode="swap", tensor_parallel_size=2)
    try:
        assert llm.engine.runner.num_host_blocks == 2 * 64     # half the heads: twice the blocks
        assert generate(llm, batch) == want
        st = llm.engine.stats()
        assert st.preemptions_swap > 0 and st.swap_in_blocks > 0
    finally:
        llm.engine.shutdown()


def test_host_tier_metrics_are_published_in_vllm_names(checkpoints):
    from test_serving_metrics import FakeFamilies

    from pagedbackend.serving.metrics import ServingMetrics, cache_config_labels
    llm = swap_llm(checkpoints["llama"], preemption_mode="swap")
    generate(llm, prompts(6, count=8))
    engine = llm.engine
    fams = FakeFamilies()
    labels = cache_config_labels(engine)
    assert labels["swap_space"] == str(engine.config.swap_space)
    assert labels["num_cpu_blocks"] == "64"
    m = ServingMetrics(fams, "m", cache_config=labels)
    m.apply_batch([("stats", engine.stats())])
    st = engine.stats()
    get = lambda name, **kw: fams.metrics[(name, tuple(sorted({"model_name": "m", **kw}.items())))]
    assert get("vllm:swap_out_blocks_total").total == st.swap_out_blocks > 0
    assert get("vllm:swap_in_blocks_total").total == st.swap_in_blocks > 0
    assert get("vllm:num_preemptions_by_mode_total", preemption_mode="swap").total \
        == st.preemptions_swap > 0
    assert get("vllm:num_preemptions_by_mode_total", preemption_mode="recompute").total \
        == st.preemptions_recompute
    assert get("vllm:cpu_prefix_cache_queries_total").total == st.cpu_prefix_cache_queries
    assert get("vllm:cpu_prefix_cache_hits_total").total == st.cpu_prefix_cache_hits
    assert get("vllm:num_requests_swapped").value == 0
    assert get("vllm:cpu_cache_usage_perc").value == st.cpu_cache_usage == 0.0


def test_bad_swap_settings_are_refused(checkpoints):
    path = checkpoints["llama"]
    with pytest.raises(ValueError, match=r"swap_space=-2 is invalid"):
        LLM(path, **ENGINE, swap_space=-2)
    with pytest.raises(ValueError, match=r"swap_space=5000 is invalid"):
        LLM(path, **ENGINE, swap_space=5000)
    with pytest.raises(ValueError, match=r"preemption_mode='swap' is invalid with swap_space=0"):
        LLM(path, **ENGINE, preemption_mode="swap")
    with pytest.raises(ValueError, match=r"swap_space=1e-09 is invalid: must be 0 or enough"):
        LLM(path, **ENGINE, swap_space=1e-9)
    with pytest.raises(ValueError, match=r"swap_space=3000 is invalid: must be at most"):
        LLM(path, **ENGINE, swap_space=3000)        # more than this host can hold


def test_settings_reach_the_engine_model_and_serve_flags():
    from pathlib import Path

    from pagedbackend.serving.launcher import ENGINE_PARAMETERS, env_overrides
    from pagedbackend.serving.settings import engine_config, parameters_of
    cfg = engine_config({"model": "x", "swap_space": "32", "preemption_mode": "swap"}, Path("/"))
    assert (cfg.swap_space, cfg.preemption_mode) == (32.0, "swap")
    shipped = (Path(__file__).parents[1] / "model_repository/engine/config.pbtxt").read_text()
    assert 'key: "swap_space" value: { string_value: "0" }' in shipped
    assert 'key: "preemption_mode" value: { string_value: "" }' in shipped
    cfg = engine_config(parameters_of({"parameters": {
        "model": {"string_value": "x"}, "swap_space": {"string_value": "0"},
        "preemption_mode": {"string_value": ""}}}), Path("/"))
    assert cfg.resolved_preemption_mode == "recompute"
    with pytest.raises(ValueError, match=r"^parameter swap_space='lots' is invalid: must be a "):
        engine_config({"model": "x", "swap_space": "lots"}, Path("/"))
    with pytest.raises(ValueError, match=r"^preemption_mode='swap' is invalid with swap_space=0"):
        engine_config({"model": "x", "preemption_mode": "swap"}, Path("/"))
    assert {"swap_space", "preemption_mode"} <= set(ENGINE_PARAMETERS)
    assert env_overrides({"PAGEDBACKEND_SWAP_SPACE": "16"}) == {"swap_space": "16"}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_swapped_requests_gives_the_plain_tokens(checkpoints, method):
    """Speculative decoding over a pool that forces swaps: the drafts' reserved slots, their
    rollback and the verification's KV all go through swap out / in, and the greedy tokens
    are the plain engine's (no drafts, no host tier); both tiers' blocks balance every step."""
    path = checkpoints["llama"]
    rng = random.Random(7)
    batch = []
    for i in range(8):      # a phrase said twice: the n-gram proposer finds continuations
        phrase = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(6, 12))]
        batch.append({"prompt_token_ids": phrase + phrase})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = generate(LLM(path, **ENGINE), batch, params)
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"model": path} if method == "draft_model"
                else {"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    llm = swap_llm(path, preemption_mode="swap", speculative_config=spec)
    assert generate(llm, batch, params) == want
    st = llm.engine.stats()
    assert st.preemptions_swap > 0 and st.swap_in_blocks > 0 and st.num_swapped == 0
    drafts = llm.engine.drafter.stats
    assert drafts.num_drafts > 0 and drafts.num_accepted_tokens > 0
