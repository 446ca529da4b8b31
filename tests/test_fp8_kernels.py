"""quantization="fp8"'s newer kernels. The FP8 GEMM's input quantized by the op before it
(layers/fp8_inputs.py): the RMSNorm and SiLU·mul kernels that write e4m3 rows and per-row scales
must give, bit for bit, what the separate kernels give (norm or activation in the model's dtype,
then kernels.quant's per-row quantization), and the layers must take that path on CUDA only
where it applies. The skinny matmul's one-row tiles that widen e4m3 with integer ops
(gemv.FP8_WIDEN_CANDIDATES) must give the sums of the same tile with triton's conversion.

Without CUDA the kernels run under TRITON_INTERPRET=1 at tiny shapes (as in test_kernels.py)."""
import importlib

import pytest
import torch

from kernel_env import CUDA, DEV, compiled_for_hopper  # before any kernel module
pytest.importorskip("triton")



def kernels(name):
    return importlib.import_module(f"pagedbackend.kernels.{name}")


def prologue_inputs(prologue: str, m: int, k: int, dt: torch.dtype):
    """(kind, x, args) for skinny_linear's prologue: m random rows of x (gate | up for
    SiLU·mul) and, for add + RMSNorm, a random residual and gain (None, None, 0.0 otherwise)."""
    gemv = kernels("gemv")
    kind = {"plain": gemv.PLAIN, "add_norm": gemv.ADD_NORM, "silu_mul": gemv.SILU_MUL}[prologue]
    x = torch.randn(m, 2 * k if kind == gemv.SILU_MUL else k, device=DEV).to(dt)
    r = torch.randn(m, k, device=DEV).to(dt)
    g = (1 + 0.3 * torch.randn(k, device=DEV)).to(dt)
    return kind, x, (r, g, 1e-5) if kind == gemv.ADD_NORM else (None, None, 0.0)


def tile_and_reference(cfg, ref_cfg, x, wq, s, kind, args):
    """skinny_linear on the same inputs with tile cfg and with ref_cfg: (y, ref). With add +
    RMSNorm the two residual sums must be bit-equal, and the products are returned."""
    gemv = kernels("gemv")
    y = gemv.skinny_linear(x, wq, None, cfg, kind, *args, weight_scale=s)
    ref = gemv.skinny_linear(x, wq, None, ref_cfg, kind, *args, weight_scale=s)
    if kind == gemv.ADD_NORM:
        assert torch.equal(y[1], ref[1])
        y, ref = y[0], ref[0]
    return y, ref


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def assert_same_quantized(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_quant_equals_norm_then_quantize(residual, dtype):
    norm, quant = kernels("norm"), kernels("quant")
    rows, n = (300, 4096) if CUDA else (6, 96)
    # rows some decades apart, one all zero (scale MIN_SCALE, zeros), and a 3-D input
    x = (torch.randn(2, rows // 2, n, device=DEV)
         * torch.logspace(-2, 2, rows // 2, device=DEV)[None, :, None]).to(dtype)
    x[1, 0] = 0
    r = torch.randn_like(x) if residual else None
    if residual:
        r[1, 0] = 0
    g = (1 + 0.3 * torch.randn(n, device=DEV)).to(dtype)
    q, s, new_r = norm.rms_norm_quant_fp8(x, r, g, 1e-5)
    if residual:
        h, ref_r = norm.fused_add_rms_norm(x, r, g, 1e-5)
        assert torch.equal(new_r, ref_r)
    else:
        h = norm.rms_norm(x, g, 1e-5)
        assert new_r is None
    assert q.shape == (rows, n) and s.shape == (rows, 1)
    want = quant.quantize_rows_fp8(h.reshape(rows, n))
    if CUDA and dtype == torch.float32:
        # In fp32 nothing rounds the normed row, and the quantizing specialization of the norm
        # kernel may sum the squares in another order than the plain one (the H200 showed
        # scales apart in their last bits): the same scales within 4 ulps, the codes at most
        # one e4m3 step apart. In bf16 the rounding to the activation dtype makes them equal.
        rel = ((s - want[1]).abs() / want[1]).max()
        assert rel <= 2 ** -21
        steps = (q.view(torch.uint8).int() - want[0].view(torch.uint8).int()).abs()
        assert steps.max() <= 1 and (steps == 0).float().mean() > 0.999
    else:
        assert_same_quantized((q, s), want)
    assert (q[rows // 2].float() == 0).all()
    # and the rows it stands for are the norm's, within e4m3's rounding (half a step, 1/16
    # relative; the interpreter's e4m3 carry quirk, test_kernels.py, halves a few values)
    from pagedbackend.layers.norm import fused_add_rms_norm_torch, rms_norm_torch
    xf, gf = x.float(), g.float()
    exact = rms_norm_torch(xf, gf, 1e-5) if r is None \
        else fused_add_rms_norm_torch(xf, r.float(), gf, 1e-5)[0]
    exact = exact.reshape(rows, n)
    rel = ((q.float() * s - exact).abs() / exact.abs().clamp(min=1e-30))[exact.abs() > s / 8]
    assert rel.median() < 1 / 16 and (rel < 0.07).float().mean() > (0.999 if CUDA else 0.95)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_quant_equals_activation_then_quantize(dtype):
    act, quant = kernels("activation"), kernels("quant")
    t, i = (300, 14336) if CUDA else (5, 150)
    x = (2 * torch.randn(t, 2 * i, device=DEV)
         * torch.logspace(-2, 1, t, device=DEV)[:, None]).to(dtype)
    x[2] = 0
    want = quant.quantize_rows_fp8(act.silu_and_mul(x))
    # the whole row in registers (the default at these widths), then two passes over it in
    # blocks (on the CPU 64 columns: three iterations per pass, the last one masked)
    for block in (None, act.QUANT_BLOCK if CUDA else 64):
        q, s = act.silu_and_mul_quant_fp8(x, block)
        assert q.shape == (t, i)
        assert_same_quantized((q, s), want)
        assert (q[2].float() == 0).all()
        assert (q.float().abs().amax(dim=1)[[0, 1, 3, 4]] == 448).all()
        # a 3-D input whose rows are a view into a wider buffer
        wide = torch.randn(2, 2, 2 * i + 64, device=DEV).to(dtype)[..., :2 * i]
        assert_same_quantized(act.silu_and_mul_quant_fp8(wide, block),
                              quant.quantize_rows_fp8(act.silu_and_mul(wide).reshape(4, i)))


@pytest.mark.skipif(CUDA, reason="the CPU path: torch's CPU _scaled_mm takes per-channel "
                    "scales from torch 2.13 (the Makefile's CPU build) on, not the GPU host's")
def test_fp8_norm_and_silu_linear_compose_the_separate_steps():
    """The layer functions (plain torch off CUDA): the same numbers as norm, then fp8_linear."""
    from pagedbackend.layers import fp8_inputs
    from pagedbackend.layers.activation import silu_and_mul_torch
    from pagedbackend.layers.norm import fused_add_rms_norm_torch, rms_norm_torch
    from pagedbackend.layers.quantization import fp8_linear, quantize_weight_fp8
    torch.manual_seed(0)
    x, r = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    g, b = 1 + 0.2 * torch.randn(64), torch.randn(48)
    wq, sw = quantize_weight_fp8(torch.randn(48, 64) / 8)
    y, new_r = fp8_inputs.fp8_norm_linear(x, r, g, 1e-6, wq, sw, b)
    h, ref_r = fused_add_rms_norm_torch(x, r, g, 1e-6)
    assert torch.equal(new_r, ref_r) and torch.equal(y, fp8_linear(h, wq, sw, b))
    y, same = fp8_inputs.fp8_norm_linear(x, None, g, 1e-6, wq, sw, None)
    assert same is x and torch.equal(y, fp8_linear(rms_norm_torch(x, g, 1e-6), wq, sw))
    wq2, sw2 = quantize_weight_fp8(torch.randn(48, 32) / 8)
    gu = torch.randn(2, 5, 64)
    assert torch.equal(fp8_inputs.fp8_silu_linear(gu, wq2, sw2),
                       fp8_linear(silu_and_mul_torch(gu), wq2, sw2))
    # off CUDA, or with bf16 weights, the layers keep the separate path
    assert not fp8_inputs.fused_quant_active(x, wq)


@pytest.mark.skipif(not CUDA, reason="the layers take the fused path on CUDA only")
def test_layers_fused_quant_path_equals_the_separate_one(monkeypatch):
    """norm_linear and forward_silu_mul at 64 rows (past the skinny kernel's) with fp8 weights:
    the fused path gives the separate path's output and residual bit for bit."""
    from pagedbackend.layers import fp8_inputs
    from pagedbackend.layers.linear import ColumnParallelLinear, RowParallelLinear, norm_linear
    from pagedbackend.layers.norm import RMSNorm
    from pagedbackend.layers.quantization import quantize_model_fp8
    h, inter, dt = 1024, 2048, torch.bfloat16
    norm = RMSNorm(h, 1e-5, dt, DEV)
    norm.weight.data.normal_(1.0, 0.3)
    mlp = torch.nn.Module()
    mlp.gate_up = ColumnParallelLinear(h, [inter, inter], False, dt, DEV)
    mlp.down = RowParallelLinear(inter, h, False, dt, DEV)
    for p in (mlp.gate_up.weight, mlp.down.weight):
        p.data.normal_(0, p.shape[1] ** -0.5)
    assert quantize_model_fp8(mlp) == 2
    x, r = (torch.randn(64, h, device=DEV, dtype=dt) for _ in range(2))
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(fp8_inputs, "FUSED_QUANT", fused)
        assert fp8_inputs.fused_quant_active(x, mlp.gate_up.weight, norm.weight) == fused
        gu, new_r = norm_linear(x, r, norm, mlp.gate_up)
        outs.append((gu, new_r, mlp.down.forward_silu_mul(gu)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("prologue", ["plain", "add_norm", "silu_mul"])
def test_skinny_fp8_integer_widening_gives_the_same_sums(prologue):
    """WIDEN 1 (triton-language bit placement) and 2 (PTX; on the CPU interpreter it runs 1)
    against the same tile widening with triton's cast: equal sums, zeros and e4m3 subnormals
    included, at 1 row (the tuner's use) and, on the CPU, 3."""
    from pagedbackend.kernels import gemv
    from pagedbackend.layers.quantization import quantize_weight_fp8
    n, k = (4096, 4096) if CUDA else (40, 200)
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    w[0, :7] = 0
    w[1, :9] = w[1].abs().max() * 2.0 ** -16        # e4m3 subnormals once scaled
    wq, s = quantize_weight_fp8(w)
    assert ((wq.view(torch.uint8) & 0x78) == 0).logical_and(wq.float() != 0).any()
    dt = torch.bfloat16 if CUDA else torch.float32
    # on the GPU every tile (the PTX included) at one row, the tuner's use: each is a compile
    tiles = gemv.FP8_WIDEN_CANDIDATES if CUDA else gemv.FP8_WIDEN_CANDIDATES[:2]
    for m in ((1,) if CUDA else (1, 3)):
        kind, x, args = prologue_inputs(prologue, m, k, dt)
        for cfg in tiles:
            y, ref = tile_and_reference(cfg, cfg[:4], x, wq, s, kind, args)
            assert not y.isnan().any()
            if CUDA:    # the PTX path is compiled only here
                err = rel_err(y, ref)
                assert err < 1e-6, (cfg, m, err)
            else:
                assert torch.equal(y, ref), (cfg, m)


@pytest.mark.skipif(CUDA, reason="the choice logic alone (timings scripted): the CPU covers it, "
                    "and on the GPU it would compile every tile for nothing")
def test_tuner_tries_the_widening_tiles_at_one_row_only(monkeypatch):
    """With fp8 weights the tuner times the integer-widening tiles at one row (and may choose
    one), never at more rows; tiles are timed in their fused form as the others."""
    from pagedbackend.kernels import gemv, gemv_tuning
    from pagedbackend.layers.quantization import quantize_weight_fp8
    wq, s = quantize_weight_fp8(torch.randn(24, 64, device=DEV) / 8)
    favourite = gemv.FP8_WIDEN_CANDIDATES[1]
    for rows in (1, 2):
        timed = []

        def time_us(fn):
            fn()
            cfg = fn.__defaults__[0] if fn.__defaults__ else None    # None: the baseline
            timed.append(cfg)
            return 10.0 if cfg is None else (1.0 if cfg == favourite else 9.0)
        monkeypatch.setattr(gemv_tuning, "_time_us", time_us)
        x = torch.randn(rows, 64, device=DEV)
        choice = gemv_tuning._tune(x, wq, None, gemv.ADD_NORM, s)
        widening = [c for c in timed if c is not None and len(c) > 5]
        if rows == 1:
            assert choice == favourite and set(widening) == set(gemv.FP8_WIDEN_CANDIDATES) \
                | set(gemv_tuning.byte_half_tiles(1, wq, s, x.dtype))
        else:
            assert choice != favourite and not widening


@pytest.mark.parametrize("prologue", ["plain", "add_norm", "silu_mul"])
@pytest.mark.parametrize("wdtype", ["e4m3", "int8"])
def test_skinny_byte_half_tiles_follow_the_fp32_tile(prologue, wdtype):
    """The fp16-pair one-row tiles (WIDEN 3 e4m3, 4 int8) against the same tile in fp32 (triton's
    conversion, WIDEN 0): on the GPU their PTX (fp16 products, chains of four) within 5e-3
    relative, with no inf or NaN for inputs up to 3e4; on the CPU the interpreter's stand-in
    (products rounded to fp16) within the same bound."""
    from pagedbackend.kernels import gemv, gemv_tuning
    from pagedbackend.layers.quantization import quantize_weight_fp8, quantize_weight_int8
    n, k = (4096, 4096) if CUDA else (40, 256)
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    wq, s = (quantize_weight_fp8 if wdtype == "e4m3" else quantize_weight_int8)(w)
    dt = torch.bfloat16
    tiles = gemv_tuning.byte_half_tiles(1, wq, s, dt)
    assert tiles and all(c[5] == (3 if wdtype == "e4m3" else 4) for c in tiles)
    tiles = tiles if CUDA else tiles[:2]
    for big in (False, True):
        kind, x, args = prologue_inputs(prologue, 1, k, dt)
        if big:     # a few inputs far out (massive activations): still finite
            x[0, :4] = 3e4 if kind != gemv.SILU_MUL else 150.0
        for cfg in tiles:
            y, ref = tile_and_reference(cfg, cfg[:4], x, wq, s, kind, args)
            assert y.isfinite().all(), (cfg, big)
            err = rel_err(y, ref)
            assert err < 5e-3, (cfg, big, err)


def test_byte_half_tiles_are_one_row_of_one_byte_weights():
    from pagedbackend.kernels import gemv, gemv_tuning
    from pagedbackend.layers.quantization import quantize_weight_fp8, quantize_weight_int8
    wq, s = quantize_weight_fp8(torch.randn(32, 256, device=DEV))
    wi, si = quantize_weight_int8(torch.randn(32, 256, device=DEV))
    half, ihalf = gemv.FP8_HALF_CANDIDATES[0], gemv.INT8_HALF_CANDIDATES[0]
    x1 = torch.randn(1, 256, device=DEV).bfloat16()
    with pytest.raises(AssertionError, match="one row"):
        gemv.skinny_linear(torch.randn(2, 256, device=DEV).bfloat16(), wq, None, half,
                           weight_scale=s)
    with pytest.raises(AssertionError, match="widens int8"):
        gemv.skinny_linear(x1, wq, None, ihalf, weight_scale=s)
    with pytest.raises(AssertionError, match="widens e4m3"):
        gemv.skinny_linear(x1, wi, None, half, weight_scale=si)
    with pytest.raises(AssertionError, match="fp16-pair tile"):     # K 200: masked tail
        gemv.skinny_linear(torch.randn(1, 200, device=DEV).bfloat16(),
                           quantize_weight_fp8(torch.randn(32, 200, device=DEV))[0], None,
                           half, weight_scale=s)
    assert set(gemv_tuning.byte_half_tiles(1, wi, si, torch.bfloat16)) <= set(
        gemv.INT8_HALF_CANDIDATES)
    assert not gemv_tuning.byte_half_tiles(2, wq, s, torch.bfloat16)
    assert not gemv_tuning.byte_half_tiles(1, wq, s, torch.float32)
    assert not gemv_tuning.byte_half_tiles(1, wq, None, torch.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's
@pytest.mark.parametrize("prologue", ["plain", "add_norm"])
def test_byte_half_tiles_fall_back_to_fp32_products_where_fp16_overflows(prologue):
    """Inputs of 1e6 overflow the fp16 products (448 x 1e6 / 1024 > 65,504): the tile redoes
    its columns with fp32 products, so the result is finite and equals the fp32 tile's within
    a bf16 rounding."""
    from pagedbackend.kernels import gemv
    from pagedbackend.layers.quantization import quantize_weight_fp8
    n, k = (4096, 4096) if CUDA else (32, 512)
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    w[:, :8] = w.abs().max()        # the largest e4m3 code (448) in every row's first columns
    wq, s = quantize_weight_fp8(w)
    kind = gemv.PLAIN if prologue == "plain" else gemv.ADD_NORM
    x = torch.randn(1, k, device=DEV)
    x[0, :8] = 1e6
    x = x.bfloat16()
    r = torch.zeros(1, k, device=DEV).bfloat16()
    g = torch.ones(k, device=DEV).bfloat16()
    args = (r, g, 1e-5) if kind == gemv.ADD_NORM else (None, None, 0.0)
    cfg = (8, 128, 4, 3, False, 3)
    y, ref = tile_and_reference(cfg, cfg[:4], x, wq, s, kind, args)
    assert y.isfinite().all()
    assert rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("cfg,m,dtype", [((64, 64, 4, 2, 1), 1, torch.bfloat16),
                                         ((64, 32, 4, 2, 2), 3, torch.float32),
                                         ((64, 32, 4, 2, 4), 16, torch.bfloat16),
                                         ((64, 64, 4, 2, 2), 20, torch.bfloat16),
                                         ((64, 32, 4, 2, 1), 40, torch.float32)])
def test_fp8_mma_gemm_is_the_w8a8_product(cfg, m, dtype):
    """kernels/fp8_mma.py: e4m3 rows (per-row scales) times e4m3 weights (per-channel scales) on
    the tensor cores, the input padded to 16, 32 or 64 rows, split-K through the shared
    workspace: the fp32 product of the dequantized operands (+ bias), at an N that is not a
    multiple of the tile; the split counters are back at 0 after each launch (the next one
    starts clean). On the GPU an fp32 output carries the fp8 MMA's own summation (reduced
    precision on Hopper: 6.2e-4 at K 4,096 on an H100, call 74); the interpreter's is fp32."""
    from pagedbackend.kernels import fp8_mma, gemv_w4
    from pagedbackend.layers.quantization import quantize_rows_fp8, quantize_weight_fp8
    n, k = (6144, 4096) if CUDA else (72, 256)
    wq, sw = quantize_weight_fp8(torch.randn(n, k, device=DEV) / k ** 0.5)
    xq, sx = quantize_rows_fp8(torch.randn(m, k, device=DEV))
    b = torch.randn(n, device=DEV).to(dtype)
    ref = (xq.float() * sx) @ (wq.float() * sw[:, None]).t() + b.float()
    tol = 1e-2 if dtype != torch.float32 else 2e-3 if CUDA else 1e-5
    for _ in range(2):
        y = fp8_mma.fp8_mma_gemm(xq, sx, wq, sw, b, dtype, cfg)
        assert y.shape == (m, n) and y.dtype == dtype
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < tol, err
        if cfg[4] > 1:
            assert not gemv_w4._SPLIT_K[(xq.device, "counts")].any()


def test_fp8_decode_setting_routes_e4m3_layers(monkeypatch):
    """PAGEDBACKEND_FP8_DECODE: by default the skinny matmul's tuner offers its W8A16 tiles
    for e4m3 weights (and the FP8 GEMM's tiles only replace torch._scaled_mm); with w8a8
    (fp8_mma.W8A8_DECODE) it offers none for e4m3 (decode steps take the quantizing norm /
    activation and the FP8 GEMM) and leaves other weights alone. The FP8 GEMM's tiles take
    1-64 rows: a wider step, or cublas (ENABLED off), keeps torch._scaled_mm."""
    from pagedbackend.kernels import fp8_mma, gemv_tuning
    from pagedbackend.layers.quantization import quantize_weight_fp8
    wq, sw = quantize_weight_fp8(torch.randn(64, 128, device=DEV))
    x = torch.randn(1, 128, device=DEV).bfloat16()
    monkeypatch.setattr(gemv_tuning, "ENABLED", True)
    monkeypatch.setattr(gemv_tuning, "_tune", lambda *a: ("tuned",))
    monkeypatch.setattr(gemv_tuning, "_CHOICE", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not fp8_mma.W8A8_DECODE and fp8_mma.ENABLED
    assert gemv_tuning._choice(x, wq, None) == ("tuned",)
    monkeypatch.setattr(fp8_mma, "W8A8_DECODE", True)
    monkeypatch.setattr(gemv_tuning, "_CHOICE", {})
    assert gemv_tuning._choice(x, wq, None) is None
    assert gemv_tuning._choice(x, torch.randn(64, 128, device=DEV).bfloat16(), None) \
        == ("tuned",)

    class Cuda:     # the routing's view of a CUDA tensor (is_cuda, shape, stride)
        def __init__(self, t):
            self.t, self.is_cuda, self.shape = t, True, t.shape
            self.device = torch.device("cpu")

        def stride(self, i):
            return self.t.stride(i)

        def is_contiguous(self):
            return self.t.is_contiguous()

    monkeypatch.setattr(fp8_mma, "_tune", lambda *a: (64, 64, 4, 2, 1))
    monkeypatch.setattr(fp8_mma, "fp8_mma_gemm", lambda *a: "tile")
    monkeypatch.setattr(fp8_mma, "_CHOICE", {})
    for rows, want in ((1, "tile"), (64, "tile"), (65, None)):
        xq = Cuda(torch.zeros(rows, 128).to(torch.float8_e4m3fn))
        got = fp8_mma.maybe_fp8_mma_gemm(xq, None, Cuda(wq), sw, None, torch.bfloat16)
        assert got == want, rows
    monkeypatch.setattr(fp8_mma, "ENABLED", False)
    assert fp8_mma.maybe_fp8_mma_gemm(Cuda(torch.zeros(1, 128).to(torch.float8_e4m3fn)), None,
                                      Cuda(wq), sw, None, torch.bfloat16) is None


# compiled for sm_90 by compiled_for_hopper
HOPPER_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedbackend.kernels import fp8_mma
names = ["x_ptr", "sx_ptr", "w_ptr", "sw_ptr", "b_ptr", "y_ptr", "ws_ptr", "cnt_ptr", "M", "N",
         "K", "stride_xm", "stride_ym"]
types = ["*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 5
sig = dict(zip(names, types))
sig.update({c: "constexpr" for c in ("BLOCK_N", "BLOCK_K", "BLOCK_M", "KSPLIT", "HAS_BIAS",
                                     "USE_PDL")})
aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name != "M"}
for arg in sys.argv[1:]:
    i, block_m = map(int, arg.split(":"))
    block_n, block_k, warps, stages, ksplit = fp8_mma.CANDIDATES[i]
    src = ASTSource(fp8_mma._fp8_mma_kernel, sig, {"BLOCK_N": block_n, "BLOCK_K": block_k,
                    "BLOCK_M": block_m, "KSPLIT": ksplit, "HAS_BIAS": True, "USE_PDL": True},
                    aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    print(i, "wgmma.mma_async" in ptx and "e4m3" in ptx, "cp.async" in ptx,
          kernel.metadata.shared >= stages * (block_n + block_m) * block_k)
"""


@pytest.mark.skipif(CUDA, reason="the GPU runs the tiles themselves (fp8mma stage)")
def test_fp8_mma_tiles_compile_for_hopper_to_pipelined_wgmma():
    """Compiled for sm_90 on this machine, with the pointer alignment a launch specializes on:
    the tiles' main loop runs on wgmma with e4m3 operands staged by cp.async through as many
    shared-memory buffers as num_stages (the weight is never widened in registers)."""
    out = compiled_for_hopper(HOPPER_COMPILE, "2:16", "6:64")
    assert out.split() == ["2", "True", "True", "True", "6", "True", "True", "True"]


# compiled for sm_90 by compiled_for_hopper; prints each tile's registers a thread (ptxas)
HOPPER_REGISTERS = """
import re
import sys
from pagedbackend.kernels import gemv
ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "s_ptr": "*fp32",
        "y_ptr": "*bf16", "r_ptr": "*bf16", "r_out_ptr": "*bf16", "g_ptr": "*bf16"}
for arg in sys.argv[1:]:
    i, prologue = map(int, arg.split(":"))
    block_n, block_k, warps, stages, _, widen = gemv.FP8_HALF_CANDIDATES[i]
    const = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, HAS_SCALE=True,
                 EVEN_N=True, EVEN_K=True, PROLOGUE=prologue, USE_PDL=True, PREFETCH=True,
                 USE_DOT=False, PRECISION="tf32", WIDEN=widen)
    usage = sm90_tool(gemv._skinny_kernel, const, ptrs, warps, stages, "cuobjdump",
                      "--dump-resource-usage")
    print(arg, re.search(r"REG:(\\d+)", usage).group(1))
"""


@pytest.mark.skipif(CUDA, reason="compiled for sm_90 on a machine without a GPU")
def test_byte_half_tiles_keep_the_registers_of_their_main_loop():
    """The overflow fallback (_skinny_row_fp32) runs rarely but its registers count for the
    whole kernel: compiled for sm_90 the fp16-pair e4m3 tiles, plain and with the SiLU·mul
    prologue, use at most 64 registers a thread (their main loop's), where a fallback holding a
    [BLOCK_N, BLOCK_K] fp32 accumulator made it 119-127, half the programs a SM can hold."""
    out = compiled_for_hopper(HOPPER_REGISTERS, "3:0", "3:3", "2:3").split()
    regs = dict(zip(out[::2], map(int, out[1::2])))
    assert set(regs) == {"3:0", "3:3", "2:3"} and max(regs.values()) <= 64, regs
