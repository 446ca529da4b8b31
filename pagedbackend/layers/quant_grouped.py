"""AWQ / GPTQ checkpoints (group-wise 4- or 8-bit integer weights, formats in quant_formats.py)
on the column- and row-parallel layers.

Loading is two-phase, as vLLM's process_weights_after_loading: `prepare_grouped` replaces each
layer's 16-bit weight by staging parameters named as the checkpoint's tensors (qweight, qzeros,
scales and, with desc_act, g_idx), whose loaders narrow the full checkpoint tensor to this
rank's shard, unpack it and check its shape; `finalize_grouped` then repacks each layer once
into the one layout every path reads (`PackedWeight`), whatever the checkpoint's format:
  qweight uint8 [N, K * bits / 8]: row n's codes along K, two per byte at 4 bits (low nibble
  first), so a program owning output rows reads contiguous bytes; scales [G, N] (fp16 when the
  checkpoint's are, which is every AWQ / GPTQ checkpoint seen) and zeros uint8 [G, N] (true
  zeros: GPTQ's off-by-one is undone at load).
Act order (GPTQ desc_act): the input channels are sorted by group once at load (`perm`) and
the layer gathers its input columns by it, so groups are contiguous again (as vLLM's exllama and
Marlin paths do). A row-parallel shard of an act-order layer keeps every group's scales, and
its channels' groups are uneven in count (`g_idx` kept): it runs dequantize + matmul only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedbackend.layers.quant_formats import AWQ_ORDER, GroupQuantSpec, unpack_int32

# the HF names of a packed layer's shards (models/llama.py's PACKED), for error messages
SHARD_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
INT_DTYPES = (torch.int32, "I32")


@dataclass
class PackedWeight:
    """One layer's quantized weight in the load-time layout (see the module's doc)."""
    bits: int
    group_size: int                    # input channels per group (after `perm`)
    qweight: torch.Tensor              # uint8 [N, K * bits / 8]
    scales: torch.Tensor               # [G, N] fp16 (or fp32)
    zeros: torch.Tensor                # uint8 [G, N]
    g_idx: Optional[torch.Tensor]      # int32 [K] when groups are uneven, else None (k // size)
    perm: Optional[torch.Tensor]       # long [K]: input channel order (act order), or None
    cpu_weight: Optional[torch.Tensor] = None    # the CPU's dequantized copy (see __call__)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 8 // self.bits

    def codes(self) -> torch.Tensor:
        """uint8 [N, K]: the unpacked codes, in `perm`'s channel order."""
        if self.bits == 8:
            return self.qweight
        q = self.qweight
        return torch.stack((q & 0xF, q >> 4), dim=-1).reshape(q.shape[0], -1)

    def group_index(self) -> torch.Tensor:
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] (in perm's channel order) in dtype: (q - z) * s in float32, rounded once
        to dtype; bit for bit quant_formats.dequantize_reference."""
        if self.qweight.is_cuda and self.g_idx is None:
            from pagedbackend.kernels.gemv_w4 import dequantize_packed
            return dequantize_packed(self, dtype)
        g = self.group_index()
        diff = self.codes().to(torch.int32) - self.zeros.t()[:, g].to(torch.int32)
        return (diff.float() * self.scales.t()[:, g].float()).to(dtype)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if x.is_cuda:
            from pagedbackend.kernels.gemv_w4_tuning import packed_linear
            y = packed_linear(x2, self, bias)
        else:
            # the CPU path serves tests and development: the dequantized weight is kept after
            # the first call (speed over memory there; the GPU never holds it)
            if self.cpu_weight is None or self.cpu_weight.dtype != x.dtype:
                self.cpu_weight = self.dequantize(x.dtype)
            y = F.linear(x2, self.cpu_weight, bias)
        return y.reshape(*lead, y.shape[-1])


@dataclass(frozen=True)
class _Geometry:
    """What a layer's loaders need: full and local sizes, the shards of a packed layer."""
    column: bool
    k_full: int
    k_local: int
    n_full: tuple[int, ...]     # per shard (column) or (N,) (row)
    n_local: tuple[int, ...]
    offsets: tuple[int, ...]
    rank: int
    groups_full: int
    groups_local: int           # the groups this rank stages (all of them: act order / -1)
    name: str


def _shape(loaded: Any) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def _dtype(loaded: Any):
    return loaded.dtype if isinstance(loaded, torch.Tensor) else loaded.get_dtype()


def _narrow(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    from pagedbackend.layers.linear import materialize, narrow
    return materialize(narrow(loaded, dim, start, size))


def prepare_grouped(model: nn.Module, spec: GroupQuantSpec) -> None:
    """Every column- and row-parallel layer's weight -> staging parameters for spec's tensors.
    A layer whose sizes spec cannot shard is a ValueError naming it and the field."""
    from pagedbackend.layers.linear import ColumnParallelLinear
    tp = getattr(model, "tp_size", 1)
    for name, module in model.named_modules():
        if not _is_linear(module):
            continue
        n_local, k_local = module.weight.shape
        column = isinstance(module, ColumnParallelLinear)
        k_full = k_local if column else k_local * tp
        if spec.group_size != -1 and k_full % spec.group_size:
            raise ValueError(f"quantization_config.group_size={spec.group_size} is invalid: "
                             f"must divide the input size of every layer ({name} has {k_full})")
        per_word = 32 // spec.bits
        sizes = tuple(module.local_sizes) if column else (n_local,)
        if any(s % per_word for s in sizes) or not column and spec.method == "gptq" \
                and k_local % per_word:
            raise ValueError(f"tensor_parallel_size={tp} is invalid for {name}: its shards "
                             f"({sizes} outputs, {k_local} inputs) must be multiples of "
                             f"{per_word}, the codes per int32 word")
        whole = column or spec.desc_act or spec.group_size == -1
        if not whole and k_local % spec.group_size:
            raise ValueError(f"tensor_parallel_size={tp} is invalid for {name}: its "
                             f"{k_local} input channels per rank must be a multiple of "
                             f"quantization_config.group_size={spec.group_size}")
        g_full = spec.groups(k_full)
        geo = _Geometry(column, k_full, k_local, tuple(s * tp for s in sizes) if column else sizes,
                        sizes, tuple(module.offsets) if column else (0,), module.tp_rank,
                        g_full, g_full if whole else k_local // spec.group_size, name)
        dev = module.weight.device
        del module.weight
        module.weight = None
        module.grouped_spec, module.geometry = spec, geo
        for pname, shape, dtype in (("qweight", (n_local, k_local), torch.uint8),
                                    ("qzeros", (geo.groups_local, n_local), torch.uint8),
                                    ("scales", (geo.groups_local, n_local), torch.float32)):
            _stage(module, pname, torch.zeros(shape, dtype=dtype, device=dev))
        if spec.desc_act:
            _stage(module, "g_idx", torch.zeros((len(sizes), k_local), dtype=torch.int32,
                                                device=dev))


def _is_linear(module: nn.Module) -> bool:
    from pagedbackend.layers.linear import ColumnParallelLinear, RowParallelLinear
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def _stage(module: nn.Module, pname: str, data: torch.Tensor) -> None:
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = lambda param, loaded, shard_id=None: _load(module, pname, param, loaded,
                                                                 shard_id)
    setattr(module, pname, p)


def _load(module: nn.Module, pname: str, param: torch.Tensor, loaded: Any, shard_id) -> None:
    """Copy this rank's part of one checkpoint tensor into a staging parameter, unpacked."""
    spec, geo = module.grouped_spec, module.geometry
    i = shard_id or 0
    n_full, n_loc, off = geo.n_full[i], geo.n_local[i], geo.offsets[i]
    prefix, _, last = geo.name.rpartition(".")
    hf = f"{prefix}.{SHARD_NAMES[last][i] if last in SHARD_NAMES else last}.{pname}"
    bits, awq = spec.bits, spec.method == "awq"
    per = 32 // bits
    words_n = n_full // per       # packed along N (AWQ qweight, both formats' qzeros)
    want = {"qweight": (geo.k_full, words_n) if awq else (geo.k_full // per, n_full),
            "qzeros": (geo.groups_full, words_n), "scales": (geo.groups_full, n_full),
            "g_idx": (geo.k_full,)}[pname]
    got = _shape(loaded)
    if got != want:
        raise ValueError(f"checkpoint tensor {hf} has shape {got}: must be {want} for "
                         f"{spec.method} with bits={bits}, group_size={spec.group_size} and "
                         f"this layer's {geo.k_full} inputs x {n_full} outputs")
    integer = pname in ("qweight", "qzeros")
    if integer and _dtype(loaded) not in INT_DTYPES:
        raise ValueError(f"checkpoint tensor {hf} is {_dtype(loaded)}: must be int32 "
                         f"(packed {bits}-bit codes)")
    order = AWQ_ORDER if awq else None
    k0 = 0 if geo.column else geo.rank * geo.k_local
    g0 = 0 if geo.groups_local == geo.groups_full else geo.rank * geo.groups_local
    col = (1, geo.rank * n_loc // per, n_loc // per) if geo.column else None
    if pname == "qweight":
        if awq:
            t = _narrow(loaded, *col) if col else _narrow(loaded, 0, k0, geo.k_local)
            codes = unpack_int32(t, bits, order)                              # [K, N]
        else:
            t = _narrow(loaded, 1, geo.rank * n_loc, n_loc) if col \
                else _narrow(loaded, 0, k0 // per, geo.k_local // per)
            codes = unpack_int32(t.t(), bits).t()
        param.data.narrow(0, off, n_loc).copy_(codes.t())
    elif pname == "qzeros":
        t = _narrow(loaded, *col) if col else _narrow(loaded, 0, g0, geo.groups_local)
        zeros = unpack_int32(t, bits, order) + (0 if awq else 1)
        param.data.narrow(1, off, n_loc).copy_(zeros)
    elif pname == "scales":
        t = _narrow(loaded, 1, geo.rank * n_loc, n_loc) if col \
            else _narrow(loaded, 0, g0, geo.groups_local)
        param.data.narrow(1, off, n_loc).copy_(t.float())
    else:
        g = _narrow(loaded, 0, k0, geo.k_local).to(torch.int64)
        if g.numel() and (g.min() < 0 or g.max() >= geo.groups_full):
            raise ValueError(f"checkpoint tensor {hf} holds groups {g.min()}..{g.max()}: must "
                             f"lie in [0, {geo.groups_full})")
        param.data[i].copy_(g)


def fill_dummy_grouped(model: nn.Module, seed: int = 0) -> None:
    """Random codes and zeros, and scales giving weights within about +-1e-3 (as the 16-bit
    dummy weights), generated on the staging parameters' device (nothing large travels)."""
    g = None
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "grouped_spec", None) is None:
                continue
            if g is None:
                g = torch.Generator(device=module.qweight.device)
                g.manual_seed(seed * 1009 + getattr(model, "tp_rank", 0))
            levels = 1 << module.grouped_spec.bits
            module.qweight.random_(0, levels, generator=g)
            module.qzeros.random_(levels // 2 - 1, levels // 2 + 2, generator=g)
            module.scales.uniform_(0.5e-3, 1e-3, generator=g).div_(levels // 2)
            module.scales.copy_(module.scales.half())
            if module.grouped_spec.desc_act:
                k = module.g_idx.shape[1]
                module.g_idx.copy_(torch.arange(k, device=module.g_idx.device)
                                   // module.grouped_spec.group_of(module.geometry.k_full))


def finalize_grouped(model: nn.Module) -> int:
    """Repack every staged layer into its PackedWeight (module.quant), dropping the staging
    parameters; returns the number of layers."""
    count = 0
    for module in model.modules():
        spec = getattr(module, "grouped_spec", None)
        if spec is None:
            continue
        geo = module.geometry
        codes, zeros, scales = module.qweight.data, module.qzeros.data, module.scales.data
        k = geo.k_local
        if spec.desc_act:
            g_all = module.g_idx.data
            if not bool((g_all == g_all[:1]).all()):
                raise ValueError(f"checkpoint tensors g_idx of {geo.name}'s parts differ: a "
                                 "packed layer needs one act order for all its parts")
            g = g_all[0].long()
            perm = torch.argsort(g, stable=True)
            codes, g = codes[:, perm], g[perm]
        else:
            size = spec.group_of(geo.k_full)
            g = torch.arange(k, device=codes.device) // size   # a row shard starts a group
            perm = None
        size = k // zeros.shape[0] if k % zeros.shape[0] == 0 else 0
        even = size > 0 and bool((g == torch.arange(k, device=g.device) // size).all())
        if perm is not None and bool((perm == torch.arange(k, device=perm.device)).all()):
            perm = None
        packed = codes if spec.bits == 8 else codes[:, 0::2] | (codes[:, 1::2] << 4)
        half = scales.half()
        module.quant = PackedWeight(
            spec.bits, size if even else 0, packed.contiguous(),
            half if torch.equal(half.float(), scales) else scales.contiguous(),
            zeros.contiguous(), None if even else g.to(torch.int32), perm)
        for pname in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(module, pname):
                delattr(module, pname)
        del module.grouped_spec, module.geometry
        count += 1
    return count
