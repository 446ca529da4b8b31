"""Parity of the triton kernels with their plain-PyTorch references, on fresh random inputs.

Without CUDA the kernels run under TRITON_INTERPRET=1 at tiny shapes; with CUDA the same tests
run at llama-3.1-8b attention shapes (head_dim 128, block 16, GQA 4, contexts up to 4k, bf16).
"""
import importlib
import os

import pytest
import torch

from kernel_env import CUDA, DEV  # before any kernel module: sets TRITON_INTERPRET
pytest.importorskip("triton")

kernels = importlib.import_module("pagedbackend.kernels")
from pagedbackend.layers import activation as torch_act  # noqa: E402
from pagedbackend.layers import norm as torch_norm  # noqa: E402
from pagedbackend.layers import rotary as torch_rotary  # noqa: E402
from pagedbackend.kernels.testing import random_paged_batch  # noqa: E402
from pagedbackend.layers.attention import paged_attention_ref, write_kv_cache  # noqa: E402

# (q heads, kv heads, head_dim): CPU shapes stay tiny, the interpreter runs programs one by one.
if CUDA:
    SHAPES = {1: (8, 8, 128), 2: (16, 8, 128), 4: (32, 8, 128)}
    SMALL_TILES = None
else:
    SHAPES = {1: (2, 2, 64), 2: (4, 2, 64), 4: (4, 1, 128)}
    SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
# The CPU interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), which alone costs up to
# one bf16 ulp per stored element; on CUDA the elementwise kernels must match almost exactly.
EXACTISH = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 3e-3 if CUDA else 1e-2}


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in kernel output"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if os.environ.get("KERNEL_TEST_VERBOSE"):
        print(f"rel_err={err:.2e}")
    return err


def make_batch(query_lens, seq_lens, block_size, hq, hkv, d, dtype, spare_blocks=3, pad=0):
    return random_paged_batch(query_lens, seq_lens, block_size, hq, hkv, d, dtype, DEV,
                              spare_blocks, pad)


def check_backend(backend, query_lens, seq_lens, block_size, group, dtype, pad=0):
    hq, hkv, d = SHAPES[group]
    q, k, v, kc, vc, meta = make_batch(query_lens, seq_lens, block_size, hq, hkv, d, dtype,
                                       pad=pad)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache(k, v, kc_ref, vc_ref, meta.slot_mapping)
    n = sum(query_lens)
    ref = paged_attention_ref(q[:n], kc_ref, vc_ref, meta, d ** -0.5)
    out = backend.forward(q, k, v, kc, vc, meta, d ** -0.5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "KV cache write differs"
    assert out.shape == q.shape
    assert rel_err(out[:n], ref) < REL_TOL[dtype]
    if pad:
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    # The raw kernels again, into NaN-poisoned outputs: every real row must be written.
    poisoned = torch.full_like(q, float("nan"))
    if meta.max_query_len == 1:
        splits = backend.num_splits or 1
        b = len(seq_lens)
        kernels.paged_decode_attention(
            q[:b], kc, vc, meta.block_tables, meta.seq_lens, d ** -0.5, poisoned[:b], splits,
            torch.empty(b * hq * splits * d, device=DEV), torch.empty(b * hq * splits, device=DEV),
            backend.decode_config)
    else:
        kernels.paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, d ** -0.5, poisoned,
                                        backend.prefill_config)
    assert rel_err(poisoned[:n], ref) < REL_TOL[dtype]
    if meta.max_query_len > 1:
        # given the step's keys and values, the prefill kernel reads them from k / v: their
        # copies in the cache are NaN here and must not be touched
        kc_nan, vc_nan = kc.clone(), vc.clone()
        slots = meta.slot_mapping[meta.slot_mapping >= 0]
        kc_nan.view(-1, hkv, d)[slots] = float("nan")
        vc_nan.view(-1, hkv, d)[slots] = float("nan")
        poisoned = torch.full_like(q, float("nan"))
        kernels.paged_prefill_attention(q, kc_nan, vc_nan, meta.block_tables, meta.seq_lens,
                                        meta.query_start_loc, d ** -0.5, poisoned,
                                        backend.prefill_config, k_new=k, v_new=v)
        assert rel_err(poisoned[:n], ref) < REL_TOL[dtype]


# ---------------------------------------------------------------------------------- KV write

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_cache_skips_padding_slots(dtype):
    hq, hkv, d = SHAPES[2]
    q, k, v, kc, vc, meta = make_batch([3, 1], [7, 5], 4, hq, hkv, d, dtype, pad=2)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache(k, v, kc_ref, vc_ref, meta.slot_mapping)
    kernels.store_kv_cache(k, v, kc, vc, meta.slot_mapping)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


# ----------------------------------------------------------------------------------- decode

if CUDA:
    DECODE_CASES = [  # (group, block, seq_lens, splits)
        (4, 16, [4096, 17, 1000, 2048], None), (4, 16, [1, 300, 4096], 8),
        (2, 16, [513] * 8, 4), (1, 4, [100, 2049], None), (4, 4, [333] * 64, None)]
else:
    DECODE_CASES = [(1, 4, [9, 1], 1), (2, 16, [70, 33], 1), (4, 4, [45, 3], 3),
                    (2, 4, [130, 5, 64], 4), (4, 16, [200], 2)]


@pytest.mark.parametrize("group,block_size,seq_lens,splits", DECODE_CASES)
def test_decode_matches_reference(group, block_size, seq_lens, splits):
    cfg = None if CUDA else dict(BLOCK_N=16, num_warps=4, num_stages=1)
    backend = kernels.TritonAttentionBackend(num_splits=splits, decode_config=cfg)
    check_backend(backend, [1] * len(seq_lens), seq_lens, block_size, group, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_dtypes_and_padded_rows(dtype):
    # A padded decode batch row (seq_len 0, slot -1) must come out as zeros, not NaN.
    hq, hkv, d = SHAPES[2]
    q, k, v, kc, vc, meta = make_batch([1, 1, 1], [40, 7, 1], 4, hq, hkv, d, dtype)
    meta.seq_lens[2] = 0
    meta.slot_mapping[2] = -1
    meta.seq_lens_cpu[2] = 0
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache(k, v, kc_ref, vc_ref, meta.slot_mapping)
    ref = paged_attention_ref(q[:2], kc_ref, vc_ref, meta, d ** -0.5)
    kernels.store_kv_cache(k, v, kc, vc, meta.slot_mapping)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(
            q, kc, vc, meta.block_tables, meta.seq_lens, d ** -0.5, out, splits,
            torch.empty(3 * hq * splits * d, device=DEV), torch.empty(3 * hq * splits, device=DEV),
            None if CUDA else dict(BLOCK_N=16))
        assert rel_err(out[:2], ref) < REL_TOL[dtype]
        assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_longest_first_order_changes_no_output_bit(splits):
    # decode.LONGEST_FIRST only changes which programs the GPU starts first: the same bits must
    # come out, for a decode step and for the single-query rows of a mixed step.
    hq, hkv, d = SHAPES[2]
    cfg = None if CUDA else dict(BLOCK_N=16, num_warps=4, num_stages=1)
    scale = d ** -0.5
    for q_lens, s_lens, single_rows in (([1, 1, 1, 1], [9, 70, 1, 33], [0, 1, 2, 3]),
                                        ([1, 5, 1], [40, 12, 7], [0, 6])):
        b = len(s_lens)
        q, k, v, kc, vc, meta = make_batch(q_lens, s_lens, 4, hq, hkv, d, torch.bfloat16)
        kernels.store_kv_cache(k, v, kc, vc, meta.slot_mapping)
        order = meta.longest_first
        assert order.tolist() == sorted(range(b), key=lambda i: -s_lens[i])
        mixed = meta.query_start_loc if max(q_lens) > 1 else None
        outs = []
        for o in (None, order, order.to(torch.int32)):
            out = torch.full_like(q, float("nan"))
            kernels.paged_decode_attention(
                q, kc, vc, meta.block_tables, meta.seq_lens, scale, out, splits,
                torch.empty(b * hq * splits * d, device=DEV),
                torch.empty(b * hq * splits, device=DEV), cfg, mixed, order=o)
            outs.append(out[single_rows])
        assert not torch.isnan(outs[0]).any()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_with_rope_store_matches_rotary_store_then_decode(dtype):
    # The decode kernel's own rotary + KV write (rope_store) against rotary_store_kv followed
    # by the plain decode kernel: same caches, same output, q and k left as they were; a
    # padding row (slot -1) writes nothing. Splits 1 and 3 (the new token in the last split).
    from pagedbackend.kernels.rotary import rotary_store_kv
    hq, hkv, d = SHAPES[4]
    seq_lens = [37, 20, 1]
    q, k, v, kc, vc, meta = make_batch([1, 1, 1], seq_lens, 4, hq, hkv, d, dtype)
    meta.slot_mapping[2] = -1
    cache = torch_rotary.build_cos_sin_cache(d, 64, 10000.0, None, dtype, DEV)
    positions = torch.tensor([36, 19, 0], device=DEV)
    cfg = None if CUDA else dict(BLOCK_N=16, num_warps=4, num_stages=1)
    for splits in (1, 3):
        kc_ref, vc_ref, q_ref = kc.clone(), vc.clone(), q.clone()
        rotary_store_kv(q_ref, k, v, positions, cache, kc_ref, vc_ref, meta.slot_mapping)
        part = (torch.empty(3 * hq * splits * d, device=DEV), torch.empty(3 * hq * splits, device=DEV))
        ref = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(q_ref, kc_ref, vc_ref, meta.block_tables, meta.seq_lens,
                                       d ** -0.5, ref, splits, *part, cfg)
        kc_out, vc_out, q_in, k_in = kc.clone(), vc.clone(), q.clone(), k.clone()
        out = torch.full_like(q, float("nan"))
        kernels.paged_decode_attention(q_in, kc_out, vc_out, meta.block_tables, meta.seq_lens,
                                       d ** -0.5, out, splits, *part, cfg,
                                       rope_store=(k_in, v, positions, cache, meta.slot_mapping))
        assert torch.equal(q_in, q) and torch.equal(k_in, k)
        assert torch.equal(vc_out, vc_ref)
        assert rel_err(kc_out, kc_ref) < EXACTISH[dtype]
        assert rel_err(out, ref) < REL_TOL[dtype]


def test_num_splits_heuristic():
    assert kernels.choose_num_splits(256, 8, 2048, 132) == 1
    assert kernels.choose_num_splits(1, 8, 8192, 132) == 32
    assert kernels.choose_num_splits(1, 8, 100, 132) == 1
    assert kernels.choose_num_splits(1, 8, 2048, 132) == 16
    assert 1 < kernels.choose_num_splits(4, 8, 2048, 132) <= 9


@pytest.mark.parametrize("case", ["decode", "decode_split", "mixed", "rope_decode",
                                  "rope_mixed"])
def test_fp8_kv_cache_matches_torch_backend(case):
    """kv_cache_dtype fp8: every kernel that writes the cache (store_kv_cache, rotary_store_kv,
    the decode kernel's own rotary + write) stores e4m3, saturating at +-448, and the decode
    and prefill kernels widen it as they read. The caches against the PyTorch backend's (which
    rounds rotated k to the model's dtype first, and the interpreter rounds some ties the other
    way: an element may differ by one e4m3 step); the attention against the reference over the
    kernels' own caches (a saturated key makes the softmax too sharp to compare across caches
    that differ by a step)."""
    from pagedbackend.layers.attention import TorchAttentionBackend
    fp8 = torch.float8_e4m3fn
    hq, hkv, d = SHAPES[2]
    q_lens = [1, 1, 1] if "decode" in case else [6, 1, 9]
    seq_lens = [40, 9, 70]
    q, k, v, kc, vc, meta = make_batch(q_lens, seq_lens, 16, hq, hkv, d, torch.bfloat16)
    k[0, 0, :3] = torch.tensor([1000.0, -1000.0, 3.0])       # past e4m3's range: saturates
    v[1, 0, 0] = -5000.0
    kc, vc = (4 * kc).to(fp8), (4 * vc).to(fp8)
    rope = None
    if case.startswith("rope"):
        cache = torch_rotary.build_cos_sin_cache(d, 128, 10000.0, None, torch.bfloat16, DEV)
        rope = (torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens)]).to(DEV),
                cache)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q.clone(), k.clone(), v.clone(), kc_ref, vc_ref, meta,
                                          d ** -0.5, rope=rope)
    backend = kernels.TritonAttentionBackend(   # "decode": fp8's own tile (FP8_BLOCK_N)
        num_splits=3 if case == "decode_split" else None, prefill_config=SMALL_TILES,
        decode_config=None if CUDA or case == "decode" else dict(BLOCK_N=16, num_stages=1))
    q_rot = q if rope is None else torch_rotary.apply_rotary(q.clone(), k.clone(), *rope)[0]
    q_in = q.clone()
    out = backend.forward(q_in, k, v, kc, vc, meta, d ** -0.5, rope=rope)
    # the reference takes q as the kernels rotate it: a bf16 rounding apart is amplified past
    # the tolerance by the saturated key's sharp softmax (~12% of random batches failed with
    # torch's bf16 rotation): in place and rounded by rotary_store_kv (mixed), in fp32 inside
    # the decode kernel (decode)
    if case == "rope_mixed":
        q_rot = q_in
    elif case == "rope_decode":
        q_rot = torch_rotary.apply_rotary(q.float(), k.float(), rope[0],
                                          rope[1].float())[0]
    for c, c_ref in ((kc, kc_ref), (vc, vc_ref)):
        assert c.dtype == fp8 and not c.float().isnan().any()
        assert c.float().abs().max() == 448.0                # the saturated elements
        assert rel_err(c, c_ref) < 2e-2
    assert rel_err(out, paged_attention_ref(q_rot, kc, vc, meta, d ** -0.5)) < REL_TOL[q.dtype]
    assert out.shape == ref.shape and not ref.isnan().any()


# ---------------------------------------------------------------------------------- prefill

if CUDA:
    PREFILL_CASES = [  # (group, block, query_lens, seq_lens)
        (4, 16, [2048], [2048]), (4, 16, [300, 1, 1000, 1, 77], [300, 900, 4000, 17, 1101]),
        (2, 16, [129, 256], [1153, 256]), (1, 4, [64, 1, 200], [64, 64, 999])]
else:
    PREFILL_CASES = [(1, 4, [21, 1], [21, 9]), (2, 16, [5, 40], [37, 40]),
                     (4, 4, [1, 18, 3], [30, 50, 3]), (4, 16, [33], [33])]


@pytest.mark.parametrize("contig", [True, False], ids=["step-kv-from-k-v", "all-kv-from-cache"])
@pytest.mark.parametrize("group,block_size,query_lens,seq_lens", PREFILL_CASES)
def test_prefill_matches_reference(group, block_size, query_lens, seq_lens, contig, monkeypatch):
    # seq_len > q_len: a cached prefix; q_len 1 rows: the decode part of a mixed batch.
    backend_module = importlib.import_module("pagedbackend.kernels.backend")
    monkeypatch.setattr(kernels.prefill, "CONTIG_KV", contig)
    given, prefill = [], backend_module.paged_prefill_attention
    monkeypatch.setattr(backend_module, "paged_prefill_attention", lambda *a, **kw: (
        given.append(kw["k_new"] is not None), prefill(*a, **kw))[1])
    backend = kernels.TritonAttentionBackend(prefill_config=SMALL_TILES)
    check_backend(backend, query_lens, seq_lens, block_size, group, torch.bfloat16, pad=3)
    assert given == [contig]        # the backend handed the step's K/V over, or not


@pytest.mark.parametrize("dtype,tiles", [(torch.float32, None), (torch.float16, SMALL_TILES)])
def test_prefill_other_dtypes(dtype, tiles):
    # Mixed batch whose single-query rows go to the decode kernel with split-KV.
    backend = kernels.TritonAttentionBackend(num_splits=2, prefill_config=tiles,
                                             decode_config=None if CUDA else dict(BLOCK_N=16))
    check_backend(backend, [9, 1, 20, 1], [20, 40, 35, 1], 4, 2, dtype)


# ------------------------------------------------------------------------- CUDA graph decode

@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_decode_cuda_graph_replays_new_data():
    hq, hkv, d = SHAPES[4]
    backend = kernels.TritonAttentionBackend()
    q, k, v, kc, vc, meta = make_batch([1] * 4, [4000, 50, 1, 2048], 16, hq, hkv, d,
                                       torch.bfloat16)
    meta.max_seq_len = 4096                                    # capture for the longest context
    backend.forward(q, k, v, kc, vc, meta, d ** -0.5)          # warm-up: compile, scratch
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kc, vc, meta, d ** -0.5)
    # Next step: other lengths (within the same blocks), fresh values, written in place.
    new_lens = [3001, 17, 700, 1]
    for x in (q, k, v, kc, vc):
        x.copy_(torch.randn_like(x))
    bs = kc.shape[1]
    pos = torch.tensor(new_lens, device=DEV) - 1
    rows = torch.arange(4, device=DEV)
    meta.slot_mapping.copy_(meta.block_tables[rows, pos // bs].long() * bs + pos % bs)
    meta.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    meta.seq_lens_cpu = new_lens
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out.fill_(float("nan"))
    graph.replay()
    write_kv_cache(k, v, kc_ref, vc_ref, meta.slot_mapping)
    ref = paged_attention_ref(q, kc_ref, vc_ref, meta, d ** -0.5)
    assert torch.equal(kc, kc_ref)
    assert rel_err(out, ref) < REL_TOL[torch.bfloat16]


# ---------------------------------------------------------------------------- norm / rotary

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_reference(dtype):
    rows, n = (300, 4096) if CUDA else (5, 96)
    x = torch.randn(rows, n, device=DEV).to(dtype)
    res = torch.randn(rows, n, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device=DEV)).to(dtype)
    tol = EXACTISH[dtype]
    assert rel_err(kernels.rms_norm(x, w, 1e-6), torch_norm.rms_norm_torch(x, w, 1e-6)) < tol
    out, new_res = kernels.fused_add_rms_norm(x, res, w, 1e-5)
    ref, ref_res = torch_norm.fused_add_rms_norm_torch(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res) if CUDA or dtype != torch.bfloat16 \
        else rel_err(new_res, ref_res) < tol
    assert rel_err(out, ref) < tol
    # Qwen3's per-head q/k norm: a 3-D input normalized over its last dim.
    xh = torch.randn(7, 4, 32 if not CUDA else 128, device=DEV).to(dtype)
    wh = torch.rand(xh.shape[-1], device=DEV).to(dtype) + 0.5
    assert rel_err(kernels.rms_norm(xh, wh, 1e-6), torch_norm.rms_norm_torch(xh, wh, 1e-6)) < tol


def _rotary_ref_fp32(x, positions, cache):
    cos, sin = cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_matches_reference(dtype):
    t, hq, hkv, d = (500, 32, 8, 128) if CUDA else (6, 4, 2, 64)
    cache = torch_rotary.build_cos_sin_cache(d, 4096, 500000.0, None, dtype, DEV)
    positions = torch.randint(0, 4096, (t,), device=DEV)
    qkv = torch.randn(t, hq + 2 * hkv, d, device=DEV).to(dtype)
    q, k, _ = qkv.split([hq, hkv, hkv], dim=1)                      # strided views, as in models
    ref_q, ref_k = torch_rotary.apply_rotary_torch(q.clone(), k.clone(), positions, cache)
    exact_q, exact_k = _rotary_ref_fp32(q, positions, cache), _rotary_ref_fp32(k, positions, cache)
    out_q, out_k = kernels.apply_rotary(q, k, positions, cache)
    assert out_q.data_ptr() == q.data_ptr()                          # in place
    assert rel_err(out_q, exact_q) < EXACTISH[dtype]
    assert rel_err(out_k, exact_k) < EXACTISH[dtype]
    assert rel_err(out_q, ref_q) < REL_TOL[dtype] and rel_err(out_k, ref_k) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_store_kv_matches_rotary_then_store(dtype):
    from pagedbackend.kernels.rotary import rotary_store_kv
    hq, hkv, d = SHAPES[4]
    q, k, v, kc, vc, meta = make_batch([5, 1, 1], [37, 20, 3], 16, hq, hkv, d, dtype, pad=2)
    cache = torch_rotary.build_cos_sin_cache(d, 64, 10000.0, None, dtype, DEV)
    positions = torch.cat([torch.arange(32, 37), torch.tensor([19, 2]),
                           torch.randint(0, 64, (2,))]).to(DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    k_before = k.clone()
    ref_q, ref_k = _rotary_ref_fp32(q, positions, cache), _rotary_ref_fp32(k, positions, cache)
    write_kv_cache(ref_k.to(dtype), v, kc_ref, vc_ref, meta.slot_mapping)
    out_q = rotary_store_kv(q, k, v, positions, cache, kc, vc, meta.slot_mapping)
    assert out_q.data_ptr() == q.data_ptr() and rel_err(q, ref_q) < EXACTISH[dtype]
    assert torch.equal(k, k_before)                         # k is rotated into the cache only
    assert torch.equal(vc, vc_ref)                          # v copied, padding rows skipped
    assert rel_err(kc, kc_ref) < EXACTISH[dtype]
    assert not kc.isnan().any()
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=DEV)
    untouched[meta.slot_mapping[meta.slot_mapping >= 0]] = False
    assert torch.equal(kc.flatten(0, 1)[untouched], kc_ref.flatten(0, 1)[untouched])
    # rotate_k (the prefill kernel then reads the step's keys from k): k rotated in place too,
    # the same values as its cache copy; padding rows keep theirs (q is rotated once more here,
    # and not looked at)
    kc2, vc2 = kc_ref.clone().zero_(), vc_ref.clone().zero_()
    rotary_store_kv(q, k, v, positions, cache, kc2, vc2, meta.slot_mapping, rotate_k=True)
    real = meta.slot_mapping >= 0
    assert torch.equal(kc2.view(-1, hkv, d)[meta.slot_mapping[real]], k[real])
    assert rel_err(k[real], ref_k[real]) < EXACTISH[dtype]
    assert torch.equal(k[~real], k_before[~real])


@pytest.mark.parametrize("decode_only,in_kernel", [(False, True), (True, True), (True, False)])
def test_backend_rope_matches_torch_backend(decode_only, in_kernel, monkeypatch):
    """The model's call: rotary handed to the backend (fused into the KV write on triton; in a
    narrow decode step, into the decode attention kernel; in a wide one, rotary_store_kv)."""
    from pagedbackend.kernels import decode
    from pagedbackend.layers.attention import TorchAttentionBackend
    monkeypatch.setattr(decode, "ROPE_IN_DECODE", in_kernel)
    assert decode.rope_in_decode(2, 2, 4) == in_kernel and not decode.rope_in_decode(3, 2, 4)
    hq, hkv, d = SHAPES[2]
    dtype = torch.float32
    q_lens = [1, 1] if decode_only else [6, 1]
    q, k, v, kc, vc, meta = make_batch(q_lens, [40, 9], 16, hq, hkv, d, dtype)
    cache = torch_rotary.build_cos_sin_cache(d, 64, 10000.0, None, dtype, DEV)
    positions = torch.cat([torch.arange(40 - q_lens[0], 40), torch.tensor([8])]).to(DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = TorchAttentionBackend().forward(q.clone(), k.clone(), v, kc_ref, vc_ref, meta,
                                          d ** -0.5, rope=(positions, cache))
    out = kernels.TritonAttentionBackend(prefill_config=SMALL_TILES).forward(
        q, k, v, kc, vc, meta, d ** -0.5, rope=(positions, cache))
    assert rel_err(kc, kc_ref) < EXACTISH[dtype] and torch.equal(vc, vc_ref)
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_matches_reference(dtype):
    t, i = (300, 14336) if CUDA else (5, 1100)        # i > one 1024-column block: a masked tail
    x = (2 * torch.randn(t, 2 * i, device=DEV)).to(dtype)
    out = kernels.silu_and_mul(x)
    ref = torch_act.silu_and_mul_torch(x)
    assert out.shape == (t, i) and out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, ref) < EXACTISH[dtype]
    # a 3-D input and a row-strided one (a view into a wider buffer)
    wide = torch.randn(3, 2, 2 * i + 64, device=DEV).to(dtype)[..., :2 * i]
    assert rel_err(kernels.silu_and_mul(wide), torch_act.silu_and_mul_torch(wide)) < EXACTISH[dtype]


# ---------------------------------------------------------------------------- skinny GEMM

@pytest.mark.parametrize("cfg", importlib.import_module("pagedbackend.kernels.gemv").CANDIDATES
                         + importlib.import_module("pagedbackend.kernels.gemv").DOT_CANDIDATES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_linear_matches_reference(cfg, dtype):
    from pagedbackend.kernels import common
    from pagedbackend.kernels.common import pdl_active, prefetch_programs
    from pagedbackend.kernels.gemv import MAX_DOT_ROWS, skinny_linear
    # one shape with N and K multiples of every tile, one with ragged N and K (masked tails)
    shapes = [(6144, 4096), (1000, 1100)] if CUDA else [(64, 256), (40, 100)]
    # the tensor-core tiles also take wider inputs (a 32- and a 64-row tile); on the GPU in
    # 16-bit dtypes only (the fp32 64-row tiles may not fit in shared memory: gemv.MAX_DOT_ROWS)
    wide = len(cfg) > 4 and not (CUDA and dtype == torch.float32)
    rows = (1, 3, 4) + ((17, MAX_DOT_ROWS) if wide else ())
    for n, k in shapes:
        for m in rows:
            x = torch.randn(m, k, device=DEV).to(dtype)
            w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(dtype)
            b = torch.randn(n, device=DEV).to(dtype) if m == 3 else None
            ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            out = skinny_linear(x, w, b, cfg)
            assert out.shape == (m, n) and out.dtype == dtype
            assert rel_err(out, ref) < REL_TOL[dtype], (n, k, m)
        if CUDA and pdl_active(w.device) and (n, k) == shapes[0] and common.PREFETCH_BYTES:
            # on Hopper the first shape runs with its weights prefetched into L2 before the
            # PDL wait: the results above cover that path too
            assert prefetch_programs(w, cfg[0] * k * w.element_size()) > 0


@pytest.mark.parametrize("cfg", [(16, 512, 4, 3), (32, 256, 4, 4, True)], ids=["fma", "dot"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_norm_linear_matches_norm_then_linear(residual, dtype, cfg):
    """RMSNorm (+ residual add) run inside the matmul: the same result as the norm kernel's
    output fed to a matmul, and the new residual is x + residual."""
    from pagedbackend.kernels.gemv import ADD_NORM, NORM, skinny_linear
    n, k = (6144, 4096) if CUDA else (48, 200)
    dot = len(cfg) > 4
    for m in (1, 2, 4):
        x = (3 * torch.randn(m, k, device=DEV)).to(dtype)
        r = torch.randn(m, k, device=DEV).to(dtype) if residual else None
        g = (1 + 0.5 * torch.randn(k, device=DEV)).to(dtype)
        w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if m == 2 else None
        if residual:
            h, new_r = kernels.fused_add_rms_norm(x, r, g, 1e-5)
            y, r_out = skinny_linear(x, w, b, cfg, ADD_NORM, r, g, 1e-5)
            assert rel_err(r_out, new_r) < EXACTISH[dtype]
            h_ref = torch_norm.fused_add_rms_norm_torch(x, r, g, 1e-5)[0]
        else:
            h = kernels.rms_norm(x, g, 1e-5)
            y = skinny_linear(x, w, b, cfg, NORM, None, g, 1e-5)
            h_ref = torch_norm.rms_norm_torch(x, g, 1e-5)
        assert y.shape == (m, n) and y.dtype == dtype
        # near the two kernels it replaces (which round the normed activations to the dtype;
        # the fused kernel scales the finished dot products instead) ...
        assert rel_err(y, skinny_linear(h, w, b, cfg)) < REL_TOL[dtype], m
        ref = torch.nn.functional.linear(h_ref.float(), w.float(), None if b is None else b.float())
        assert rel_err(y, ref) < 2 * REL_TOL[dtype], m
        # ... and at fp32 accuracy against exactly what it computes (the tensor-core form
        # rounds x * gain to the dtype on its way into the dot)
        s = (x.float() + r.float()).to(dtype).float() if residual else x.float()
        rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
        sg = (s * g.float()).to(dtype).float() if dot else s * g.float()
        exact = torch.nn.functional.linear(sg, w.float()) * rstd
        if b is not None:
            exact += b.float()
        assert rel_err(y, exact) < (REL_TOL if dtype == torch.float32 else EXACTISH)[dtype], m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_silu_linear_matches_activation_then_linear(dtype):
    from pagedbackend.kernels.gemv import SILU_MUL, skinny_linear
    n, k = (4096, 14336) if CUDA else (40, 136)
    for cfg in ((8, 1024, 4, 3), (32, 256, 4, 4), (16, 256, 4, 4, True)):
        for m in (1, 3):
            gate_up = (2 * torch.randn(m, 2 * k, device=DEV)).to(dtype)
            w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(dtype)
            y = skinny_linear(gate_up, w, None, cfg, SILU_MUL)
            assert y.shape == (m, n) and y.dtype == dtype
            act = kernels.silu_and_mul(gate_up)
            assert rel_err(y, skinny_linear(act, w, None, cfg)) < EXACTISH[dtype], (cfg, m)
            ref = torch.nn.functional.linear(torch_act.silu_and_mul_torch(gate_up).float(),
                                             w.float())
            assert rel_err(y, ref) < 2 * REL_TOL[dtype], (cfg, m)


def fp8_weight(n, k):
    """A random [n, k] weight quantized as quantization="fp8" does: (e4m3, per-row scale, the
    dequantized weight in fp32 that the kernel must multiply by)."""
    from pagedbackend.layers.quantization import dequantize, quantize_weight_fp8
    wq, s = quantize_weight_fp8(torch.randn(n, k, device=DEV) / k ** 0.5)
    assert wq.dtype == torch.float8_e4m3fn and s.shape == (n,)
    return wq, s, dequantize(wq, s, torch.float32)


@pytest.mark.parametrize("cfg", [(16, 512, 4, 3), (8, 1024, 4, 5), (32, 256, 4, 4, True),
                                 (64, 256, 4, 4, True)],
                         ids=["fma", "fma-fp8tile", "dot", "dot-fp8tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_linear_fp8_weights_matches_the_dequantized_weight(cfg, dtype):
    """quantization="fp8": the kernel reads e4m3 weights and multiplies the finished products by
    the per-channel scale; the input stays in 16 bits (the tensor-core tile rounds it to fp16),
    so the result is the matmul on the dequantized weight, in every prologue."""
    from pagedbackend.kernels.gemv import ADD_NORM, SILU_MUL, skinny_linear
    n, k = (6144, 4096) if CUDA else (48, 200)
    dot = len(cfg) > 4
    # a dot tile rounds the input to fp16 (10 mantissa bits): a bf16 product's error
    tol = REL_TOL[torch.bfloat16] if dot else REL_TOL[dtype]
    for m in (1, 3):
        wq, s, w = fp8_weight(n, k)
        x = torch.randn(m, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if m == 3 else None
        y = skinny_linear(x, wq, b, cfg, weight_scale=s)
        assert y.shape == (m, n) and y.dtype == dtype
        ref = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
        assert rel_err(y, ref) < tol, m
        # the residual add + RMSNorm prologue
        r = torch.randn(m, k, device=DEV).to(dtype)
        g = (1 + 0.5 * torch.randn(k, device=DEV)).to(dtype)
        y, r_out = skinny_linear(x, wq, None, cfg, ADD_NORM, r, g, 1e-5, s)
        h = torch_norm.fused_add_rms_norm_torch(x, r, g, 1e-5)[0]
        assert rel_err(y, torch.nn.functional.linear(h.float(), w)) < 2 * tol, m
        assert rel_err(r_out, x.float() + r.float()) < EXACTISH[dtype]
        # SiLU(gate) * up before the matmul (gate|up of width 2k)
        gate_up = torch.randn(m, 2 * k, device=DEV).to(dtype)
        y = skinny_linear(gate_up, wq, None, cfg, SILU_MUL, weight_scale=s)
        act = torch_act.silu_and_mul_torch(gate_up)
        assert rel_err(y, torch.nn.functional.linear(act.float(), w)) < 2 * tol, m


@pytest.mark.parametrize("wdtype", [torch.int8, torch.float8_e4m3fn])
def test_dequantize_rows_is_the_reference(wdtype):
    """One-byte weights with per-row scales dequantized in one kernel (the int8 layers' wide
    matmuls on the GPU): in fp32 equal to layers.quantization.dequantize, in bf16 within one
    rounding of it (the interpreter truncates where the GPU rounds), at a shape no tile
    divides; on CUDA int8_linear through it matches the fp32 product."""
    from pagedbackend.kernels.quant import dequantize_rows
    from pagedbackend.layers.quantization import (dequantize, int8_linear, quantize_weight_fp8,
                                                  quantize_weight_int8)
    n, k = (4100, 4104) if CUDA else (37, 300)
    quant = quantize_weight_int8 if wdtype == torch.int8 else quantize_weight_fp8
    wq, s = quant(torch.randn(n, k, device=DEV) * torch.logspace(-2, 1, n, device=DEV)[:, None])
    want = dequantize(wq, s, torch.float32)
    assert torch.equal(dequantize_rows(wq, s, torch.float32), want)
    got = dequantize_rows(wq, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -7).all()
    if CUDA and wdtype == torch.int8:
        x = torch.randn(300, k, device=DEV).bfloat16()
        assert rel_err(int8_linear(x, wq, s), x.float() @ want.t()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_fp8_matches_reference(dtype):
    """The input of an FP8 matmul: each row scaled so its largest magnitude is 448, rounded to
    e4m3; an all-zero row gets the smallest scale and zeros (not 0/0)."""
    from pagedbackend.kernels.quant import quantize_rows_fp8
    from pagedbackend.layers.quantization import MIN_SCALE
    from pagedbackend.layers.quantization import quantize_rows_fp8 as reference
    k = 4096 if CUDA else 200
    x = (torch.randn(7, k, device=DEV) * torch.logspace(-3, 3, 7, device=DEV)[:, None]).to(dtype)
    x[4] = 0
    q, s = quantize_rows_fp8(x)
    q_ref, s_ref = reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, 1) and s.dtype == torch.float32
    assert torch.allclose(s, s_ref, rtol=1e-6) and s[4].item() == pytest.approx(MIN_SCALE)
    assert (q[4].float() == 0).all()
    got, want = q.float(), q_ref.float()
    if CUDA:
        # the division may round differently by an ulp of fp32: at most one e4m3 step apart
        diff = (got - want).abs()
        assert (diff <= want.abs() / 8 + 1e-6).all() and (diff > 0).float().mean() < 0.01
    else:
        # the interpreter's fp32 -> e4m3 conversion drops the carry when rounding up reaches the
        # next power of two (124.3 -> 64, not 128); other values at most one e4m3 step apart
        off = got != want
        assert off.float().mean() < 0.1
        g, w = got[off], want[off]
        carry = (w.abs() == torch.exp2(torch.log2(w.abs()).round())) & (g == w / 2)
        assert (carry | ((g - w).abs() <= w.abs() / 8)).all()
    assert q.float().abs().amax(dim=1)[[0, 1, 2, 3, 5, 6]].eq(448).all()


@pytest.mark.skipif(not CUDA, reason="the layers dispatch to the kernels on CUDA only")
def test_layers_run_the_norm_and_activation_inside_the_skinny_matmul():
    """norm_linear / forward_silu_mul on CUDA take the fused kernels where the skinny tile is
    the choice for the shape, and agree with the separate norm / activation + matmul."""
    from pagedbackend.kernels import gemv, gemv_tuning
    from pagedbackend.layers.linear import ColumnParallelLinear, RowParallelLinear, norm_linear
    from pagedbackend.layers.norm import RMSNorm
    h, inter, dt = 1024, 2048, torch.bfloat16
    norm = RMSNorm(h, 1e-5, dt, DEV)
    norm.weight.data.normal_(1.0, 0.3)
    proj = ColumnParallelLinear(h, [h, h], False, dt, DEV)
    proj.weight.data.normal_(0, h ** -0.5)
    down = RowParallelLinear(inter, h, False, dt, DEV)
    down.weight.data.normal_(0, inter ** -0.5)
    for rows in (1, 3):
        for w, kind in ((proj.weight, gemv.ADD_NORM), (down.weight, gemv.SILU_MUL)):
            # make the skinny tile the choice
            key = (w.device.index, gemv.rows_bucket(rows), *w.shape, dt, w.dtype, kind)
            gemv_tuning._CHOICE[key] = (16, 512, 4, 3)
        x, r = torch.randn(rows, h, device=DEV, dtype=dt), torch.randn(rows, h, device=DEV, dtype=dt)
        y, new_r = norm_linear(x, r, norm, proj)
        hn, ref_r = norm(x, r)
        assert torch.equal(new_r, ref_r) and new_r.data_ptr() != r.data_ptr()
        assert rel_err(y, torch.nn.functional.linear(hn, proj.weight)) < REL_TOL[dt]
        y0, r0 = norm_linear(x, None, norm, proj)
        assert r0 is x
        assert rel_err(y0, torch.nn.functional.linear(norm(x), proj.weight)) < REL_TOL[dt]
        gate_up = torch.randn(rows, 2 * inter, device=DEV, dtype=dt)
        ref = torch.nn.functional.linear(kernels.silu_and_mul(gate_up), down.weight)
        assert rel_err(down.forward_silu_mul(gate_up), ref) < EXACTISH[dt]
    gemv_tuning._CHOICE.clear()


def test_argmax_rows_matches_torch_including_ties():
    from pagedbackend.kernels.argmax import CHUNK, argmax_rows
    v = 2 * CHUNK + 123                   # three chunks, the last one ragged
    x = torch.randn(5, v, device=DEV).to(torch.bfloat16)
    x[1, 7] = x[1, CHUNK + 5] = x[1, -1] = 100.0     # a tie across chunks: the first wins
    x[2] = float("-inf")                              # nothing allowed: index 0, as torch
    x[3, -1] = 50.0                                   # the maximum in the ragged tail
    x[4, CHUNK:CHUNK + 2] = 60.0                      # a tie inside one chunk
    got = argmax_rows(x)
    assert got.dtype == torch.long and got.tolist() == x.float().argmax(dim=-1).tolist()
    assert got.tolist()[1:] == [7, 0, v - 1, CHUNK]
    assert argmax_rows(x.float()).tolist() == got.tolist()
    # llama-3's vocabulary (32 chunks, the last ragged), the maximum in a different chunk of
    # each row; no rows at all
    x = torch.randn(4, 128256, device=DEV)
    for r, col in enumerate((5, 70_000, 128_255, 4096)):
        x[r, col] = 10.0
    assert argmax_rows(x).tolist() == [5, 70_000, 128_255, 4096]
    assert argmax_rows(x[:0]).shape == (0,)


@pytest.mark.parametrize("prologue", ["plain", "add_norm", "silu_mul"])
def test_skinny_tuning_picks_the_fastest_agreeing_tile_in_its_fused_form(monkeypatch, prologue):
    """The choice logic with scripted timings: every tile is timed in its fused form against
    what it replaces (norm / activation + matmul, 10 us here); the fastest tile that agrees
    wins if it beats that by the margin; a tile whose result is wrong is never chosen."""
    from pagedbackend.kernels import gemv, gemv_tuning
    kind = {"plain": gemv.PLAIN, "add_norm": gemv.ADD_NORM, "silu_mul": gemv.SILU_MUL}[prologue]
    n, k = (1024, 512) if CUDA else (24, 64)
    w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(torch.float32)
    x = torch.randn(1, 2 * k if kind == gemv.SILU_MUL else k, device=DEV)
    cands = gemv.CANDIDATES
    real = gemv.skinny_linear

    def poisoned(*args, **kw):        # the tile `wrong` computes something else
        out = real(*args, **kw)
        if args[3] != wrong:
            return out
        return (out[0] + 1, out[1]) if isinstance(out, tuple) else out + 1
    monkeypatch.setattr(gemv_tuning, "skinny_linear", poisoned)
    fast = [9.0, 8.0, 3.0, 7.0, 8.5, 9.5, 6.0]
    for us, wrong, expect in ((fast, None, cands[2]),
                              ([9.9, 9.8, 9.75, 9.9, 9.9, 9.9, 9.71], None, None),  # margin
                              (fast, cands[2], cands[6])):
        table = dict(zip(cands, us))
        timed = []

        def time_us(fn):
            fn()
            cfg = fn.__defaults__[0] if fn.__defaults__ else None    # None: the baseline
            timed.append(cfg)
            return 10.0 if cfg is None else table[cfg]
        monkeypatch.setattr(gemv_tuning, "_time_us", time_us)
        assert gemv_tuning._tune(x, w, None, kind) == expect
        assert timed[0] is None and set(timed[1:]) == set(cands) - {wrong}


@pytest.mark.skipif(not CUDA, reason="the cuBLAS-vs-triton choice is timed on a CUDA device")
def test_linear_dispatch_tunes_once_and_matches_cublas():
    from pagedbackend.kernels import gemv_tuning
    from pagedbackend.layers.linear import linear
    n, k = 4096, 4096
    w = (torch.randn(n, k, device=DEV) / k ** 0.5).to(torch.bfloat16)
    for m in (1, 2, 4, 16):
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        out = linear(x, w)
        assert rel_err(out, torch.nn.functional.linear(x, w)) < REL_TOL[torch.bfloat16]
    keys = [key for key in gemv_tuning._CHOICE if key[2:4] == (n, k)]
    assert sorted(key[1] for key in keys) == [1, 2, 4]       # 16 rows never reach the tuner


# ---------------------------------------------------------------------------- no mid-run JIT

def test_compile_watch_records_only_while_armed(monkeypatch):
    import triton

    from pagedbackend.kernels import common
    if getattr(triton, "knobs", None) is None:
        pytest.skip("this triton has no jit_cache_hook")
    seen = []
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw))
    watch = common.CompileWatch()
    watch.arm()
    hook = triton.knobs.runtime.jit_cache_hook
    hook(repr="k1")
    watch.disarm()            # another engine starting in this process: its compiles are expected
    hook(repr="k2")
    watch.arm()
    assert triton.knobs.runtime.jit_cache_hook is hook      # installed once, not chained twice
    hook(repr="k3")
    assert watch.after_arm == ["k1", "k3"] and [kw["repr"] for kw in seen] == ["k1", "k2", "k3"]


@pytest.mark.skipif(not CUDA, reason="the interpreter compiles nothing")
@pytest.mark.parametrize("eager,quantization", [(False, None), (True, None), (False, "fp8"),
                                                (False, "awq")],
                         ids=["graphs", "eager", "graphs-fp8", "graphs-awq"])
def test_no_kernel_compiles_after_warmup(tmp_path, eager, quantization):
    """Requests arriving while others decode (mixed steps of every size, contexts from 1 to ~900
    tokens, block-table widths 1 to 60, prefix hits), then a burst wider than one (sequence,
    kv head) per SM: every kernel variant they need was built by the engine's warm-up, so
    nothing compiles (and stalls everyone) in the middle of serving."""
    import random

    from pagedbackend import LLM, SamplingParams
    from pagedbackend.kernels.common import COMPILES
    import json

    from pagedbackend.testing import TINY_CONFIGS
    # config + dummy weights: no transformers import (it fails in the GPU host's numpy-1.26 env)
    cfg = dict(TINY_CONFIGS["llama"], architectures=["LlamaForCausalLM"], model_type="llama",
               max_position_embeddings=2048)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=160, max_model_len=1024,
              num_kv_blocks=4096, enforce_eager=eager, load_format="dummy",
              quantization=quantization)
    engine = llm.engine
    before = len(COMPILES.after_arm)
    rng = random.Random(7)
    shared = [rng.randrange(1, 150) for _ in range(40)]
    for i in range(48):
        n = rng.choice([1, 2, 5, 15, 16, 17, 31, 64, 130, 300, 700])
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1, 150) for _ in range(n)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.7 if i % 2 else 0, seed=i,
                                          max_tokens=rng.choice([1, 3, 40, 200]),
                                          ignore_eos=True))
        for _ in range(rng.choice([0, 1, 3, 12])):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    # then decode steps wider than one (sequence, kv head) per SM, whose rotary + KV write run
    # in their own kernel
    from pagedbackend.kernels.common import num_sms
    wide = num_sms(torch.cuda.current_device()) // cfg["num_key_value_heads"] + 1
    for i in range(wide):
        engine.add_request(f"w{i}", {"prompt_token_ids": [rng.randrange(1, 150)
                                                          for _ in range(5)]},
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert COMPILES.armed and COMPILES.after_arm[before:] == []


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_single_sequence_prefill_graph_matches_eager(tmp_path):
    """A step that prefills one sequence alone replays a graph of its token-count bucket
    (padding tokens write nowhere; a cached prefix is read through the block table) and gives
    the eager step's logits; past the largest bucket the step runs eagerly."""
    import json

    import numpy as np

    from pagedbackend import LLM
    from pagedbackend.testing import TINY_CONFIGS
    from pagedbackend.worker.step_inputs import HostInputs
    cfg = dict(TINY_CONFIGS["llama"], architectures=["LlamaForCausalLM"], model_type="llama",
               max_position_embeddings=2048)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, max_model_len=1024,
              num_kv_blocks=512, load_format="dummy")
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.buckets[-1] == 512
    with torch.no_grad():       # dummy weights are ~1e-3: spread them so the logits move
        for name, p in runner.model.named_parameters():
            if "norm" not in name:
                p.mul_(60)
    bs, rng = runner.block_size, np.random.default_rng(0)
    table = (np.arange(64, dtype=np.int32) + 100)[None, :]      # blocks no request owns
    for start, q_len in [(0, 2), (0, 16), (0, 100), (64, 65), (200, 300), (0, 600)]:
        if start:   # the cached prefix, written by an eager step first
            runner.forward_logits(HostInputs(
                rng.integers(0, 160, start), np.arange(start), np.array([start]),
                np.array([0]), table, [0], bs), graphs=False)
        h = HostInputs(rng.integers(0, 160, q_len), np.arange(start, start + q_len),
                       np.array([q_len]), np.array([start]), table, [0], bs)
        eager = runner.forward_logits(h, graphs=False).clone()
        before = graphs.replays
        replayed = runner.forward_logits(h).clone()
        assert graphs.replays == before + (q_len <= 512)
        assert replayed.shape == eager.shape == (1, 160) and not torch.isnan(replayed).any()
        assert torch.allclose(replayed, eager, rtol=1e-4, atol=1e-4), (start, q_len)
    llm.engine.shutdown()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_verification_of_drafts_replays_a_prefill_graph(tmp_path):
    """With speculative decoding (k = 5) a verification step (each sequence's last token and
    its drafts after a cached context) replays a prefill graph (one sequence: the 8-token one;
    three: the 4-sequence one, a row without drafts among them) and gives the eager step's
    logits at every 1 + k rows; the engine's greedy output with drafts equals the output
    without, and its verifications ran in graphs."""
    import json

    import numpy as np

    from pagedbackend import LLM, SamplingParams
    from pagedbackend.testing import TINY_CONFIGS
    from pagedbackend.worker.step_inputs import HostInputs
    cfg = dict(TINY_CONFIGS["llama"], architectures=["LlamaForCausalLM"], model_type="llama",
               max_position_embeddings=2048)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, max_model_len=1024,
              num_kv_blocks=512, load_format="dummy", speculative_config=spec)
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    assert graphs.rows == 6 and graphs.buckets[0] == 8 and graphs.seq_buckets == [2, 4]
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            if "norm" not in name:
                p.mul_(60)
    bs, rng = runner.block_size, np.random.default_rng(1)
    # one sequence (the 8-token graph), then three (the 4-sequence graph; one has no drafts)
    for starts, ks in [([40], [5]), ([40], [2]), ([130], [5]), ([40, 70, 130], [5, 0, 2])]:
        n, starts, ks = len(starts), np.array(starts), np.array(ks)
        table = (np.arange(n * 64, dtype=np.int32) + 100).reshape(n, 64)   # no request's
        runner.forward_logits(HostInputs(
            rng.integers(0, 160, starts.sum()), np.concatenate([np.arange(s) for s in starts]),
            starts, np.zeros(n, np.int64), table, list(range(n)), bs), graphs=False)
        h = HostInputs(rng.integers(0, 160, (1 + ks).sum()),
                       np.concatenate([np.arange(s, s + 1 + k) for s, k in zip(starts, ks)]),
                       1 + ks, starts, table, list(range(n)), bs, num_drafts=ks)
        eager = runner.forward_logits(h, graphs=False).clone()
        before = graphs.replays
        replayed = runner.forward_logits(h).clone()
        assert graphs.replays == before + 1
        assert replayed.shape == eager.shape == ((1 + ks).sum(), 160)
        assert torch.allclose(replayed, eager, rtol=1e-4, atol=1e-4), (starts, ks)
    prompt = {"prompt_token_ids": [int(t) for t in rng.integers(1, 160, 6)] * 5}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    eng = llm.engine
    with_drafts = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert eng.drafter.stats.num_drafts > 0
    steps = dict(runner.path_steps)
    drafter, eng.drafter = eng.drafter, None
    without = llm.generate([prompt], params)[0].outputs[0].token_ids
    eng.drafter = drafter
    assert with_drafts == without
    assert steps["prefill_graph"] >= drafter.stats.num_drafts
    eng.shutdown()
