"""GGUF K-quants (Q4_K, Q5_K, Q6_K) in the GPU GEMV layout: their codes as words, float32 scales ``d * sc`` and, for
Q4_K and Q5_K, float32 minimums ``dmin * m`` per group (``PreparedGemvWeight.mins``).

A K-quant dequantizes as ``d * sc * (q - z) - dmin * m`` (``portakern.ir.gguf_kquants``): the minimum is a float
per group, no integer zero point, so the prepared weight carries it as a third ``(G, NP)`` table beside the scales,
and the kernels subtract ``mins[g] * sum of x over group g`` once per group. Codes go to words of
``gguf_kquants.GEMV_BITS`` bits (Q4_K's nibbles as they are; Q5_K's 5 and Q6_K's 6 bits one per byte), with the
interleave ``portakern.ir.gemv_layout.interleave_words`` gives that width and a group of 32 (16) columns.

Host arrays are read with the numpy reference (``gguf_kquants.gemv_parts``) and uploaded; torch tensors (and cupy
arrays, through DLPack) are read with torch ops on their device (``parts_torch``), never through host memory. Both
give the same bits (``tests/test_gemv_kquants_triton.py`` compares them on CPU tensors). torch is imported inside
the functions: the core imports without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portakern.ir import gguf_kquants
from portakern.ir.gemv_layout import interleave_words, pack_internal
from portakern.ir.quant import Packing

#: the packings this module prepares
PACKINGS = frozenset(gguf_kquants.GEMV_BITS)


def parts_torch(packing: Packing, data, N: int, K: int) -> dict[str, Any]:
    """``gguf_kquants.gemv_parts`` with torch ops on ``data``'s device (uint8 ``(N, K // 256 * block bytes)``):
    ``codes`` uint8 ``(N, K)``, ``scales`` and ``mins`` (None for Q6_K) float32 ``(N, K // group)``, ``bits`` and
    ``zero_point``, bit for bit the numpy reference's."""
    import torch

    nb = K // gguf_kquants.QK_K
    b = data.reshape(N, nb, gguf_kquants.BLOCK_BYTES[packing])

    def f16(lo: int) -> torch.Tensor:   # two little-endian bytes at ``lo`` of every block as float32 (N, nb)
        return b[:, :, lo:lo + 2].contiguous().view(torch.float16).reshape(N, nb).float()

    if packing is Packing.GGUF_Q6_K:
        # -- ql: low nibbles, then high nibbles of 64-byte halves; qh: bits 2s..2s+1 are bits 4..5 of 32 weights
        ql = b[:, :, 0:128].reshape(N, nb, 2, 1, 64)
        low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(N, nb, 256)
        qh = b[:, :, 128:192].reshape(N, nb, 2, 1, 32)
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(N, nb, 256)
        codes = (low | (high << 4)).reshape(N, K)
        sc = b[:, :, 192:208].contiguous().view(torch.int8).float()
        scales = (f16(208)[..., None] * sc).reshape(N, -1)
        return {"codes": codes, "scales": scales, "mins": None, "bits": 8, "zero_point": 32}
    # -- Q4_K / Q5_K: 6-bit sub-block scales and minimums packed in 12 bytes (gguf_kquants' module docstring)
    lo, mid, hi = b[:, :, 4:8], b[:, :, 8:12], b[:, :, 12:16]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1).float()
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1).float()
    qs = b[:, :, 16:144] if packing is Packing.GGUF_Q4_K else b[:, :, 48:176]
    qs = qs.reshape(N, nb, 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(N, nb, 256)
    if packing is Packing.GGUF_Q5_K:   # bit j of qh[i]: the fifth bit of weight 32j + i
        qh = b[:, :, 16:48].reshape(N, nb, 1, 32)
        codes = codes | (torch.cat([(qh >> j) & 1 for j in range(8)], dim=2).reshape(N, nb, 256) << 4)
    return {"codes": codes.reshape(N, K), "scales": (f16(0)[..., None] * sc).reshape(N, -1),
            "mins": (f16(2)[..., None] * m).reshape(N, -1), "bits": gguf_kquants.GEMV_BITS[packing],
            "zero_point": 0}


def prepare(weight, tdev: str, on_device: bool):
    """The ``PreparedGemvWeight`` of K-quant ``weight`` on the torch device ``tdev``: read with torch ops on the
    device when ``on_device`` (torch or cupy tensors), else with the numpy reference on the host and uploaded."""
    import torch

    from portakern.gemv_weight import PreparedGemvWeight, host_by_group

    fmt, N, K = weight.fmt, weight.N, weight.K
    data = weight.tensors["data"]
    if on_device:
        from portakern import gemv_torch

        t = data if type(data).__module__.startswith("torch") else torch.from_dlpack(data)
        p = parts_torch(fmt.packing, t.to(tdev), N, K)
        iw = interleave_words(p["bits"], fmt.group_size, False)
        words = gemv_torch.pack_words(p["codes"], p["bits"], iw)

        def by_group(a):
            return gemv_torch.by_group(a, N, torch.float32)
    else:
        from portakern.arrays import to_numpy

        p = gguf_kquants.gemv_parts(fmt.packing, np.asarray(to_numpy(data)), N, K)
        iw = interleave_words(p["bits"], fmt.group_size, False)
        words = torch.from_numpy(pack_internal(p["codes"], p["bits"], iw)).to(tdev)

        def by_group(a):
            return torch.from_numpy(host_by_group(a, N)).to(tdev)
    return PreparedGemvWeight(
        qweight=words, scales=by_group(p["scales"]), zeros=None, perm=None, kgroup=None, bits=p["bits"],
        group_size=fmt.group_size, zero_point=p["zero_point"], N=N, K=K,
        mins=None if p["mins"] is None else by_group(p["mins"]))


__all__ = ["PACKINGS", "parts_torch", "prepare"]
