"""Time each triton kernel against its torch reference at llama-3.1-8b shapes on one GPU.

    python perf/kernels_bench.py [--sweep]

32 q / 8 kv heads x 128, bf16, block 16. Decode at batch 1/64/256 x context 512/2048 (GB/s of KV +
q/out traffic vs the H200's 4.27 TB/s), prefill of 2048 tokens (alone and after a 2048 cached
prefix; TFLOP/s of the causal attention), a mixed chunked-prefill step, KV write, RMSNorm (+residual), rotary. --sweep also
tries a few tile configs for decode and prefill and prints the best. Decode at mixed context
lengths (W5's steps): grid order vs longest first, splits, stages. The table comes last.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.language as tl
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedbackend import kernels  # noqa: E402
from pagedbackend.kernels.common import num_sms  # noqa: E402
from pagedbackend.kernels.decode import decode_config  # noqa: E402
from pagedbackend.kernels.prefill import prefill_config  # noqa: E402
from pagedbackend.kernels.testing import random_paged_batch  # noqa: E402
from pagedbackend.layers import norm as torch_norm, rotary as torch_rotary  # noqa: E402
from pagedbackend.layers.attention import TorchAttentionBackend, write_kv_cache  # noqa: E402

HQ, HKV, D, BS, HIDDEN = 32, 8, 128, 16, 4096
DT = torch.bfloat16
DEVICE = "cuda"
PEAK_BW = 4.27e12
ROWS: list[tuple] = []          # (name, triton ms, torch ms, metric)
FP8_ROWS = (512, 8192)          # W2's decode and prefill steps


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def row(name, t_ms, ref_ms, metric=""):
    ROWS.append((name, t_ms, ref_ms, metric))
    print(f"{name:<34} triton {t_ms * 1e3:9.1f} us   torch {ref_ms * 1e3:9.1f} us   {metric}",
          flush=True)


# llama-3.1-8b's four matmuls of a layer: (name, N, K)
LLAMA_MATMULS = (("qkv", HIDDEN * 3 // 2, HIDDEN), ("o", HIDDEN, HIDDEN),
                 ("gate_up", 2 * (HIDDEN * 7 // 2), HIDDEN), ("down", HIDDEN, HIDDEN * 7 // 2))


def random_packed_weight(n: int, k: int):
    """A 4-bit PackedWeight [N, K] of random codes in groups of 128 (scales up to 0.02, AWQ's
    size: the tuner's check at K 14,336 failed on these before a9bf3b0)."""
    from pagedbackend.layers.quant_grouped import PackedWeight
    g = k // 128
    return PackedWeight(4, 128, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8,
                                              device=DEVICE),
                        (torch.rand(g, n, device=DEVICE) * 0.02).half(),
                        torch.randint(0, 16, (g, n), dtype=torch.uint8, device=DEVICE),
                        None, None)


def kv_bytes(seq_lens):
    return sum(seq_lens) * HKV * D * 2 * 2


def bench_decode(sweep):
    scale = D ** -0.5
    # W2 128/128's decode steps: 512 rows at ~192 tokens of context
    for b, ctx in ((1, 512), (1, 2048), (64, 512), (64, 2048), (256, 512), (256, 2048),
                   (512, 192)):
        q, k, v, kc, vc, meta = random_paged_batch([1] * b, [ctx] * b, BS, HQ, HKV, D, DT,
                                                   DEVICE)
        backend = kernels.TritonAttentionBackend()
        ref_backend = TorchAttentionBackend()
        splits = kernels.choose_num_splits(b, HKV, ctx, num_sms(torch.cuda.current_device()))
        out = torch.empty_like(q)
        part_out = torch.empty(b * HQ * splits * D, device=DEVICE)
        part_lse = torch.empty(b * HQ * splits, device=DEVICE)

        def attn(cfg=None, s=splits):
            kernels.paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                           scale, out, s, part_out, part_lse, cfg)
        t = bench(attn)
        t_fwd = bench(lambda: backend.forward(q, k, v, kc, vc, meta, scale))
        t_ref = bench(lambda: ref_backend.forward(q, k, v, kc, vc, meta, scale))
        gbs = (kv_bytes([ctx] * b) + 2 * q.numel() * 2) / (t * 1e-3)
        row(f"decode b={b} ctx={ctx} splits={splits}", t, t_ref,
            f"{gbs / 1e9:7.0f} GB/s ({100 * gbs / PEAK_BW:4.1f}% of 4.27 TB/s); "
            f"backend fwd {t_fwd * 1e3:.1f} us")
        if sweep:
            best = None
            for bn in (32, 64, 128):
                for st in (1, 2, 3):
                    for nw in (2, 4):
                        cfg = dict(BLOCK_N=bn, num_stages=st, num_warps=nw)
                        for s in sorted({1, splits, max(1, splits // 2), min(32, splits * 2)}):
                            if s > splits and part_out.numel() < b * HQ * s * D:
                                continue
                            tt = bench(lambda: attn(cfg, s))
                            if best is None or tt < best[0]:
                                best = (tt, cfg, s)
            print(f"    sweep best {best[0] * 1e3:.1f} us with {best[1]} splits={best[2]} "
                  f"(default {decode_config(D)})")


def bench_decode_mixed_lengths():
    """W5's decode steps: contexts of mixed length (uniform in [100, 2048], seed 0), where a step
    lasts as long as its slowest programs. Each batch in grid order and longest first
    (decode.LONGEST_FIRST), and in grid order with 2 and 4 splits and with 3 pipeline stages."""
    import random
    scale = D ** -0.5
    rng = random.Random(0)
    for b in (256, 128, 64, 32):
        lens = [rng.randint(100, 2048) for _ in range(b)]
        q, k, v, kc, vc, meta = random_paged_batch([1] * b, lens, BS, HQ, HKV, D, DT, DEVICE)
        out = torch.empty_like(q)
        part_out = torch.empty(b * HQ * 4 * D, device=DEVICE)
        part_lse = torch.empty(b * HQ * 4, device=DEVICE)
        gb = kv_bytes(lens) + 2 * q.numel() * 2
        for name, splits, stages, order in (("grid order", 1, 2, None),
                                            ("longest first", 1, 2, meta.longest_first),
                                            ("grid order", 2, 2, None), ("grid order", 4, 2, None),
                                            ("grid order", 1, 3, None),
                                            ("longest first", 1, 3, meta.longest_first)):
            t = bench(lambda: kernels.paged_decode_attention(
                q, kc, vc, meta.block_tables, meta.seq_lens, scale, out, splits, part_out,
                part_lse, dict(num_stages=stages), order=order))
            row(f"decode mixed b={b} {name} s={splits} st={stages}", t, float("nan"),
                f"{gb / (t * 1e-3) / 1e9:7.0f} GB/s ({100 * gb / (t * 1e-3) / PEAK_BW:4.1f}% "
                f"of 4.27 TB/s), mean ctx {sum(lens) // b}")


def bench_decode_fp8():
    """Decode attention over an fp8 cache (kv_cache_dtype fp8) against bf16 at W2's and W5's
    steps: bf16 with its tile, fp8 with tiles of 64 and 128 tokens, 2 or 3 stages, computing
    in fp16 (decode.FP8_F16) or, F16=False, in bf16.
    TB/s counts the bytes each cache really holds (fp8: half)."""
    import random
    scale = D ** -0.5
    rng = random.Random(0)
    fp8 = torch.float8_e4m3fn
    cases = (("W2 128/128", [192] * 512), ("W5 mixed", [rng.randint(100, 2048) for _ in range(256)]),
             ("64 x 2048", [2048] * 64), ("W5 tail", [rng.randint(100, 2048) for _ in range(32)]))
    for name, lens in cases:
        b = len(lens)
        q, k, v, kc, vc, meta = random_paged_batch([1] * b, lens, BS, HQ, HKV, D, DT, DEVICE)
        out = torch.empty_like(q)
        splits = kernels.choose_num_splits(b, HKV, max(lens), num_sms(torch.cuda.current_device()))
        part_out = torch.empty(b * HQ * splits * D, device=DEVICE)
        part_lse = torch.empty(b * HQ * splits, device=DEVICE)
        order = meta.longest_first
        kc8, vc8 = kc.to(fp8), vc.to(fp8)
        gb = kv_bytes(lens)
        for cache, cfg in [("bf16", None)] + [("fp8", dict(BLOCK_N=n, num_warps=w, num_stages=st))
                                             for n, w, st in ((64, 4, 2), (128, 4, 2), (128, 4, 3))
                                             ] + [("fp8", dict(BLOCK_N=n, F16=False))
                                                  for n in (64, 128)]:
            kk, vv, nbytes = (kc, vc, gb) if cache == "bf16" else (kc8, vc8, gb // 2)
            t = bench(lambda: kernels.paged_decode_attention(
                q, kk, vv, meta.block_tables, meta.seq_lens, scale, out, splits, part_out,
                part_lse, cfg, order=order))
            row(f"decode {name} b={b} {cache} {cfg or ''}", t, float("nan"),
                f"{nbytes / (t * 1e-3) / 1e12:5.2f} TB/s, mean ctx {sum(lens) // b}")


def bench_prefill(sweep):
    scale = D ** -0.5
    for name, qlens, slens in (("prefill 2048", [2048], [2048]),
                               ("prefill 2048 after 2048 cached", [2048], [4096]),
                               ("prefill 4x512", [512] * 4, [512] * 4)):
        q, k, v, kc, vc, meta = random_paged_batch(qlens, slens, BS, HQ, HKV, D, DT, DEVICE)
        out = torch.empty_like(q)

        def attn(cfg=None, contig=False):
            kernels.paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens,
                                            meta.query_start_loc, scale, out, cfg,
                                            k_new=k if contig else None,
                                            v_new=v if contig else None)
        t = bench(attn)
        t_ref = bench(lambda: TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale))
        # Causal: query at position p sees p + 1 keys; 2 matmuls x 2 flop per multiply-add.
        pairs = sum(sum(range(s - ql + 1, s + 1)) for ql, s in zip(qlens, slens))
        tflops = 4 * HQ * D * pairs / (t * 1e-3) / 1e12
        row(name, t, t_ref, f"{tflops:6.1f} TFLOP/s")
        # the step's keys read from k / v (the engine's default, prefill.CONTIG_KV)
        tc = bench(lambda: attn(contig=True))
        row(name + ", step's K/V from k/v", tc, t_ref,
            f"{4 * HQ * D * pairs / (tc * 1e-3) / 1e12:6.1f} TFLOP/s")
        if sweep:
            best = None
            for bm, bn, nw, st in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
                                   (64, 64, 4, 3), (128, 32, 8, 4), (64, 128, 4, 2)):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=st)
                try:
                    tt = bench(lambda: attn(cfg, contig=True))
                except Exception as e:          # e.g. out of shared memory
                    print(f"    {cfg}: {type(e).__name__}")
                    continue
                if best is None or tt < best[0]:
                    best = (tt, cfg)
            print(f"    sweep best {best[0] * 1e3:.1f} us with {best[1]} "
                  f"(default {prefill_config(D)})")


def bench_mixed():
    # A chunked-prefill step: one 512-token chunk plus 64 decodes at context 2048, through the
    # whole backend (KV write + prefill kernel + decode kernel on the single-query rows).
    scale = D ** -0.5
    qlens, slens = [512] + [1] * 64, [1024] + [2048] * 64
    q, k, v, kc, vc, meta = random_paged_batch(qlens, slens, BS, HQ, HKV, D, DT, DEVICE)
    backend = kernels.TritonAttentionBackend()
    t = bench(lambda: backend.forward(q, k, v, kc, vc, meta, scale))
    t_ref = bench(lambda: TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale))
    row("mixed 512 chunk + 64 decodes@2048", t, t_ref,
        f"{kv_bytes(slens) / (t * 1e-3) / 1e9:7.0f} GB/s of KV")


def bench_elementwise():
    for t in (256, 2048):
        q, k, v, kc, vc, meta = random_paged_batch([t], [t], BS, HQ, HKV, D, DT, DEVICE)
        tt = bench(lambda: kernels.store_kv_cache(k, v, kc, vc, meta.slot_mapping))
        tr = bench(lambda: write_kv_cache(k, v, kc, vc, meta.slot_mapping))
        row(f"store_kv T={t}", tt, tr, f"{4 * k.numel() * 2 / (tt * 1e-3) / 1e9:7.0f} GB/s")

        x = torch.randn(t, HIDDEN, device=DEVICE, dtype=DT)
        res = torch.randn_like(x)
        w = torch.randn(HIDDEN, device=DEVICE, dtype=DT)
        tt = bench(lambda: kernels.fused_add_rms_norm(x, res, w, 1e-5))
        tr = bench(lambda: torch_norm.fused_add_rms_norm_torch(x, res, w, 1e-5))
        row(f"fused_add_rms_norm T={t}", tt, tr,
            f"{5 * x.numel() * 2 / (tt * 1e-3) / 1e9:7.0f} GB/s")
        tt = bench(lambda: kernels.rms_norm(x, w, 1e-5))
        tr = bench(lambda: torch_norm.rms_norm_torch(x, w, 1e-5))
        row(f"rms_norm T={t}", tt, tr, f"{2 * x.numel() * 2 / (tt * 1e-3) / 1e9:7.0f} GB/s")

        cache = torch_rotary.build_cos_sin_cache(D, 8192, 500000.0, None, DT, DEVICE)
        pos = torch.randint(0, 8192, (q.shape[0],), device=DEVICE)
        tt = bench(lambda: kernels.apply_rotary(q, k, pos, cache))
        tr = bench(lambda: torch_rotary.apply_rotary_torch(q, k, pos, cache))
        row(f"rotary T={t}", tt, tr,
            f"{2 * (q.numel() + k.numel()) * 2 / (tt * 1e-3) / 1e9:7.0f} GB/s")


def bench_fp8_inputs():
    """quantization="fp8": the RMSNorm / SiLU·mul kernels that quantize for the FP8 GEMM
    against the plain kernel + the per-row quantization kernel ("torch" column: the separate
    kernels), at W2's decode (512 rows) and prefill (8,192) steps; then the one-row e4m3 tiles
    that widen with integer ops against the same tile with triton's cast ("torch" column),
    graph-timed with the L2 flushed as the tuner times them, at llama-3.1-8b's four matmuls."""
    from pagedbackend.kernels import activation, gemv, norm, quant
    from pagedbackend.kernels.gemv_tuning import _time_us
    from pagedbackend.layers.quantization import quantize_weight_fp8
    inter = HIDDEN * 7 // 2            # llama-3.1-8b's 14,336
    for t in FP8_ROWS:
        x = torch.randn(t, HIDDEN, device=DEVICE, dtype=DT)
        res, w = torch.randn_like(x), torch.randn(HIDDEN, device=DEVICE, dtype=DT)
        tt = bench(lambda: norm.rms_norm_quant_fp8(x, res, w, 1e-5))
        tr = bench(lambda: quant.quantize_rows_fp8(norm.fused_add_rms_norm(x, res, w, 1e-5)[0]))
        row(f"add_rms_norm+fp8 T={t}", tt, tr, f"{5 * x.numel() / (tt * 1e-3) / 1e9:7.0f} GB/s")
        gu = torch.randn(t, 2 * inter, device=DEVICE, dtype=DT)
        tt = bench(lambda: activation.silu_and_mul_quant_fp8(gu))
        tr = bench(lambda: quant.quantize_rows_fp8(activation.silu_and_mul(gu)))
        row(f"silu_mul+fp8 T={t}", tt, tr, f"{5 * gu.numel() / 2 / (tt * 1e-3) / 1e9:7.0f} GB/s")
    shapes = (("qkv+norm", HIDDEN * 3 // 2, HIDDEN, gemv.ADD_NORM), ("o", HIDDEN, HIDDEN, gemv.PLAIN),
              ("gate_up+norm", 2 * inter, HIDDEN, gemv.ADD_NORM),
              ("down+silu", HIDDEN, inter, gemv.SILU_MUL))
    for name, n, k, kind in shapes:
        wq, sw = quantize_weight_fp8(torch.randn(n, k, device=DEVICE) / k ** 0.5)
        x = torch.randn(1, 2 * k if kind == gemv.SILU_MUL else k, device=DEVICE, dtype=DT)
        r, g = torch.randn(1, k, device=DEVICE, dtype=DT), torch.ones(k, device=DEVICE, dtype=DT)
        extra = (r, g, 1e-5) if kind == gemv.ADD_NORM else (None, None, 0.0)
        for cfg in gemv.FP8_WIDEN_CANDIDATES:
            def run(c):
                return gemv.skinny_linear(x, wq, None, c, kind, *extra, weight_scale=sw)
            try:
                tt, tr = _time_us(lambda: run(cfg)) / 1e3, _time_us(lambda: run(cfg[:4])) / 1e3
            except Exception as e:      # noqa: BLE001  -- e.g. the PTX form not compiling
                print(f"fp8 1-row {name} {cfg}: failed: {type(e).__name__}: {e}"[:300])
                continue
            row(f"fp8 1-row {name} {cfg[:4]} widen{cfg[5]}", tt, tr,
                f"{n * k / (tt * 1e-3) / 1e12:5.2f} TB/s of weights")


def bench_w4():
    """AWQ / GPTQ at one row (W1's decode step), llama-3.1-8b's four matmuls with 4-bit codes in
    groups of 128: the tuner's choices (the prologue inside the kernel or in its own kernel
    first) against dequantize + cuBLAS and against bf16 cuBLAS on a 16-bit weight of the same
    shape. Graph-timed with the L2 flushed, as the tuner times. Then every one-row tile without a
    prologue: the best of the nibble-split and fp16-pair tiles (gemv_w4.SPLIT_CANDIDATES,
    HALF_CANDIDATES) against the best split-K tile (KSPLIT_CANDIDATES, each checked against the
    dequantized weight), per shape in a table of its own. TB/s: the codes', scales' and zeros'
    bytes."""
    from pagedbackend.kernels import gemv, gemv_w4, gemv_w4_tuning
    from pagedbackend.kernels.gemv_tuning import _time_us
    from pagedbackend.layers.activation import silu_and_mul
    from pagedbackend.layers.norm import fused_add_rms_norm
    prologue = {"qkv": gemv.ADD_NORM, "o": gemv.PLAIN, "gate_up": gemv.ADD_NORM,
                "down": gemv.SILU_MUL}
    lin = torch.nn.functional.linear
    split_table = []
    for name, n, k in LLAMA_MATMULS:
        kind, g = prologue[name], k // 128
        pw = random_packed_weight(n, k)
        nbytes = n * k // 2 + g * n * 3
        x = torch.randn(1, 2 * k if kind == gemv.SILU_MUL else k, device=DEVICE, dtype=DT)
        r, gn = torch.randn(1, k, device=DEVICE, dtype=DT), torch.ones(k, device=DEVICE, dtype=DT)
        xp = x[:, :k].contiguous()
        tbs = lambda t_us: f"{nbytes / (t_us * 1e-6) / 1e12:5.2f} TB/s"    # noqa: E731
        w16 = pw.dequantize(DT)
        ref = lin(xp.float(), pw.dequantize(torch.float32))
        def run(cfg):
            return gemv_w4.packed_gemv(xp, pw, None, cfg)

        whole = min(_best_tile(gemv_w4.SPLIT_CANDIDATES, run),
                    _best_tile(gemv_w4.HALF_CANDIDATES, run), key=lambda t: t[0])
        best = [whole, _best_tile([c for c in gemv_w4.KSPLIT_CANDIDATES
                                   if k % (c[6] * 128) == 0], run, ref, "w4", tbs)]
        split_table.append((f"{name} N={n} K={k}", *best))
        row(f"w4 {name} 1-row split-K {best[1][1]} vs whole K {best[0][1]}", best[1][0] / 1e3,
            best[0][0] / 1e3, tbs(best[1][0]))
        tp = _time_us(lambda: gemv_w4_tuning.packed_linear(xp, pw, None))
        row(f"w4 {name} tuned vs bf16 cuBLAS", tp / 1e3, _time_us(lambda: lin(xp, w16)) / 1e3,
            tbs(tp))
        row(f"w4 {name} tuned vs dequantize+cuBLAS", tp / 1e3,
            _time_us(lambda: lin(xp, pw.dequantize(DT))) / 1e3, tbs(tp))
        if kind == gemv.ADD_NORM:
            fus = lambda: gemv_w4_tuning.maybe_packed_norm_linear(xp, r, gn, 1e-5, pw, None)  # noqa
            sep = lambda: gemv_w4_tuning.packed_linear(   # noqa: E731
                fused_add_rms_norm(xp, r, gn, 1e-5)[0], pw, None)
        elif kind == gemv.SILU_MUL:
            fus = lambda: gemv_w4_tuning.maybe_packed_silu_linear(x, pw)   # noqa: E731
            sep = lambda: gemv_w4_tuning.packed_linear(silu_and_mul(x), pw, None)  # noqa: E731
        else:
            continue
        chosen = fus() is not None
        tf = _time_us(fus) if chosen else float("nan")
        row(f"w4 {name} prologue: fused {'chosen' if chosen else 'not chosen'} vs separate",
            tf / 1e3, _time_us(sep) / 1e3, tbs(tf) if chosen else "")
    print("\n| shape (1 row, group 128) | best whole-K tile us | best split-K tile us "
          "| whole / split-K |\n|---|---:|---:|---:|")
    for shape, (old_us, old_cfg), (new_us, new_cfg) in split_table:
        print(f"| {shape} | {old_us:.1f} {old_cfg} | {new_us:.1f} {new_cfg} | "
              f"{old_us / new_us:.2f}x |")


def bench_w4_wide():
    """AWQ / GPTQ at 64 rows, W2's decode (512 rows) and prefill (8,192) steps, llama-3.1-8b's
    four matmuls, 4-bit codes in groups of 128: the best swap-AB W4A16 GEMM tile
    (gemv_w4.SWAP_CANDIDATES, each checked against the fp32 product) against dequantize +
    cuBLAS (the tuner's other choice), the dequantization alone and bf16 cuBLAS on a 16-bit
    weight of the same shape. TFLOP/s: 2 x rows x N x K over the time."""
    from pagedbackend.kernels import gemv_w4
    from pagedbackend.kernels.gemv_tuning import _time_us
    lin = torch.nn.functional.linear
    table = []
    for name, n, k in LLAMA_MATMULS:
        pw = random_packed_weight(n, k)
        w16, w32 = pw.dequantize(DT), pw.dequantize(torch.float32)
        for rows in (64, 512, 8192):
            x = torch.randn(rows, k, device=DEVICE, dtype=DT)
            ref = lin(x.float(), w32)
            tf = lambda us: f"{2 * rows * n * k / (us * 1e-6) / 1e12:.0f} TFLOP/s"  # noqa: B023,E731

            def run(cfg, x=x, pw=pw):
                return gemv_w4.packed_gemv(x, pw, None, cfg)

            swap = _best_tile(gemv_w4.SWAP_CANDIDATES, run, ref, f"w4 {name} {rows} rows", tf)
            deq = _time_us(lambda: pw.dequantize(DT))        # noqa: B023
            deq_mm = _time_us(lambda: lin(x, pw.dequantize(DT)))     # noqa: B023
            bf16 = _time_us(lambda: lin(x, w16))     # noqa: B023
            table.append((f"{name} N={n} K={k}", rows, swap, deq, deq_mm, bf16))
    print("\n| shape (group 128) | rows | best swap-AB GEMM us | dequantize us | "
          "dequantize + cuBLAS us | bf16 cuBLAS us | best / bf16 |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for shape, rows, (s_us, s_cfg), deq, deq_mm, bf16 in table:
        print(f"| {shape} | {rows} | {s_us:.1f} {s_cfg} | {deq:.1f} | {deq_mm:.1f} | "
              f"{bf16:.1f} | {bf16 / min(s_us, deq_mm):.2f}x |")


def bench_dequant():
    """The 4-bit dequantization that dequantize + cuBLAS runs before every wide AWQ / GPTQ
    matmul, llama-3.1-8b's four shapes, group 128, to bf16: the word-pair kernel
    (_dequant_pairs_kernel, no int-to-float conversion) at a few tiles against the one that
    converts each code (_dequant_kernel, BITS=4, 32 x 128). TB/s: codes, scales and zeros
    read plus the bf16 weight written."""
    from pagedbackend.kernels import gemv_w4
    from pagedbackend.kernels.gemv_tuning import _time_us
    print("\n| shape | converting kernel us | pair kernel us (tile) | TB/s | speed-up |\n"
          "|---|---:|---:|---:|---:|")
    default = gemv_w4.DEQUANT_PAIRS_TILE
    for name, n, k in LLAMA_MATMULS:
        pw = random_packed_weight(n, k)
        out = torch.empty((n, k), dtype=DT, device=DEVICE)

        def converting(pw=pw, out=out, n=n, k=k):
            gemv_w4._dequant_kernel[(triton.cdiv(n, 32), k // 128)](
                pw.qweight, pw.scales, pw.zeros, out, n, k, GROUP=128, BITS=4, BLOCK_N=32,
                BLOCK_K=128, num_warps=4)
        converting()
        want = out.clone()
        old = _time_us(converting)
        best = None
        for tile in (default, (32, 128, 4), (128, 128, 8), (64, 128, 2), (128, 128, 4)):
            gemv_w4.DEQUANT_PAIRS_TILE = tile
            assert torch.equal(pw.dequantize(DT), want), tile
            us = _time_us(lambda pw=pw: pw.dequantize(DT))
            best = min(best or (us, tile), (us, tile))
        gemv_w4.DEQUANT_PAIRS_TILE = default
        nbytes = pw.qweight.numel() + pw.scales.numel() * pw.scales.element_size() \
            + pw.zeros.numel() + n * k * 2
        print(f"| {name} N={n} K={k} | {old:.1f} | {best[0]:.1f} {best[1]} | "
              f"{nbytes / (best[0] * 1e-6) / 1e12:.2f} | {old / best[0]:.2f}x |")


def bench_bytes():
    """One-byte weights (fp8 e4m3, int8) at one row, llama-3.1-8b's four matmuls, no prologue:
    the best of the skinny kernel's fp32 tiles (CANDIDATES, FP8_CANDIDATES, e4m3's
    FP8_WIDEN_CANDIDATES) against the best fp16-pair tile (FP8_HALF_CANDIDATES /
    INT8_HALF_CANDIDATES), each checked against x @ dequantized W in fp32 (a tile off by more
    than 1e-2 is skipped). TB/s: the weights' bytes."""
    from pagedbackend.kernels import gemv
    from pagedbackend.layers.quantization import quantize_weight_fp8, quantize_weight_int8
    table = []
    for wname, quant, half in (("e4m3", quantize_weight_fp8, gemv.FP8_HALF_CANDIDATES),
                               ("int8", quantize_weight_int8, gemv.INT8_HALF_CANDIDATES)):
        plain = gemv.CANDIDATES + gemv.FP8_CANDIDATES[:4] \
            + (gemv.FP8_WIDEN_CANDIDATES if wname == "e4m3" else ())
        for name, n, k in LLAMA_MATMULS:
            wq, sc = quant(torch.randn(n, k, device=DEVICE) / k ** 0.5)
            x = torch.randn(1, k, device=DEVICE, dtype=DT)
            ref = x.float() @ (wq.float() * sc[:, None]).t()
            def run(cfg, x=x, wq=wq, sc=sc):
                return gemv.skinny_linear(x, wq, None, cfg, weight_scale=sc)

            best = [_best_tile(tiles, run, ref, f"{wname} {name}")
                    for tiles in (plain, half)]
            table.append((f"{wname} {name} N={n} K={k}", n * k, *best))
    print("\n| weights, shape (1 row) | best fp32 tile us | best fp16-pair tile us | fp32 / pair |"
          " pair TB/s |\n|---|---:|---:|---:|---:|")
    for shape, nbytes, (a_us, a_cfg), (b_us, b_cfg) in table:
        print(f"| {shape} | {a_us:.1f} {a_cfg} | {b_us:.1f} {b_cfg} | {a_us / b_us:.2f}x | "
              f"{nbytes / (b_us * 1e-6) / 1e12:.2f} |")


def bench_fp8mma():
    """fp8 weights at 1, 4, 16, 32 and 64 rows, llama-3.1-8b's four matmuls: the best
    tensor-core W8A8 tile (kernels/fp8_mma.CANDIDATES, checked against the fp32 product of the
    quantized operands) against torch._scaled_mm on the same e4m3 input, the per-row
    quantization of the input alone (what o_proj adds: the others' come from their norm /
    activation kernel), and the best W8A16 fp16-pair tile at one row
    (gemv.FP8_HALF_CANDIDATES, the one-row decode path). TB/s: the weights' bytes over the
    tile's time."""
    from pagedbackend.kernels import fp8_mma, gemv
    from pagedbackend.kernels.gemv_tuning import _time_us
    from pagedbackend.kernels.quant import quantize_rows_fp8
    from pagedbackend.layers.quantization import fp8_gemm_cublas, quantize_weight_fp8
    table = []
    for name, n, k in LLAMA_MATMULS:
        wq, sw = quantize_weight_fp8(torch.randn(n, k, device=DEVICE) / k ** 0.5)
        tbs = lambda us: f"{n * k / (us * 1e-6) / 1e12:.2f} TB/s"      # noqa: B023,E731
        for rows in (1, 4, 16, 32, 64):
            x = torch.randn(rows, k, device=DEVICE, dtype=DT)
            xq, sx = quantize_rows_fp8(x)
            ref = (xq.float() * sx) @ (wq.float() * sw[:, None]).t()

            def run(cfg, xq=xq, sx=sx, wq=wq, sw=sw):
                return fp8_mma.fp8_mma_gemm(xq, sx, wq, sw, None, DT, cfg)

            mma = _best_tile([c for c in fp8_mma.CANDIDATES if k % (c[1] * c[4]) == 0], run, ref,
                             f"fp8mma {name} {rows} rows", tbs)
            blas = _time_us(lambda: fp8_gemm_cublas(xq, sx, wq, sw, None, DT))  # noqa: B023
            quant = _time_us(lambda: quantize_rows_fp8(x))      # noqa: B023
            pair = (float("nan"), None)
            if rows == 1:
                pair = _best_tile(gemv.FP8_HALF_CANDIDATES, lambda cfg, x=x, wq=wq, sw=sw:
                                  gemv.skinny_linear(x, wq, None, cfg, weight_scale=sw),
                                  x.float() @ (wq.float() * sw[:, None]).t(),
                                  f"fp8 pair {name}", tbs)
            table.append((f"{name} N={n} K={k}", rows, n * k, mma, blas, quant, pair))
    print("\n| shape | rows | best W8A8 tensor-core tile us | TB/s | torch._scaled_mm us | "
          "input quantization us | best W8A16 pair tile us |\n|---|---:|---:|---:|---:|---:|---:|")
    for shape, rows, nbytes, (m_us, m_cfg), blas, quant, (p_us, p_cfg) in table:
        print(f"| {shape} | {rows} | {m_us:.1f} {m_cfg} | {nbytes / (m_us * 1e-6) / 1e12:.2f} | "
              f"{blas:.1f} | {quant:.1f} | {p_us:.1f} {p_cfg or ''} |")


def bench_w4_words():
    """The one-row 4-bit tiles that read the codes as 32-bit words (gemv_w4.WORDS_CANDIDATES
    and their split-K forms) against the HALF ones (HALF_CANDIDATES and theirs), llama-3.1-8b's
    four matmuls in groups of 128, with fp16 and bf16 inputs; every tile checked against the
    dequantized weight in fp32 (off by more than 1e-2: skipped). TB/s: the codes', scales' and
    zeros' bytes."""
    from pagedbackend.kernels import gemv_w4
    table = []
    for dt in (torch.float16, torch.bfloat16):
        for name, n, k in LLAMA_MATMULS:
            pw = random_packed_weight(n, k)
            nbytes = n * k // 2 + k // 128 * n * 3
            tbs = lambda t_us: f"{nbytes / (t_us * 1e-6) / 1e12:5.2f} TB/s"    # noqa: E731
            x = torch.randn(1, k, device=DEVICE, dtype=dt)
            ref = torch.nn.functional.linear(x.float(), pw.dequantize(torch.float32))

            def run(cfg):
                return gemv_w4.packed_gemv(x, pw, None, cfg)

            def tiles(split):
                return [c for c in gemv_w4.HALF_CANDIDATES + gemv_w4.WORDS_CANDIDATES
                        + gemv_w4.KSPLIT_CANDIDATES if c[5] == split
                        and (len(c) < 7 or k % (c[6] * 128) == 0)
                        and gemv_w4.half_fits(c, 128, pw.qweight.stride(0))]
            label = f"w4words {str(dt)[6:]} {name}"
            half = _best_tile(tiles(2), run, ref, label, tbs)
            words = _best_tile(tiles(3), run, ref, label, tbs)
            table.append((f"{str(dt)[6:]} {name} N={n} K={k}", half, words, tbs(words[0])))
    print("\n| input, shape (1 row, group 128) | best HALF tile us | best WORDS tile us "
          "| HALF / WORDS | WORDS TB/s |\n|---|---:|---:|---:|---:|")
    for shape, (h_us, h_cfg), (w_us, w_cfg), tb in table:
        print(f"| {shape} | {h_us:.1f} {h_cfg} | {w_us:.1f} {w_cfg} | {h_us / w_us:.2f}x "
              f"| {tb} |")


@triton.jit
def _read_runs_kernel(q_ptr, out_ptr, KW, k_len_w, BLOCK_N: tl.constexpr, W: tl.constexpr,
                      BLOCKED: tl.constexpr):
    """Reads program pid's BLOCK_N rows of int32 words over its split's k_len_w words, W words
    (4 W bytes) of each row an iteration, and stores their wrapped int32 sum. Row-major: row n's
    words at n * KW; BLOCKED: tile (pid, kw // W)'s BLOCK_N x W words contiguous, in the order
    the programs read them."""
    pid, ks = tl.program_id(0), tl.program_id(1)
    r, c = tl.arange(0, BLOCK_N)[:, None], tl.arange(0, W)[None, :]
    acc = tl.zeros([BLOCK_N, W], dtype=tl.int32)
    for kw in range(ks * k_len_w, (ks + 1) * k_len_w, W):
        if BLOCKED:
            off = ((pid * (KW // W) + kw // W) * BLOCK_N + r).to(tl.int64) * W + c
        else:
            off = (pid * BLOCK_N + r).to(tl.int64) * KW + kw + c
        acc += tl.load(q_ptr + off, eviction_policy="evict_first")
    tl.store(out_ptr + pid * tl.num_programs(1) + ks, tl.sum(acc))


def bench_w4_runs():
    """Where the one-row 4-bit tiles' bandwidth goes: a kernel that only reads the codes of
    gate|up and down (4-bit, int32 words, one add a word) in the tiles' pattern, BLOCK_N rows x
    W words an iteration, split-K as theirs. Row-major (the PackedWeight layout: each row's
    piece a run of 4 W bytes, rows K / 2 bytes apart) against each tile's words contiguous
    (a repacked layout). Checked: every layout's wrapped sum equals torch's. TB/s of the codes
    alone, graph-timed with the L2 flushed."""
    from pagedbackend.kernels.gemv_tuning import _time_us
    table = []
    for name, n, k in LLAMA_MATMULS[2:]:
        kw = k // 8
        words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, kw), dtype=torch.int32, device=DEVICE)
        want = int(words.sum(dtype=torch.int64).item()) % 2 ** 32
        for bn, w in ((64, 16), (64, 32), (32, 32), (16, 64), (8, 128), (16, 128), (4, 256),
                      (8, 256), (128, 16)):
            for blocked in (False, True):
                q = words
                if blocked:     # [N / bn, KW / w, bn, w]
                    q = words.view(n // bn, bn, kw // w, w).transpose(1, 2).contiguous()
                for ksplit in (1, 2, 4, 8):
                    if kw % (ksplit * w):
                        continue
                    for warps in (4, 8):
                        out = torch.empty(n // bn * ksplit, dtype=torch.int32, device=DEVICE)

                        def run():
                            _read_runs_kernel[(n // bn, ksplit)](
                                q, out, kw, kw // ksplit, BLOCK_N=bn, W=w, BLOCKED=blocked,
                                num_warps=warps)
                        try:
                            us = _time_us(run)
                        except Exception as e:      # noqa: BLE001
                            print(f"w4runs {name} {bn}x{w}: failed {e}"[:200])
                            continue
                        run()
                        ok = int(out.sum(dtype=torch.int64).item()) % 2 ** 32 == want
                        tb = n * k / 2 / (us * 1e-6) / 1e12
                        label = (f"{name} rows {bn} x {4 * w} B {'tiles' if blocked else 'rows'}"
                                 f" ksplit {ksplit} warps {warps}")
                        print(f"w4runs {label}: {us:.1f} us {tb:.2f} TB/s"
                              f"{'' if ok else ' WRONG SUM'}", flush=True)
                        if ok:
                            table.append((name, 4 * w, blocked, tb, label))
    print("\n| shape | run bytes | layout | best TB/s | read as |\n|---|---:|---|---:|---|")
    for name, _, _ in LLAMA_MATMULS[2:]:
        for run_b in sorted({t[1] for t in table if t[0] == name}):
            for blocked in (False, True):
                got = [t for t in table if t[:3] == (name, run_b, blocked)]
                if got:
                    best = max(got, key=lambda t: t[3])
                    print(f"| {name} | {run_b} | {'tiles' if blocked else 'rows'} "
                          f"| {best[3]:.2f} | {best[4]} |")


def _best_tile(tiles, run, ref=None, label="w4", tbs=None) -> tuple[float, tuple | None]:
    """(us, tile) of the fastest of tiles, run(tile) graph-timed as the tuner times; a tile
    that fails to compile or run is printed and skipped. With ref (the product in fp32) every
    tile's time (and tbs(us), if given) and relative error are printed, and a tile off by more
    than 1e-2 is skipped."""
    from pagedbackend.kernels.gemv_tuning import _time_us
    best = (float("inf"), None)
    for cfg in tiles:
        try:
            us = _time_us(lambda cfg=cfg: run(cfg))
            if ref is not None:
                y = run(cfg).float()
                err = ((y - ref).norm() / ref.norm()).item()
                print(f"{label} tile {cfg}: {us:.1f} us, {tbs(us) + ', ' if tbs else ''}"
                      f"rel err {err:.2e}")
                if not err < 1e-2:
                    continue
            best = (us, cfg) if us < best[0] else best
        except Exception as e:      # noqa: BLE001
            print(f"{label} tile {cfg}: failed: {type(e).__name__}: {e}"[:300])
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also try a few tile configs")
    ap.add_argument("--only", default="",
                    help="comma-separated parts to run: decode, mixedlen, fp8, fp8in, prefill, "
                         "mixed, elementwise, w4, w4wide, w4words, w4runs, bytes, fp8mma, "
                         "dequant (default: all)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "kernels_bench needs a CUDA GPU"
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}  SMs {num_sms(torch.cuda.current_device())}")
    parts = {"decode": lambda: bench_decode(args.sweep), "mixedlen": bench_decode_mixed_lengths,
             "fp8": bench_decode_fp8, "fp8in": bench_fp8_inputs,
             "prefill": lambda: bench_prefill(args.sweep), "mixed": bench_mixed,
             "elementwise": bench_elementwise, "w4": bench_w4, "w4wide": bench_w4_wide,
             "w4words": bench_w4_words, "w4runs": bench_w4_runs,
             "bytes": bench_bytes, "fp8mma": bench_fp8mma, "dequant": bench_dequant}
    for name in (args.only.split(",") if args.only else parts):
        parts[name]()
    print("\n| kernel | triton us | torch us | speed-up | |\n|---|---:|---:|---:|---|")
    for name, t, r, metric in ROWS:
        print(f"| {name} | {t * 1e3:.1f} | {r * 1e3:.1f} | {r / t:.2f}x | {metric} |")


if __name__ == "__main__":
    main()
