"""The triton backend's GEMV weight layout: ``PreparedGemvWeight`` and ``prepare_weight``, which repacks every packing
of ``portakern.ir.Packing`` once into it (the byte layout is documented in ``kernels/gemv_quant.py``):

* codes as unsigned integers, ``32 // bits`` per int32 word along K, word rows padded to ``K_ALIGN_WORDS`` and
  columns to ``N_ALIGN_WORDS``; int4 word rows interleaved in blocks (``interleave_words``);
* scales and integer zero points transposed to ``(groups, N)`` in the format's scale dtype;
* act-order GPTQ (``g_idx``): K permuted so that groups are contiguous (``perm``); an irregular ``g_idx``
  keeps its per-column group table (``kgroup``);
* on CUDA, for the formats ``frag_eligible`` accepts, a second copy in the tensor-core fragment layout.

Kept apart from the kernels' host code (``quant_gemv.py``) so that anything reading this layout -- tests, benchmarks,
the CUDA C experiments -- needs only this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from portakern.devices import Device
from portakern.ir.quant import Packing

from .gemv_frag_layout import frag_eligible, pack_fragments


# -- the internal layout ---------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class PreparedGemvWeight:
    """A quantized weight in the triton backend's GEMV layout (see ``kernels/gemv_quant.py``).

    Tensors: ``qweight`` int32 ``(KWP, NP)``, K-major; ``scales`` / ``zeros`` ``(G, NP)`` in the
    scale dtype (``zeros`` None for symmetric formats, which use ``zero_point``); ``perm`` int32
    ``(K,)`` or None; ``kgroup`` int32 ``(K,)`` or None. ``dequant[n, k] = (code - zero) * scale``.
    ``frag``: the same codes in the tensor-core fragment layout, int32 ``(KC, NP / 16, 256)``
    (``pack_fragments``), on CUDA devices for the formats ``frag_eligible`` accepts; else None.
    """

    qweight: Any
    scales: Any
    zeros: Any
    perm: Any
    kgroup: Any
    bits: int
    group_size: int
    zero_point: int
    N: int
    K: int
    frag: Any = None

    @property
    def codes_per_word(self) -> int:
        return 32 // self.bits

    @property
    def KWP(self) -> int:
        """Word rows, padded with zeros to a multiple of ``K_ALIGN_WORDS``."""
        return int(self.qweight.shape[0])

    @property
    def stride_qk(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def has_z(self) -> bool:
        return self.zeros is not None

    @property
    def has_perm(self) -> bool:
        return self.perm is not None

    @property
    def interleave(self) -> int:
        """Word rows per interleaved block of ``qweight`` (``interleave_words``)."""
        return interleave_words(self.bits, self.group_size, self.kgroup is not None)

    @property
    def per_elem_group(self) -> bool:
        """Whether the kernel must look the group up per code (irregular g_idx, or a group size
        that is not a whole number of words)."""
        return self.kgroup is not None or self.group_size % self.codes_per_word != 0

    def key(self) -> tuple:
        """What a compiled launcher depends on, beyond the op (worked out on the first call: the weight is frozen,
        and every GEMV call asks): everything its constexprs, grid and checks read from the weight, the shape,
        bits and group size included (a launcher built for one weight runs every later weight of its key
        unchecked), and the device the weight lives on."""
        key = self.__dict__.get("_key")
        if key is None:
            key = (self.N, self.K, self.bits, self.group_size, self.qweight.device,
                   self.has_z, self.has_perm, self.kgroup is not None, self.zero_point, self.per_elem_group,
                   str(self.scales.dtype), self.KWP, self.stride_qk, self.frag is not None)
            object.__setattr__(self, "_key", key)
        return key

    def tensors(self) -> dict[str, Any]:
        return {n: t for n, t in (("qweight", self.qweight), ("scales", self.scales), ("zeros", self.zeros),
                                  ("perm", self.perm), ("kgroup", self.kgroup), ("frag", self.frag)) if t is not None}


#: word rows are padded to a multiple of this (the largest K tile), so tiles need no K mask
K_ALIGN_WORDS = 64
#: the row stride is N rounded up to this (the largest unmasked column tile)
N_ALIGN_WORDS = 128
#: largest interleave of word rows (8 rows: the x values of one code position are 16 bytes of bf16)
MAX_INTERLEAVE = 8


def interleave_words(bits: int, group_size: int, irregular_groups: bool) -> int:
    """Word rows per interleaved block of the internal layout: for int4, the largest power of two,
    at most ``MAX_INTERLEAVE``, dividing the words per group (so a block lies in one group); 1 (plain
    order) for int8 and when groups are not whole words or irregular (per-element group lookup).
    int8 keeps the plain order: its tables use the per-word-row tile, whose x indexing the interleave
    slows (H200 session 4: int8 28672x8192 76% of the floor interleaved, 87% plain)."""
    epw = 32 // bits
    if bits != 4 or irregular_groups or group_size % epw:
        return 1
    wpg = group_size // epw
    return min(MAX_INTERLEAVE, wpg & -wpg)


def pack_internal(codes: np.ndarray, bits: int, interleave: int = 1) -> np.ndarray:
    """Unsigned codes ``(N, K)`` -> int32 words ``(KWP, NP)``, zero-padded to whole tiles and aligned
    rows: code ``e`` (bits ``bits * e``) of word ``(j, n)`` is column
    ``k = (j // iw) * iw * epw + e * iw + j % iw`` of row n (``iw = interleave``; 1: ``k = epw j + e``)."""
    N, K = codes.shape
    epw = 32 // bits
    kw = -(-K // epw)
    kwp = -(-kw // K_ALIGN_WORDS) * K_ALIGN_WORDS
    np_ = -(-N // N_ALIGN_WORDS) * N_ALIGN_WORDS
    padded = np.zeros((np_, kwp * epw), dtype=np.uint32)
    padded[:N, :K] = codes
    # (n, block, e, j) -> (n, block, j, e): word row block * iw + j, code position e
    v = padded.reshape(np_, kwp // interleave, epw, interleave).transpose(0, 1, 3, 2).reshape(np_, kwp, epw)
    words = np.zeros((np_, kwp), dtype=np.uint32)
    for e in range(epw):
        words |= v[:, :, e] << np.uint32(bits * e)
    return np.ascontiguousarray(words.T).view(np.int32)


def unpack_internal(words: np.ndarray, bits: int, interleave: int, N: int, K: int) -> np.ndarray:
    """Inverse of ``pack_internal``: the codes ``(N, K)`` of int32 words ``(KWP, NP)``."""
    epw = 32 // bits
    u = words.view(np.uint32)
    codes = np.stack([(u >> np.uint32(bits * e)) & np.uint32((1 << bits) - 1) for e in range(epw)], axis=1)
    kwp = u.shape[0]
    # (block, j, e, n) -> (block, e, j, n): column k of the block in order
    codes = codes.reshape(kwp // interleave, interleave, epw, -1).transpose(0, 2, 1, 3).reshape(kwp * epw, -1)
    return codes[:K, :N].T


_GLUON: list[bool] = []


def frag_kernel_available() -> bool:
    """Whether this Triton has Gluon's Ampere MMA (``kernels/gemv_frag.py``; Triton 3.5 and later)."""
    if not _GLUON:
        try:
            from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401
            _GLUON.append(True)
        except ImportError:
            _GLUON.append(False)
    return _GLUON[0]


def prepare_weight(backend, weight, device: Device) -> PreparedGemvWeight:
    """Repack ``weight`` (any packing) once into the internal layout, on ``device``.

    Runs on the host with the numpy reference unpacker (``portakern.ir.packing.unpack``), so the
    repacking reads each byte layout exactly as the CPU reference does.
    """
    import torch

    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack

    fmt, N, K = weight.fmt, weight.N, weight.K
    host = {k: np.asarray(to_numpy(v)) for k, v in weight.tensors.items()}
    codes, scales, zeros, group = unpack(fmt, host, N, K)
    # -- unsigned codes: GGUF Q8_0 stores signed codes with zero point 0
    offset = (1 << (fmt.bits - 1)) if fmt.packing is Packing.GGUF_Q8_0 else 0
    codes = codes + offset
    # -- act-order: permute K so that groups are contiguous, when every group has group_size columns
    GS = fmt.group_size
    perm = kgroup = None
    if not np.array_equal(group, np.arange(K) // GS):
        counts = np.bincount(group, minlength=K // GS)
        if np.all(counts == GS):
            perm = np.argsort(group, kind="stable").astype(np.int32)
            codes = codes[:, perm]
        else:
            kgroup = group.astype(np.int32)
    tdev = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    sdt = getattr(torch, fmt.scale_dtype.value)

    def dev(a, dtype=None):
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.to(device=tdev, dtype=dtype or t.dtype)

    def by_group(a):  # (N, G) -> (G, NP), columns past N repeat column 0 (finite, never stored)
        np_ = -(-N // N_ALIGN_WORDS) * N_ALIGN_WORDS
        t = np.empty((a.shape[1], np_), dtype=np.float32)
        t[:, :N] = a.T
        t[:, N:] = a.T[:, :1]
        return t

    frag = None
    if (device.type == "cuda" and frag_kernel_available()
            and frag_eligible(fmt.bits, GS, perm is not None, kgroup is not None) is None):
        frag = dev(pack_fragments(codes, N_ALIGN_WORDS))
    prepared = PreparedGemvWeight(
        qweight=dev(pack_internal(codes, fmt.bits, interleave_words(fmt.bits, GS, kgroup is not None))),
        scales=dev(by_group(scales), sdt),
        zeros=None if fmt.symmetric else dev(by_group(zeros + offset), sdt),
        perm=None if perm is None else dev(perm),
        kgroup=None if kgroup is None else dev(kgroup),
        bits=fmt.bits, group_size=GS, zero_point=int(fmt.zero_point + offset), N=N, K=K, frag=frag)
    if device.type == "cuda":
        # once per weight: a kernel launched with pdl reads its first weight tiles before waiting
        # for the previous work in the stream, so the uploads must be complete before any launch
        torch.cuda.synchronize(tdev)
    return prepared
