"""The AWQ and GPTQ checkpoint formats: their quantization_config fields, the bit packing of
their int32 tensors (pack for scripts/quantize.py and the tests, unpack for the loader), the
plain-torch dequantization every other path is checked against, and round-to-nearest
quantization into them.

AWQ (AutoAWQ's "GEMM" version, what vLLM's `awq` reads), W [N, K] as y = x @ W.T:
  qweight int32 [K, N/8]: eight 4-bit codes per word along N in AutoAWQ's interleaved order
  (the word's field i holds column 8c + AWQ_ORDER[i]); qzeros int32 [K/G, N/8] packed the same
  way; scales [K/G, N]. W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n].
GPTQ v1 (AutoGPTQ, GPTQModel's default checkpoint_format "gptq"):
  qweight int32 [K * bits / 32, N]: codes packed along K in order (word r's field j is input
  channel r * 32 / bits + j); qzeros int32 [groups, N * bits / 32] packed along N in order and
  holding zero - 1 (the historical off-by-one: readers add 1 back); scales [groups, N];
  g_idx int32 [K], each input channel's group (k // G, or any order with desc_act).
  W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
METHODS = ("awq", "gptq")
BITS = {"awq": (4,), "gptq": (4, 8)}


@dataclass(frozen=True)
class GroupQuantSpec:
    """A checkpoint's quantization_config for group-wise integer weights."""
    method: str            # awq | gptq
    bits: int
    group_size: int        # -1: one group over the whole input
    desc_act: bool = False  # GPTQ's act order: g_idx is not k // group_size
    sym: bool = True       # informative: zeros are read from qzeros either way

    @classmethod
    def from_config(cls, qc: dict) -> "GroupQuantSpec":
        """From config.json's quantization_config (vLLM's key aliases: AutoAWQ writes w_bit /
        q_group_size, GPTQ bits / group_size). A bad field is a ValueError naming it."""
        method = qc.get("quant_method")
        _check(method in METHODS, "quant_method", method, f"one of {METHODS}")
        bits = qc.get("bits", qc.get("w_bit"))
        _check(bits in BITS[method], "bits", bits, f"one of {BITS[method]} for {method}")
        group = qc.get("group_size", qc.get("q_group_size"))
        _check(isinstance(group, int) and (group == -1 or group >= 8 and group % 8 == 0),
               "group_size", group, "-1 or a positive multiple of 8")
        _check(not qc.get("modules_to_not_convert"), "modules_to_not_convert",
               qc.get("modules_to_not_convert"), "empty (every decoder linear layer quantized)")
        _check(not qc.get("lm_head"), "lm_head", qc.get("lm_head"),
               "false (the LM head in 16 bits)")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            _check(version == "gemm", "version", qc.get("version"), "'gemm' (AutoAWQ's GEMM "
                   "layout; GEMV and Marlin-packed AWQ checkpoints are not read)")
            _check(qc.get("zero_point", True) is True, "zero_point", qc.get("zero_point"),
                   "true")
            return cls(method, bits, group, desc_act=False, sym=False)
        fmt = qc.get("checkpoint_format", "gptq")
        _check(fmt == "gptq", "checkpoint_format", fmt, "'gptq' (v1; gptq_v2 is not read)")
        desc_act, sym = qc.get("desc_act", False), qc.get("sym", True)
        _check(isinstance(desc_act, bool), "desc_act", desc_act, "true or false")
        _check(isinstance(sym, bool), "sym", sym, "true or false")
        return cls(method, bits, group, desc_act, sym)

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else k // self.group_size

    def group_of(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def config(self) -> dict:
        """The quantization_config a checkpoint of this spec carries (scripts/quantize.py)."""
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "checkpoint_format": "gptq"}


def _check(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"quantization_config.{field}={value!r} is invalid: must be {allowed}")


def pack_int32(codes: torch.Tensor, bits: int, order: Optional[tuple] = None) -> torch.Tensor:
    """Integer codes [..., C] in [0, 2**bits) -> int32 words [..., C * bits / 32] packing along
    the last dim; field i of word c holds code c * (32 / bits) + order[i] (order: in order)."""
    per = 32 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"cannot pack {codes.shape[-1]} codes into words of {per}")
    c = codes.to(torch.int64)
    if c.numel() and (c.min() < 0 or c.max() >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack into {bits} bits")
    c = c.reshape(*c.shape[:-1], -1, per)
    if order is not None:
        c = c[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=c.device)
    words = (c << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, order: Optional[tuple] = None) -> torch.Tensor:
    """The inverse of pack_int32: int32 [..., W] -> int32 codes [..., W * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:   # column j of a word sits in the field i with order[i] == j
        fields = fields[..., [order.index(j) for j in range(len(order))]]
    return fields.reshape(*words.shape[:-1], -1)


# -- the formats, whole tensors --------------------------------------------------------------

def awq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ qweight [K, N/8], qzeros [G, N/8] -> codes [K, N], zeros [G, N] (int32)."""
    return unpack_int32(qweight, 4, AWQ_ORDER), unpack_int32(qzeros, 4, AWQ_ORDER)


def gptq_unpack(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ qweight [K*bits/32, N], qzeros [G, N*bits/32] -> codes [K, N], true zeros [G, N]
    (the stored value + 1)."""
    return unpack_int32(qweight.t(), bits).t(), unpack_int32(qzeros, bits) + 1


def dequantize_reference(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                         g_idx: torch.Tensor) -> torch.Tensor:
    """codes [K, N], zeros / scales [G, N], g_idx [K] -> W [N, K] in float32:
    (q - z) * s of each input channel's group. The integer difference times a 16-bit scale is
    exact in float32, so every path that computes the same products agrees to the bit."""
    g = g_idx.long()
    return ((codes - zeros[g]).float() * scales[g].float()).t().contiguous()


def dequantize_awq(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    codes, zeros = awq_unpack(qweight, qzeros)
    k = codes.shape[0]
    g_idx = torch.arange(k) // (k if group_size == -1 else group_size)
    return dequantize_reference(codes, zeros, scales, g_idx)


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int) -> torch.Tensor:
    codes, zeros = gptq_unpack(qweight, qzeros, bits)
    return dequantize_reference(codes, zeros, scales, g_idx)


# -- round-to-nearest quantization into the formats ------------------------------------------

def quantize_rtn(w: torch.Tensor, spec: GroupQuantSpec, order: Optional[torch.Tensor] = None
                 ) -> dict[str, torch.Tensor]:
    """W [N, K] -> the checkpoint tensors of one linear layer in spec's format, rounding each
    weight to the nearest level of its group (no calibration). `order` (desc_act only): the
    input channels in the order groups are formed (GPTQ's act order), giving g_idx.

    Asymmetric: the group's [min, max] (widened to hold 0) spans the 2**bits levels, zero =
    round(-min / scale). GPTQ v1 stores zero - 1, so its zero is kept >= 1 (a stored -1 would
    spill into the neighbouring fields, as AutoGPTQ's packing did). Symmetric (GPTQ sym):
    scale = max|w| * 2 / (2**bits - 1), zero = 2**(bits - 1)."""
    n, k = w.shape
    maxq = (1 << spec.bits) - 1
    size = spec.group_of(k)
    if k % size:
        raise ValueError(f"group_size={spec.group_size} does not divide the input size {k}")
    if order is None:
        order = torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // size).to(torch.int32)
    wg = w.float()[:, order].reshape(n, k // size, size)               # [N, G, size]
    lo, hi = wg.amin(dim=-1).clamp(max=0), wg.amax(dim=-1).clamp(min=0)
    if spec.sym:
        scale = (torch.maximum(-lo, hi) * 2 / maxq)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
    scale = scale.clamp(min=1e-8).half().float()      # the levels the checkpoint stores
    if not spec.sym:
        zero = torch.round(-lo / scale).clamp(1 if spec.method == "gptq" else 0, maxq)
    codes = torch.round(wg / scale[..., None] + zero[..., None]).clamp(0, maxq)
    codes = codes.reshape(n, k)[:, torch.argsort(order)].t().to(torch.int32)   # [K, N]
    zeros, scales = zero.t().to(torch.int32), scale.t().half().contiguous()    # [G, N]
    if spec.method == "awq":
        return {"qweight": pack_int32(codes, 4, AWQ_ORDER),
                "qzeros": pack_int32(zeros, 4, AWQ_ORDER), "scales": scales}
    return {"qweight": pack_int32(codes.t(), spec.bits).t().contiguous(),
            "qzeros": pack_int32(zeros - 1, spec.bits), "scales": scales, "g_idx": g_idx}
