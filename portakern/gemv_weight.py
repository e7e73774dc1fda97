"""The prepared quantized weight of the GPU GEMV kernels: ``PreparedGemvWeight`` and ``prepare_gemv_weight``.

A backend-neutral contract: every backend whose ``weight_layout`` is ``GEMV_LAYOUT`` (triton, cuda) reads a
``PreparedGemvWeight``, and ``portakern.torch_ops`` passes its tensors to whichever of them dispatch picks. They
share one prepared copy per weight and device (``QuantizedWeight.prepared[(GEMV_LAYOUT, device)]``), so the copy
depends on the weight and the device only, never on which backend built it. The byte layout is
``portakern.ir.gemv_layout``'s:

* codes as unsigned integers, ``32 // bits`` per int32 word along K, word rows padded to ``K_ALIGN_WORDS`` and
  columns to ``N_ALIGN_WORDS``; int4 word rows interleaved in blocks (``interleave_words``);
* scales and integer zero points transposed to ``(groups, NP)`` in the format's scale dtype;
* act-order GPTQ (``g_idx``): K permuted so that groups are contiguous (``perm``); an irregular ``g_idx``
  keeps its per-column group table (``kgroup``);
* on CUDA, for the formats ``frag_eligible`` accepts, a second copy in the tensor-core fragment layout, where
  the kernel that reads it can run (``fragment_kernel_available``).

torch is imported inside the functions: the core imports without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from portakern.devices import Device
from portakern.ir.gemv_layout import (N_ALIGN_WORDS, frag_eligible, interleave_words, pack_fragments,
                                      pack_internal, padded_columns)
from portakern.ir.quant import Packing

#: the name of this layout, which backends reading a ``PreparedGemvWeight`` declare as ``Backend.weight_layout``
GEMV_LAYOUT = "gemv-tiled"


@dataclass(frozen=True, eq=False)
class PreparedGemvWeight:
    """A quantized weight in the GEMV layout (``portakern.ir.gemv_layout``).

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
        """The tensors that are present, by field name."""
        return {n: t for n, t in (("qweight", self.qweight), ("scales", self.scales), ("zeros", self.zeros),
                                  ("perm", self.perm), ("kgroup", self.kgroup), ("frag", self.frag)) if t is not None}


@functools.lru_cache(maxsize=None)
def fragment_kernel_available() -> bool:
    """Whether the kernel that reads the fragment layout can run in this process: it is written in Triton's Gluon
    and needs its Ampere MMA (``mma_v2``; Triton 3.5 and later). Probes the library (no portakern backend), once."""
    try:
        from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: F401
    except ImportError:
        return False
    return True


def wants_fragments(device: Device) -> bool:
    """Whether a weight prepared for ``device`` carries the fragment copy (for the formats that can hold one):
    on CUDA devices, where the kernel that reads it can run (``fragment_kernel_available``)."""
    return device.type == "cuda" and fragment_kernel_available()


def prepare_gemv_weight(weight, device: Device, *, fragments: bool | None = None) -> PreparedGemvWeight:
    """Repack the ``QuantizedWeight`` ``weight`` (any packing) once into the GEMV layout, on ``device``.

    ``fragments``: whether to build the tensor-core fragment copy (for the formats ``frag_eligible`` accepts);
    None (the default, what every backend of ``GEMV_LAYOUT`` passes, since they share one cached copy):
    ``wants_fragments(device)``. Runs on the host with the numpy reference unpacker
    (``portakern.ir.packing.unpack``), so the repacking reads each byte layout exactly as the CPU reference
    does. On CUDA it synchronises the device once after the uploads: a kernel launched with programmatic
    dependent launch reads its first weight tiles before waiting for the previous work in the stream.
    """
    import torch

    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack

    if fragments is None:
        fragments = wants_fragments(device)
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
        t = np.empty((a.shape[1], padded_columns(N)), dtype=np.float32)
        t[:, :N] = a.T
        t[:, N:] = a.T[:, :1]
        return t

    frag = None
    if fragments and frag_eligible(fmt.bits, GS, perm is not None, kgroup is not None) is None:
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


__all__ = ["GEMV_LAYOUT", "PreparedGemvWeight", "fragment_kernel_available", "prepare_gemv_weight",
           "wants_fragments"]
