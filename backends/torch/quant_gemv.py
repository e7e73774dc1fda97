"""Quantized GEMV through torch's tinygemm int4 kernels: ``aten._weight_int4pack_mm`` (cuda) and
``aten._weight_int4pack_mm_for_cpu`` (cpu), on a weight repacked once from a 4-bit packing whose unpacked form is
codes, a scale and an integer zero point per group (native, AWQ, GPTQ without g_idx, GGUF Q4_0).

tinygemm dequantizes ``w = (q - 8) * scale + offset`` with one (scale, offset) pair per group of K, held in a
``scale_and_zeros`` tensor ``(K // G, N, 2)`` of the activation dtype: the kernels here run in float32 on cpu
(float16 / bfloat16 activations widen to it exactly; the output is rounded to the op's dtype once) and in bfloat16 on
cuda, tinygemm's only dtype there. portakern's
native asymmetric format is ``w = (q - z) * s`` with an integer zero point ``z`` (0..255), so the repack stores
``scale = s`` and ``offset = (8 - z) * s``. That is exact -- the repacked pair gives back every weight bit for
bit -- exactly when ``s`` and ``(8 - z) * s`` are values of the scale_and_zeros dtype: ``|8 - z| <= 247`` has at
most 8 significant bits, so with p-bit scales the offset needs p + 8 bits. Hence (``exact_repack``):

* symmetric (``z = 8``, offset 0): the scale dtype converts losslessly to the scale_and_zeros dtype
  (float16 -> float16 / float32, bfloat16 -> bfloat16 / float32, float32 -> float32);
* asymmetric: float16 (11 bits) or bfloat16 (8 bits) scales with float32 scale_and_zeros (24 bits): every such
  format on cpu; on cuda (bfloat16, 8 bits) no asymmetric format is exact, and symmetric needs bfloat16 scales.

The ``silu_mul`` prologue runs on cpu (``silu(gate) * up`` formed in float32 and passed as it is; cuda's bfloat16
activations would round it coarser than docs/ir.md allows).

``supports`` refuses every other case by format and dtype, and ``prepare_weight`` checks the result against the
unpacked dequantization (non-finite scales included) before any kernel sees it. 8-bit formats, GGUF K-quants and
act-order ``g_idx`` are refused: tinygemm has no kernel for them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from portakern.arrays import to_numpy
from portakern.backend import YES, Support, no
from portakern.errors import BackendError
from portakern.ir.dtypes import DType
from portakern.ir.gguf_kquants import kquant_refusal
from portakern.ir.ops import QuantGemv
from portakern.ir.packing import unpack
from portakern.ir.quant import Packing

#: the packings whose unpacked form is 4-bit codes, a scale and an integer zero point per group of k // G (GGUF Q4_0:
#: the fixed zero point 8); GGUF K-quants (a float minimum per group) and 8-bit formats are not repacked
PACKINGS = (Packing.NATIVE, Packing.AWQ, Packing.GPTQ, Packing.GGUF_Q4_0)
#: group sizes tinygemm's kernels take
GROUP_SIZES = (32, 64, 128, 256)
#: N is padded to a multiple of this per device type (cpu's packer needs 16, cuda's 8 -- the n tile)
N_MULTIPLE = {"cpu": 16, "cuda": 8}
_TORCH = {DType.float16: torch.float16, DType.bfloat16: torch.bfloat16, DType.float32: torch.float32}
_LOSSLESS = {(DType.float16, DType.float16), (DType.float16, DType.float32), (DType.bfloat16, DType.bfloat16),
             (DType.bfloat16, DType.float32), (DType.float32, DType.float32)}


def scale_and_zeros_dtype(activation: DType, device_type: str) -> DType:
    """The dtype tinygemm runs in: float32 on cpu (every activation dtype widens to it exactly; the cpu kernel takes
    scale_and_zeros of the activation dtype), bfloat16 on cuda (its only dtype)."""
    return DType.float32 if device_type == "cpu" else DType.bfloat16


def exact_repack(scale_dtype: DType, target: DType, symmetric: bool) -> bool:
    """Whether every native int4 weight with ``scale_dtype`` scales repacks exactly into ``target`` scale_and_zeros
    (see the module docstring for the rule)."""
    if symmetric:
        return (scale_dtype, target) in _LOSSLESS
    return target is DType.float32 and scale_dtype in (DType.float16, DType.bfloat16)


def supports(op: QuantGemv, device) -> Support:
    """Native 4-bit, no g_idx, group 32 / 64 / 128 / 256, K a multiple of 32, and an exact repack for the
    activation dtype on the device (cuda: bfloat16 activations, sm_80 and newer)."""
    fmt = op.fmt
    why = kquant_refusal(fmt, "torch", "triton on NVIDIA GPUs, triton-rocm on AMD GPUs and opencl")   # GGUF K-quants
    if why:
        return no(why)
    if fmt.packing not in PACKINGS or fmt.bits != 4:
        names = ", ".join(p.value for p in PACKINGS)
        return no(f"tinygemm runs 4-bit codes with one scale and offset per group ({names} repack into it); "
                  f"{fmt.packing.value} {fmt.bits}-bit has no torch kernel; use backend=None")
    if op.prologue is not None and device.type != "cpu":
        return no(f"the {op.prologue} prologue's input is formed in float32 and may not be rounded coarser; "
                  "tinygemm on cuda takes bfloat16 activations; use backend=None")
    if fmt.has_g_idx:
        return no("tinygemm reads groups in order of k; an act-order g_idx has no tinygemm form; use backend=None")
    if fmt.group_size not in GROUP_SIZES:
        return no(f"tinygemm takes group sizes {GROUP_SIZES}, not {fmt.group_size}; use backend=None")
    if op.K % 32:
        return no(f"tinygemm's packer needs K a multiple of 32 (two 16-wide k tiles); K={op.K}; use backend=None")
    if device.type == "cuda":
        if op.dtype is not DType.bfloat16:
            return no(f"torch's cuda tinygemm takes bfloat16 activations, not {op.dtype.value}; use backend=None")
        if device.capability and device.capability < (8, 0):
            return no(f"torch's cuda tinygemm needs sm_80 or newer; {device} is {device.arch}")
    target = scale_and_zeros_dtype(op.dtype, device.type)
    if not exact_repack(fmt.scale_dtype, target, fmt.symmetric):
        kind = "symmetric" if fmt.symmetric else "asymmetric (offset (8 - z) * s)"
        return no(f"tinygemm holds each group's scale and offset in {target.value} here; {kind} "
                  f"{fmt.scale_dtype.value} scales do not repack exactly into it (p-bit scales need p + 8 bits for "
                  "the offset); use backend=None")
    return YES


class Int4Pack:
    """A native int4 weight repacked for tinygemm on one device: the packed codes (N padded to ``N_MULTIPLE``) and,
    built on first use per activation dtype, the scale_and_zeros tensor, checked exact."""

    def __init__(self, weight, device):
        fmt, N, K = weight.fmt, weight.N, weight.K
        host = {k: to_numpy(v) for k, v in weight.tensors.items()}
        codes, scales, zeros, _ = unpack(fmt, host, N, K)
        self.N, self.K, self.group_size = N, K, fmt.group_size
        self.torch_device = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
        pad = -N % N_MULTIPLE.get(device.type, 16)
        with np.errstate(invalid="ignore", over="ignore"):
            offsets = (8.0 - zeros) * scales
        self.scales = np.pad(scales, ((0, pad), (0, 0)))                      # padded rows: scale 0, offset 0
        self.offsets = np.pad(offsets, ((0, pad), (0, 0)))
        self.inexact = _nonfinite_mismatch(codes, scales, zeros, offsets, fmt.group_size)
        c = torch.from_numpy(np.pad(codes, ((0, pad), (0, 0)), constant_values=8).astype(np.int32))
        tiles = 8 if K % 128 == 0 else 4 if K % 64 == 0 else 2
        if device.type == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, tiles)
        else:   # cuda's packer takes (N, K / 2) bytes, even k in the high nibble
            u8 = ((c[:, 0::2] << 4) | c[:, 1::2]).to(torch.uint8).to(self.torch_device)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(u8, tiles)
        self._sz: dict[torch.dtype, torch.Tensor] = {}

    def scale_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """``(K // G, N_padded, 2)`` of ``dtype``: [..., 0] the scale, [..., 1] the offset ``(8 - z) * s``.

        Raises ``BackendError`` unless ``(q - 8) * scale + offset`` equals ``(q - z) * s`` for every weight: each
        scale and offset must be a value of ``dtype`` (then the sum is exact for finite scales), and a group with an
        infinite scale must give the same inf / NaN for every code (checked when the weight was packed)."""
        sz = self._sz.get(dtype)
        if sz is not None:
            return sz
        if self.inexact is not None:
            n, k, got, want = self.inexact
            raise BackendError(f"torch tinygemm: weight [{n}, {k}] has an infinite scale, and (q - 8) * s + "
                               f"(8 - z) * s gives {got!r} where (q - z) * s is {want!r}; use backend=None")
        pair = torch.from_numpy(np.stack([self.scales.T, self.offsets.T], axis=-1)).to(dtype)
        back = pair.double().numpy()
        want = np.stack([self.scales.T, self.offsets.T], axis=-1)
        same = (back == want) | (np.isnan(back) & np.isnan(want))
        if not same.all():
            g, n, which = np.argwhere(~same)[0]
            name = ("scale", "offset (8 - z) * s")[which]
            raise BackendError(f"torch tinygemm: the {name} of weight row {n}, group {g} is {want[g, n, which]!r}, "
                               f"not a {dtype} value ({back[g, n, which]!r}): the repack would not be exact; use "
                               "backend=None")
        sz = self._sz[dtype] = pair.to(self.torch_device).contiguous()
        return sz


def _nonfinite_mismatch(codes, scales, zeros, offsets, G: int):
    """``(n, k, got, want)`` of the first weight in a group with an infinite scale where ``(q - 8) * s + offset``
    differs from ``(q - z) * s`` (inf - inf is NaN where the product is inf), or None."""
    rows, groups = np.nonzero(np.isinf(scales))
    for n, g in zip(rows.tolist(), groups.tolist()):
        q = codes[n, g * G:(g + 1) * G].astype(np.float64)
        with np.errstate(invalid="ignore"):
            got = (q - 8) * scales[n, g] + offsets[n, g]
            want = (q - zeros[n, g]) * scales[n, g]
        bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
        if bad.any():
            i = int(np.argmax(bad))
            return n, g * G + i, float(got[i]), float(want[i])
    return None


def prepare_weight(weight, device) -> Int4Pack:
    """The weight repacked for tinygemm on ``device`` (once per weight and device; cached by portakern)."""
    return Int4Pack(weight, device)


def compile(op: QuantGemv, device) -> Callable[..., None]:
    """``kernel(x, pack, out)``: ``out = x @ dequant(W)^T`` through tinygemm, in the activation dtype."""
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu if device.type == "cpu" else torch.ops.aten._weight_int4pack_mm
    sz_dtype = _TORCH[scale_and_zeros_dtype(op.dtype, device.type)]
    N = op.N

    K, silu_mul = op.K, op.prologue == "silu_mul"

    def kernel(x, pack: Int4Pack, out) -> None:
        if silu_mul:                        # cpu only (supports): formed and kept in float32
            x = torch.nn.functional.silu(x[:, :K].float()) * x[:, K:].float()
        y = mm(x.to(sz_dtype).contiguous(), pack.packed, pack.group_size, pack.scale_and_zeros(sz_dtype))
        out.copy_(y[:, :N])

    return kernel
