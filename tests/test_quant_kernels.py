"""The AWQ / GPTQ kernels (kernels/gemv_w4.py) against the plain-torch dequantization of the same
PackedWeight: the skinny W4A16 / W8A16 matmul for 1-8 rows and the dequantize kernel. Without
CUDA they run under TRITON_INTERPRET=1 at tiny shapes."""
import importlib

import pytest
import torch

from kernel_env import CUDA, DEV, compiled_for_hopper  # before any kernel module
pytest.importorskip("triton")

gemv_w4 = importlib.import_module("pagedbackend.kernels.gemv_w4")
from pagedbackend.layers.quant_grouped import PackedWeight  # noqa: E402



def packed_weight(n: int, k: int, bits: int, group: int) -> PackedWeight:
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, device=DEV)
    packed = codes if bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
    g = k // group
    scales = (torch.rand(g, n, device=DEV) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 1 << bits, (g, n), dtype=torch.uint8, device=DEV)
    return PackedWeight(bits, group, packed.contiguous(), scales, zeros, None, None)


def torch_dequantize(pw: PackedWeight) -> torch.Tensor:
    """PackedWeight.dequantize's torch path (float32), whatever the device."""
    g = torch.arange(pw.shape[1], device=DEV) // pw.group_size
    return (pw.codes().int() - pw.zeros.t()[:, g].int()).float() * pw.scales.t()[:, g].float()


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_packed_gemv(pw: PackedWeight, w: torch.Tensor, cfg: tuple, m: int, dtype, with_bias,
                      tol: float) -> tuple:
    """packed_gemv with tile cfg on m random rows of dtype (and a random bias) against
    x @ w.T (+ b) in fp32 (w the dequantized weight): shape, dtype and relative error below
    tol. Returns (x, b, y)."""
    n, k = pw.shape
    x = torch.randn(m, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype) if with_bias else None
    y = gemv_w4.packed_gemv(x, pw, b, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
    assert rel_err(y, ref) < tol, (m, with_bias)
    return x, b, y


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
def test_dequantize_kernel_is_the_reference_to_the_bit(bits, group):
    n, k = (4096, 4096) if CUDA else (40, 256)
    pw = packed_weight(n, k, bits, group)
    want = torch_dequantize(pw)
    assert torch.equal(gemv_w4.dequantize_packed(pw, torch.float32), want)
    got = gemv_w4.dequantize_packed(pw, torch.bfloat16).float()
    # the interpreter truncates fp32 -> bf16 where the GPU rounds: one bf16 ulp at most
    assert ((got - want).abs() <= want.abs() * 2 ** -7).all()
    # 4-bit codes to 16 bits go through the pair kernel (words of two weights): fp16 rounds
    # the same way in the interpreter and on the GPU
    assert torch.equal(gemv_w4.dequantize_packed(pw, torch.float16), want.half())


# FMA and DOT take several groups per iteration at these K; SMALL half a group
FMA, SMALL, DOT = gemv_w4.CANDIDATES[0], (16, 64, 2, 4), gemv_w4.DOT_CANDIDATES[0]


@pytest.mark.parametrize("cfg,bits,group,dtype", [
    (FMA, 4, 128, torch.float32), (FMA, 4, 32, torch.bfloat16), (FMA, 8, 64, torch.bfloat16),
    (SMALL, 4, 128, torch.bfloat16), (DOT, 4, 128, torch.bfloat16), (DOT, 4, 32, torch.float32),
    (DOT, 8, 64, torch.bfloat16)])
def test_packed_gemv_matches_dequantize_then_matmul(cfg, bits, group, dtype):
    n, k = (6144, 4096) if CUDA else (72, 256)      # N not a multiple of every BLOCK_N
    pw = packed_weight(n, k, bits, group)
    w = torch_dequantize(pw)
    tol = 1e-5 if dtype == torch.float32 and len(cfg) == 4 else 1e-2
    for m in (1, 5):
        check_packed_gemv(pw, w, cfg, m, dtype, m == 5, tol)


# SPLIT tiles (4-bit nibbles as two tiles): the first candidate (at K 256 one iteration of
# several groups) and a small one that loops (128 columns an iteration, two pieces at group 64)
SPLIT, SPLIT_SMALL = gemv_w4.SPLIT_CANDIDATES[0], (8, 128, 2, 3, False, True)


@pytest.mark.parametrize("cfg", [SPLIT, SPLIT_SMALL], ids=["split", "split_small"])
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_tiles_match_dequantize_then_matmul(cfg, group, dtype):
    """The nibble-split tiles at 1 row (no bias, then bias) and 2-8 rows, as the byte tiles are
    compared above: fp32 within 1e-5 (the sums round differently from x * w per weight, see
    _nibbles_piece), bf16 within 1e-2."""
    n, k = (6144, 4096) if CUDA else (72, 256)      # N not a multiple of every BLOCK_N
    pw = packed_weight(n, k, 4, group)
    w = torch_dequantize(pw)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for m, with_bias in ((1, False), (1, True), (2, False), (5, True), (8, False)):
        check_packed_gemv(pw, w, cfg, m, dtype, with_bias, tol)


def test_split_tiles_are_4_bit_only():
    pw8 = packed_weight(40, 128, 8, 64)
    x = torch.randn(1, 128, device=DEV).bfloat16()
    with pytest.raises(AssertionError, match="4-bit"):
        gemv_w4.packed_gemv(x, pw8, None, SPLIT)
    tuning = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning")
    assert set(gemv_w4.SPLIT_CANDIDATES) <= set(tuning._tiles(1, packed_weight(40, 128, 4, 64)))
    assert not set(gemv_w4.SPLIT_CANDIDATES) & set(tuning._tiles(1, pw8) + tuning._tiles(4, pw8))


@pytest.mark.parametrize("cfg", [gemv_w4.HALF_CANDIDATES[0], (16, 256, 4, 3, False, 2),
                                 gemv_w4.WORDS_CANDIDATES[0], (32, 128, 4, 3, False, 3)],
                         ids=["half", "half_loop", "words", "words_loop"])
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_tiles_match_dequantize_then_matmul(cfg, group, dtype):
    """The fp16-pair tiles (HALF, WORDS) at one row, with and without a bias, against the
    fp32 reference: within 1e-2 (sums of sixteen products in fp16). On the GPU this runs their
    PTX; the CPU interpreter runs its fp32 stand-in (the same sum, per byte or word)."""
    n, k = (6144, 4096) if CUDA else (256, 512)     # N a multiple of BLOCK_N: 128, 16
    pw = packed_weight(n, k, 4, group)
    if not gemv_w4.half_fits(cfg, group, pw.qweight.stride(0)):
        pytest.skip(f"{cfg} gives a thread fewer code bytes than it takes at group {group}")
    w = torch_dequantize(pw)
    for with_bias in (False, True):
        check_packed_gemv(pw, w, cfg, 1, dtype, with_bias, 1e-2)


def test_half_tiles_are_one_16_bit_row_with_8_bytes_a_thread():
    pw = packed_weight(128, 256, 4, 64)
    half, words = gemv_w4.HALF_CANDIDATES[0], gemv_w4.WORDS_CANDIDATES[0]
    for cfg in (half, words):
        for x, prologue in ((torch.randn(2, 256, device=DEV).bfloat16(), gemv_w4.PLAIN),
                            (torch.randn(1, 256, device=DEV), gemv_w4.PLAIN),
                            # a prologue only where the tile splits K
                            (torch.randn(1, 512, device=DEV).bfloat16(), gemv_w4.SILU_MUL)):
            with pytest.raises(AssertionError, match="HALF / WORDS tile"):
                gemv_w4.packed_gemv(x, pw, None, cfg, prologue)
    # 16 rows x a 64-column piece (32 bytes) over 128 threads: 4 bytes a thread
    assert gemv_w4.half_fits((16, 1024, 4, 3, False, 2), 128)
    assert not gemv_w4.half_fits((16, 1024, 4, 3, False, 2), 64)
    # WORDS: 16 bytes a thread in one load, so rows of codes a multiple of 16 bytes
    assert gemv_w4.half_fits((32, 128, 4, 3, False, 3), 128, 2048)
    assert not gemv_w4.half_fits((32, 128, 4, 3, False, 3), 64, 2048)
    assert not gemv_w4.half_fits((32, 128, 4, 3, False, 3), 128, 2056)
    tuning = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning")
    one = set(tuning._tiles(1, pw))
    assert {half, words} <= one and (16, 1024, 4, 3, False, 2) not in one
    # K 200: 100 code bytes a row
    assert not set(gemv_w4.WORDS_CANDIDATES) & set(tuning._tiles(1, packed_weight(128, 200, 4,
                                                                                   40)))
    for cands in (gemv_w4.HALF_CANDIDATES, gemv_w4.WORDS_CANDIDATES):
        assert not set(cands) & (set(tuning._tiles(1, pw, torch.float32))
                                 | set(tuning._tiles(2, pw)))
        assert not set(cands) & set(tuning._tiles(1, packed_weight(40, 128, 8, 64)))


@pytest.mark.parametrize("cfg", [(64, 256, 4, 3, False, 2, 4), (16, 128, 2, 3, False, 2, 2),
                                 (128, 256, 4, 3, False, 3, 4), (32, 128, 2, 3, False, 3, 2),
                                 (16, 1024, 4, 3, False, True, 2), (8, 128, 2, 3, False, True, 4),
                                 (16, 64, 2, 4, False, 0, 2)],
                         ids=["half4", "half2_loop", "words4", "words2_loop", "split2",
                              "split4_loop", "byte2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_split_k_tiles_match_dequantize_then_matmul(cfg, dtype, monkeypatch):
    """K split over programs whose last adds the fp32 sums: one row, with and without a bias,
    as the tiles without a split are compared (fp32 1e-5, 16-bit 1e-2); the same bits on a
    second launch (the count of finished splits went back to 0, the sum's order is fixed) and
    after a launch of another shape (the workspace is shared). On the CPU interpreter also with
    the programs run last to first: another split ends last, and the bits must not change
    (split_k_sum adds the splits in split order, whichever ends last)."""
    if cfg[5] in (2, 3) and dtype == torch.float32:
        pytest.skip("HALF and WORDS tiles take a 16-bit row")
    n, k = (6160, 4096) if CUDA else (80, 512)      # N not a multiple of every BLOCK_N
    group = 64
    pw = packed_weight(n, k, 4, group)
    w = torch_dequantize(pw)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for with_bias in (False, True):
        x, b, y = check_packed_gemv(pw, w, cfg, 1, dtype, with_bias, tol)
        other = packed_weight(2 * n, k, 4, group)
        gemv_w4.packed_gemv(x, other, None, cfg)
        assert torch.equal(gemv_w4.packed_gemv(x, pw, b, cfg), y)
        if not CUDA:
            with monkeypatch.context() as mp:
                run_programs_last_to_first(mp)
                assert torch.equal(gemv_w4.packed_gemv(x, pw, b, cfg), y), with_bias
    counts = gemv_w4._SPLIT_K[(x.device, "counts")]
    assert not counts.any(), "a tile's count of finished splits was left behind"


def test_split_k_tiles_take_whole_groups():
    pw = packed_weight(64, 512, 4, 128)
    cfg = (16, 128, 2, 3, False, True, 2)
    x = torch.randn(1, 512, device=DEV).bfloat16()
    with pytest.raises(AssertionError, match="split-K tile"):    # 512 = 2 x 2 groups, not 8
        gemv_w4.packed_gemv(x, pw, None, cfg[:6] + (8,))
    tuning = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning")
    one = set(tuning._tiles(1, pw))
    # K 512 of group 128: splits of 2 and 4 fit, 8 does not
    assert {c for c in gemv_w4.KSPLIT_CANDIDATES if c[6] <= 4} <= one
    assert not {c for c in gemv_w4.KSPLIT_CANDIDATES if c[6] == 8} & one
    assert not set(gemv_w4.KSPLIT_CANDIDATES) & (set(tuning._tiles(2, pw))
                                                 | set(tuning._tiles(1, packed_weight(
                                                     64, 512, 8, 128))))
    # fp32 rows: the split-K SPLIT tiles, not the HALF ones
    fp32 = {c for c in gemv_w4.KSPLIT_CANDIDATES if c[6] <= 4} & set(
        tuning._tiles(1, pw, torch.float32))
    assert fp32 and all(c[5] is True for c in fp32)


# compiled for sm_90 by compiled_for_hopper; prints each swap-AB tile's wgmma (all, bf16) and
# lop3 instruction counts in its SASS
HOPPER_SWAP = """
import sys
from pagedbackend.kernels import gemv_w4
for arg in sys.argv[1:]:
    i, dt = arg.split(":")
    _, block_n, block_m, sub_k, warps, stages, split = gemv_w4.SWAP_CANDIDATES[int(i)]
    const = dict(GROUP=128, BITS=4, BLOCK_N=block_n, BLOCK_M=block_m, SUB_K=sub_k,
                 HAS_BIAS=True, SPLIT=int(split), PRECISION="tf32", USE_PDL=True)
    ptrs = {"x_ptr": "*" + dt, "q_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8",
            "b_ptr": "*" + dt, "y_ptr": "*" + dt}
    sass = sm90_tool(gemv_w4._swap_gemm_kernel, const, ptrs, warps, stages, "nvdisasm", "-c")
    print(arg, sass.count("HGMMA"), sass.count(".BF16"), sass.count("LOP3.LUT"))
"""


@pytest.mark.skipif(CUDA, reason="the GPU runs the tiles themselves (w4wide)")
def test_swap_pair_tiles_compile_for_hopper_to_wgmma():
    """Compiled for sm_90 on this machine (ptxas checks the inline PTX, which the interpreter
    does not run): the swap-AB pair tiles' bf16 and fp16 forms multiply on wgmma in their own
    type, their codes opened by lop3."""
    i = next(j for j, c in enumerate(gemv_w4.SWAP_CANDIDATES) if c[6] == 2)
    out = compiled_for_hopper(HOPPER_SWAP, f"{i}:bf16", f"{i}:fp16").split()
    got = {out[j]: tuple(map(int, out[j + 1:j + 4])) for j in range(0, len(out), 4)}
    assert set(got) == {f"{i}:bf16", f"{i}:fp16"}, out
    for arg, (mma, bf16, lop3) in got.items():
        assert mma > 0 and lop3 > 0 and (bf16 > 0) == ("bf16" in arg), got


PACKED_SM90 = """
import re
import sys
from pagedbackend.kernels import gemv_w4


def packed_tool(cfg, dt, ksplit, group, block_m, tool, *flags, prologue=0):
    # _packed_gemv_kernel with tile cfg (K 4,096, dt inputs) through sm90_tool
    block_n, block_k, warps, stages, use_dot = cfg[:5]
    split = 0 if use_dot else cfg[5]
    sub_k, block_k = gemv_w4._tile_k(block_k, group, 4096 // ksplit)
    const = dict(GROUP=group, BITS=4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                 SUB_K=sub_k, HAS_BIAS=False, SPLIT=split, KSPLIT=ksplit, USE_DOT=use_dot,
                 PRECISION="tf32", PROLOGUE=prologue, USE_PDL=True, PREFETCH=True,
                 IN_CHUNK=512 if prologue else 1)
    ptrs = {n: "*" + dt for n in ("x_ptr", "b_ptr", "y_ptr", "r_ptr", "r_out_ptr", "g_ptr",
                                  "xs_ptr")}
    ptrs.update(q_ptr="*u8", s_ptr="*fp16", z_ptr="*u8", ws_ptr="*fp32", cnt_ptr="*i32",
                ss_ptr="*fp32")
    return sm90_tool(gemv_w4._packed_gemv_kernel, const, ptrs, warps, stages, tool, *flags)
"""
# compiled for sm_90 by compiled_for_hopper; prints each one-row WORDS tile's registers and its
# SASS counts of lop3, fp16-pair FMAs and cp.async (LDGSTS); a tile is an index into
# WORDS_CANDIDATES
HOPPER_WORDS = PACKED_SM90 + """
for arg in sys.argv[1:]:
    i, dt, ksplit, group, prologue = (arg + ":128:0").split(":")[:5]
    cfg = gemv_w4.WORDS_CANDIDATES[int(i)]
    usage = packed_tool(cfg, dt, int(ksplit), int(group), 1, "cuobjdump",
                        "--dump-resource-usage", prologue=int(prologue))
    sass = packed_tool(cfg, dt, int(ksplit), int(group), 1, "nvdisasm", "-c",
                       prologue=int(prologue))
    print(arg, re.search(r"REG:(\\d+)", usage).group(1), sass.count("LOP3.LUT"),
          sass.count("HFMA2"), sass.count("LDGSTS"))
"""


def words_tiles_compile_plain(args: list[str]) -> None:
    """HOPPER_WORDS on args (index:dtype:ksplit[:group[:prologue]]): each compiles, lop3 opens
    the codes, fp16-pair FMAs multiply, no cp.async, at most 128 registers a thread."""
    out = compiled_for_hopper(HOPPER_WORDS, *args).split()
    got = {out[j]: tuple(map(int, out[j + 1:j + 5])) for j in range(0, len(out), 5)}
    assert set(got) == set(args), out
    for arg, (regs, lop3, hfma2, cp_async) in got.items():
        assert regs <= 128 and lop3 >= 16 and hfma2 >= 32 and cp_async == 0, (arg, got)


@pytest.mark.skipif(CUDA, reason="compiled for sm_90 on a machine without a GPU")
def test_words_tiles_compile_for_hopper():
    """ptxas takes the WORDS tiles' PTX (the interpreter does not run it) in its three forms:
    one piece an iteration loaded an iteration ahead (BLOCK_K one piece), two pieces the same
    way (group 128, BLOCK_K 256), and four pieces loaded in their iteration (group 64); with
    fp16 and bf16 inputs, whole-K and split-K: lop3 opens the codes, fp16-pair FMAs multiply,
    and a thread keeps to at most 128 registers (four programs of 4 warps a SM)."""
    ahead = next(i for i, c in enumerate(gemv_w4.WORDS_CANDIDATES) if c[1] == 128)
    pieces = next(i for i, c in enumerate(gemv_w4.WORDS_CANDIDATES) if c[1] == 256)
    args = [f"{ahead}:fp16:1", f"{ahead}:bf16:4", f"{pieces}:fp16:2", f"{pieces}:bf16:1",
            f"{pieces}:fp16:1:64"]
    words_tiles_compile_plain(args)


@pytest.mark.skipif(CUDA, reason="compiled for sm_90 on a machine without a GPU")
def test_split_k_words_tiles_with_a_prologue_compile_for_hopper():
    """The two-piece WORDS tile with each prologue before its split of K (residual add +
    RMSNorm, RMSNorm, SiLU * up): ptxas takes it, the loop's PTX is the plain tile's (lop3,
    fp16-pair FMAs, no cp.async) and a thread keeps to at most 128 registers."""
    two = next(i for i, c in enumerate(gemv_w4.WORDS_CANDIDATES) if c[1] == 256)
    args = [f"{two}:bf16:2:128:2", f"{two}:fp16:8:128:1", f"{two}:bf16:4:128:3"]
    words_tiles_compile_plain(args)


# compiled for sm_90: each DOT_CANDIDATES tile at 8 rows, its count of cp.async (LDGSTS)
HOPPER_DOT = PACKED_SM90 + """
for cfg in gemv_w4.DOT_CANDIDATES:      # 8 rows: BLOCK_M 16, as packed_gemv pads them
    print(packed_tool(cfg, "bf16", 1, 128, 16, "nvdisasm", "-c").count("LDGSTS"))
"""


@pytest.mark.skipif(CUDA, reason="compiled for sm_90 on a machine without a GPU")
def test_tensor_core_tiles_keep_their_pipelined_loads():
    """The 2-8 row tensor-core tiles' loads stay pipelined through shared memory by the
    launch's num_stages: the loop a plain range leaves it to them (an explicit num_stages=1
    on the loop took their cp.async away)."""
    counts = list(map(int, compiled_for_hopper(HOPPER_DOT).split()))
    assert len(counts) == len(gemv_w4.DOT_CANDIDATES) and min(counts) > 0, counts


def test_block_k_stays_inside_a_group():
    assert gemv_w4._block_k(128, 128) == 128 and gemv_w4._block_k(128, 64) == 64
    assert gemv_w4._block_k(128, 48) == 16 and gemv_w4._block_k(64, 256) == 64
    # whole groups per iteration, dividing K: 576 = 9 groups of 64
    assert gemv_w4._tile_k(1024, 128, 4096) == (128, 1024)
    assert gemv_w4._tile_k(512, 64, 576) == (64, 192) and gemv_w4._tile_k(64, 128, 256) == (64, 64)


@pytest.mark.skipif(not CUDA, reason="the tile is timed on the device")
def test_packed_linear_tunes_and_agrees_at_every_width():
    """The layer's GPU path: a tuned tile (or dequantize + cuBLAS where none beats it) for 1-8
    rows, dequantize + cuBLAS above; all within a bf16 matmul's rounding of the reference."""
    pw = packed_weight(4096, 4096, 4, 128)
    w = torch_dequantize(pw)
    for m in (1, 2, 8, 64):
        x = torch.randn(m, 4096, device=DEV).bfloat16()
        y = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning").packed_linear(
            x, pw, None)
        assert rel_err(y, x.float() @ w.t()) < 1e-2, m


@pytest.mark.parametrize("cfg", [(16, 512, 4, 3), (32, 256, 4, 4, True)], ids=["fma", "dot"])
def test_skinny_linear_reads_int8_weights(cfg):
    """quantization="int8": the 16-bit skinny kernel reads int8 weights as it reads e4m3 ones
    (the per-channel scale multiplies the finished products)."""
    from pagedbackend.kernels.gemv import skinny_linear
    from pagedbackend.layers.quantization import dequantize, quantize_weight_int8
    n, k = (6144, 4096) if CUDA else (48, 200)
    wq, s = quantize_weight_int8(torch.randn(n, k, device=DEV) / k ** 0.5)
    w = dequantize(wq, s, torch.float32)
    for m in (1, 3):
        x = torch.randn(m, k, device=DEV).bfloat16()
        y = skinny_linear(x, wq, None, cfg, weight_scale=s)
        assert y.dtype == torch.bfloat16 and rel_err(y, x.float() @ w.t()) < 1e-2, m


@pytest.mark.parametrize("bits,group,dtype", [(4, 32, torch.float32), (4, 128, torch.bfloat16),
                                               (8, 64, torch.bfloat16)])
def test_swap_ab_gemm_tiles(bits, group, dtype):
    """The swap-AB GEMM tiles (the weight the dot's first operand, the output stored
    transposed): the product of the dequantized weight, with a bias, at rows and outputs that
    are not multiples of the tile; SPLIT ones offered for 4-bit codes only, pair ones (SPLIT 2)
    for 16-bit inputs too, no prologue."""
    from pagedbackend.kernels.gemv import NORM
    tuning = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning")
    n, k = (4096, 4096) if CUDA else (40, 256)
    cfgs = gemv_w4.SWAP_CANDIDATES if CUDA else (("t", 32, 16, 64, 4, 2, False),
                                                 ("t", 32, 16, 64, 4, 2, True),
                                                 ("t", 32, 16, 64, 4, 2, 2))
    if CUDA and dtype == torch.float32:     # fp32 input tiles of 256 rows overflow shared memory
        cfgs = [c for c in cfgs if c[2] <= 128]
    cfgs = [c for c in cfgs if not c[6] or bits == 4 and (c[6] != 2 or dtype != torch.float32)]
    pw = packed_weight(n, k, bits, group)
    w = torch_dequantize(pw)
    x = torch.randn(300 if CUDA else 37, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype)
    for cfg in cfgs:
        y = gemv_w4.packed_gemv(x, pw, b, cfg)
        assert y.shape == (x.shape[0], n) and y.dtype == dtype
        assert rel_err(y, x.float() @ w.t() + b.float()) < \
            (1e-5 if dtype == torch.float32 else 1e-2), cfg
    offered = set(tuning._tiles(16, pw))
    assert all((c in offered) == (not c[6] or bits == 4) for c in gemv_w4.SWAP_CANDIDATES)
    pairs = {c for c in gemv_w4.SWAP_CANDIDATES if c[6] == 2}
    assert pairs and not pairs & set(tuning._tiles(16, pw, torch.float32))
    if bits == 4:
        with pytest.raises(AssertionError, match="16-bit input"):
            gemv_w4.packed_gemv(x.float(), pw, None, min(pairs))
    assert not set(gemv_w4.SWAP_CANDIDATES) & set(tuning._tiles(8, pw))     # decode steps
    assert set(tuning._tiles(16, pw)) <= set(gemv_w4.SWAP_CANDIDATES)
    with pytest.raises(AssertionError, match="no prologue"):
        gemv_w4.packed_gemv(x, pw, None, cfgs[0], NORM, None, torch.ones(k, device=DEV), 1e-5)


def test_wide_steps_run_dequantize_and_matmul_untimed(monkeypatch):
    """Above MAX_TUNED_ROWS packed_linear multiplies by the dequantized weight without timing
    a tile (a rows bucket first seen mid-serving would stall its step for the tuning); at
    MAX_TUNED_ROWS rows it still asks the tuner."""
    tuning = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning")
    calls = []
    monkeypatch.setattr(tuning, "_config", lambda x, *a: calls.append(x.shape[0]))
    pw = packed_weight(24, 64, 4, 32)
    w = torch_dequantize(pw)
    x = torch.randn(tuning.MAX_TUNED_ROWS + 1, 64, device=DEV)
    assert rel_err(tuning.packed_linear(x, pw, None), x @ w.t()) < 1e-6 and calls == []
    assert rel_err(tuning.packed_linear(x[:-1], pw, None), x[:-1] @ w.t()) < 1e-6
    assert calls == [tuning.MAX_TUNED_ROWS]


@pytest.mark.parametrize("cfg", [gemv_w4.CANDIDATES[1], gemv_w4.DOT_CANDIDATES[1], SPLIT],
                         ids=["fma", "dot", "split"])
def test_packed_gemv_prologues(cfg):
    """gemv.py's prologues inside the W4A16 kernel: residual add + RMSNorm (the sum written
    once), RMSNorm alone, SiLU(gate) * up, each against the separate op then the matmul."""
    from pagedbackend.kernels.gemv import ADD_NORM, NORM, SILU_MUL
    from pagedbackend.layers import activation, norm
    n, k = (4096, 4096) if CUDA else (40, 128)
    pw = packed_weight(n, k, 4, 64)
    w = torch_dequantize(pw)
    for m in (1, 3):
        x, r = (torch.randn(m, k, device=DEV).bfloat16() for _ in range(2))
        g = (1 + 0.5 * torch.randn(k, device=DEV)).bfloat16()
        y, r_out = gemv_w4.packed_gemv(x, pw, None, cfg, ADD_NORM, r, g, 1e-5)
        h = norm.fused_add_rms_norm_torch(x, r, g, 1e-5)[0]
        assert rel_err(y, h.float() @ w.t()) < 2e-2 and rel_err(r_out, x.float() + r.float()) < 1e-2
        y = gemv_w4.packed_gemv(x, pw, None, cfg, NORM, None, g, 1e-5)
        h = norm.fused_add_rms_norm_torch(x, torch.zeros_like(x), g, 1e-5)[0]
        assert rel_err(y, h.float() @ w.t()) < 2e-2
        gate_up = torch.randn(m, 2 * k, device=DEV).bfloat16()
        y = gemv_w4.packed_gemv(gate_up, pw, None, cfg, SILU_MUL)
        assert rel_err(y, activation.silu_and_mul_torch(gate_up).float() @ w.t()) < 2e-2


def run_programs_last_to_first(monkeypatch) -> None:
    """Under TRITON_INTERPRET=1 (which runs a launch's programs one by one, in grid order),
    run them in the reverse order on every axis."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    set_idx = type(builder).set_grid_idx

    def reversed_idx(self, x, y, z):
        gx, gy, gz = self.grid_dim
        set_idx(self, gx - 1 - x, gy - 1 - y, gz - 1 - z)
    monkeypatch.setattr(type(builder), "set_grid_idx", reversed_idx)


@pytest.mark.parametrize("cfg", [(32, 128, 2, 3, False, 3, 2), (16, 128, 2, 3, False, 2, 4),
                                 (8, 128, 2, 3, False, True, 8), (32, 256, 2, 3, False, 3, 4)]
                         + ([gemv_w4.KSPLIT_CANDIDATES[3], gemv_w4.KSPLIT_CANDIDATES[9]] if CUDA
                            else []),
                         ids=["words2", "half4", "split8", "words4_loop"]
                         + (["half8_real", "words8_2pc_real"] if CUDA else []))
def test_split_k_prologues(cfg, monkeypatch):
    """The prologues in a split-K tile (each split turns its own columns of the input into the
    matmul's, _split_input; the norms' 1/rms from every split's sum of squares): residual add
    + RMSNorm (the sum written whole, equal to the separate kernel's), RMSNorm alone,
    SiLU(gate) * up, each against the separate op then the same tile without a prologue, and
    the same bits on a second launch (the splits' scratch and counts shared by launches).
    The CPU interpreter runs the programs last to first here: a program that read another's
    scratch rows (the WORDS tiles read program 0's until H100 call 87's parity test showed
    it) would then read rows not yet written, as on the GPU."""
    from pagedbackend.kernels.gemv import ADD_NORM, NORM, SILU_MUL
    from pagedbackend.layers import activation, norm
    n, k = (4096, 4096) if CUDA else (80, 1024)     # N not a multiple of every BLOCK_N
    pw = packed_weight(n, k, 4, 64)
    rows = (1, 3) if cfg[5] is True else (1,)
    if not CUDA:
        run_programs_last_to_first(monkeypatch)
        gemv_w4.poison_prologue_scratch(torch.device(DEV))   # not what earlier tests left
    for m in rows:
        x, r = (torch.randn(m, k, device=DEV).bfloat16() for _ in range(2))
        g = (1 + 0.5 * torch.randn(k, device=DEV)).bfloat16()
        h, res = norm.fused_add_rms_norm_torch(x, r, g, 1e-5)
        y, r_out = gemv_w4.packed_gemv(x, pw, None, cfg, ADD_NORM, r, g, 1e-5)
        # (the interpreter's rounding to bf16 is not the GPU's, nor torch's, to the bit)
        assert torch.equal(r_out, res) if CUDA else rel_err(r_out, res) < 1e-2
        assert rel_err(y, gemv_w4.packed_gemv(h, pw, None, cfg)) < 1e-2, m
        assert torch.equal(gemv_w4.packed_gemv(x, pw, None, cfg, ADD_NORM, r, g, 1e-5)[0], y)
        y = gemv_w4.packed_gemv(x, pw, None, cfg, NORM, None, g, 1e-5)
        h = norm.rms_norm_torch(x, g, 1e-5)
        assert rel_err(y, gemv_w4.packed_gemv(h, pw, None, cfg)) < 1e-2, m
        gate_up = torch.randn(m, 2 * k, device=DEV).bfloat16()
        y = gemv_w4.packed_gemv(gate_up, pw, None, cfg, SILU_MUL)
        assert rel_err(y, gemv_w4.packed_gemv(activation.silu_and_mul_torch(gate_up), pw, None,
                                              cfg)) < 1e-2, m
    counts = gemv_w4._SPLIT_K[(x.device, "counts")]
    assert not counts.any(), "a tile's count of finished splits was left behind"


@pytest.mark.skipif(not CUDA, reason="the choice is timed on the device")
def test_tuned_prologue_choice_gives_the_separate_ops_result():
    """Whether the tuner put the norm / SiLU * up inside the W4A16 kernel or left it to its own
    kernel (None: the caller runs it), the layer's result is the separate ops' one."""
    from pagedbackend.layers import activation, norm
    tuning = importlib.import_module("pagedbackend.kernels.gemv_w4_tuning")
    pw = packed_weight(4096, 4096, 4, 128)
    w = torch_dequantize(pw)
    for m in (1, 4):
        x, r = (torch.randn(m, 4096, device=DEV).bfloat16() for _ in range(2))
        g = (1 + 0.5 * torch.randn(4096, device=DEV)).bfloat16()
        out = tuning.maybe_packed_norm_linear(x, r, g, 1e-5, pw, None)
        h, res = norm.fused_add_rms_norm_torch(x, r, g, 1e-5)
        if out is not None:
            assert rel_err(out[0], h.float() @ w.t()) < 2e-2 and torch.equal(out[1], res)
        gate_up = torch.randn(m, 2 * 4096, device=DEV).bfloat16()
        y = tuning.maybe_packed_silu_linear(gate_up, pw)
        if y is not None:
            assert rel_err(y, activation.silu_and_mul_torch(gate_up).float() @ w.t()) < 2e-2
        key = tuning._key(x, pw, tuning.ADD_NORM)
        assert key in tuning._CHOICE and tuning._key(x, pw, tuning.PLAIN) in tuning._CHOICE


def test_tuner_check_scales_with_the_output():
    """The tuner's agreement check (gemv_tuning.agrees) at a 4-bit down_proj's K with AWQ-sized
    scales: the exact product, rounded to bf16, agrees with the bf16 dequantize + matmul
    reference (whose own rounding near zero exceeds a fixed 2e-2), while a tile that sums the
    wrong columns, or is off by a tenth of the output's RMS at one value, does not."""
    from pagedbackend.kernels.gemv_tuning import _pattern, agrees
    torch.manual_seed(0)
    n, k = 256, 14336
    g = k // 128
    pw = PackedWeight(4, 128, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                      (torch.rand(g, n) * 0.02).half(), torch.randint(0, 16, (g, n),
                                                                      dtype=torch.uint8),
                      None, None)
    x = _pattern(1, k, 0.0, torch.bfloat16, "cpu")
    exact = torch.nn.functional.linear(x.float(), pw.dequantize(torch.float32))
    ref16 = torch.nn.functional.linear(x, pw.dequantize(torch.bfloat16)).float()
    assert (exact - ref16).abs().max() > 2e-2        # the case a fixed floor rejected
    assert agrees(exact.bfloat16(), ref16) and agrees(exact.bfloat16(), exact)
    rms = exact.pow(2).mean().sqrt()
    off = exact.clone()
    off[0, 3] += 0.1 * rms
    shifted = torch.nn.functional.linear(torch.roll(x, 2, 1).float(), pw.dequantize(torch.float32))
    assert not agrees(off, exact) and not agrees(shifted, exact)
