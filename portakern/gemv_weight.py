"""The prepared quantized weight of the GPU GEMV kernels: ``PreparedGemvWeight`` and ``prepare_gemv_weight``.

A backend-neutral contract: every backend whose ``weight_layout`` is ``GEMV_LAYOUT`` (triton, cuda) reads a
``PreparedGemvWeight``, and ``portakern.torch_ops`` passes its tensors to whichever of them dispatch picks. They
share one prepared copy per weight and device (``QuantizedWeight.prepared[(GEMV_LAYOUT, device)]``), so the copy
depends on the weight and the device only, never on which backend built it. The byte layout is
``portakern.ir.gemv_layout``'s:

* codes as unsigned integers, ``32 // bits`` per int32 word along K, word rows padded to ``K_ALIGN_WORDS`` and
  columns to ``N_ALIGN_WORDS``; int4 word rows interleaved in blocks (``interleave_words``);
* scales and integer zero points transposed to ``(groups, NP)`` in the format's scale dtype;
* GGUF K-quants (Q4_K, Q5_K, Q6_K): codes of 4 or 8 bits, float32 scales ``d * sc`` and, for Q4_K and Q5_K, float32
  minimums ``dmin * m`` per group (``mins``; ``portakern.gemv_kquants``);
* act-order GPTQ (``g_idx``): K permuted so that groups are contiguous (``perm``); an irregular ``g_idx``
  keeps its per-column group table (``kgroup``);
* on CUDA, for the formats ``frag_eligible`` accepts, the codes in the tensor-core fragment layout, where
  the kernel that reads it can run (``fragment_kernel_available``): instead of the words (``layout="fragments"``,
  the default: each code held once) or beside them (``layout="words+fragments"``).

A device weight (torch or cupy tensors) is repacked with torch ops on its device (``portakern.gemv_torch``), never
through host memory; host arrays with the numpy reference packers.

torch is imported inside the functions: the core imports without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from portakern.devices import Device
from portakern.ir.gemv_layout import (N_ALIGN_WORDS, frag_eligible, interleave_words, pack_fragments,
                                      pack_internal, padded_columns, padded_rows)
from portakern.ir.quant import Packing

#: the name of this layout, which backends reading a ``PreparedGemvWeight`` declare as ``Backend.weight_layout``
GEMV_LAYOUT = "gemv-tiled"


@dataclass(frozen=True, eq=False)
class PreparedGemvWeight:
    """A quantized weight in the GEMV layout (``portakern.ir.gemv_layout``).

    Tensors: ``qweight`` int32 ``(KWP, NP)``, K-major (None when the weight was prepared with
    ``layout="fragments"`` and holds its codes only in ``frag``); ``scales`` / ``zeros`` ``(G, NP)`` in the
    scale dtype (``zeros`` None for symmetric formats, which use ``zero_point``); ``perm`` int32
    ``(K,)`` or None; ``kgroup`` int32 ``(K,)`` or None. ``dequant[n, k] = (code - zero) * scale - min``.
    ``mins``: float32 ``(G, NP)``, the float minimum of each group (GGUF Q4_K, Q5_K: ``dmin * m``; no zeros then),
    else None (min 0). ``bits`` is the width of the codes in the words (4 or 8), which for Q5_K and Q6_K is wider
    than the format's (``portakern.ir.gguf_kquants.GEMV_BITS``).
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
    mins: Any = None

    @property
    def codes_per_word(self) -> int:
        return 32 // self.bits

    @property
    def KWP(self) -> int:
        """Word rows, padded with zeros to a multiple of ``K_ALIGN_WORDS``."""
        return padded_rows(self.K, self.bits) if self.qweight is None else int(self.qweight.shape[0])

    @property
    def stride_qk(self) -> int:
        return padded_columns(self.N) if self.qweight is None else int(self.qweight.shape[1])

    @property
    def has_words(self) -> bool:
        """Whether the word layout (``qweight``) is present: False for a fragments-only weight."""
        return self.qweight is not None

    @property
    def has_z(self) -> bool:
        return self.zeros is not None

    @property
    def has_mins(self) -> bool:
        return self.mins is not None

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
            key = (self.N, self.K, self.bits, self.group_size, self.scales.device,
                   self.has_z, self.has_perm, self.kgroup is not None, self.zero_point, self.per_elem_group,
                   str(self.scales.dtype), self.KWP, self.stride_qk, self.frag is not None, self.qweight is not None,
                   self.mins is not None)
            object.__setattr__(self, "_key", key)
        return key

    def tensors(self) -> dict[str, Any]:
        """The tensors that are present, by field name."""
        return {n: t for n, t in (("qweight", self.qweight), ("scales", self.scales), ("zeros", self.zeros),
                                  ("perm", self.perm), ("kgroup", self.kgroup), ("frag", self.frag),
                                  ("mins", self.mins)) if t is not None}


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


#: the layouts a prepared weight may hold (``prepare_gemv_weight(..., layout=)``):
#: "words+fragments": the word layout (``qweight``) for every format, plus the fragment layout (``frag``) where the
#: format and device allow it (each int4 code held twice: ~1.03 bytes per parameter at g128);
#: "fragments": only the fragment layout where it can be built (``qweight`` None: each code held once, ~0.53 bytes per
#: parameter), else the word layout; "words": only the word layout (no tensor-core fragment kernel).
#: A fragments-only weight is served at every M: M = 1 to 4 by the cuda backend's fragment kernel where it ranks
#: first (``backends/cuda/__init__.py``), M <= 16 of bf16 x by triton's "frag" kernel, everything else (M > 16,
#: fp16 / fp32 x past the cuda kernel's M, a prologue) by triton dequantizing the fragments for the call and one
#: matmul (``backends/triton/quant_gemv/fragments_dense.py``)
LAYOUTS = ("words+fragments", "fragments", "words")
#: the layout ``prepare_gemv_weight`` builds when none is asked for: "fragments", one resident copy of the codes;
#: set ``portakern.gemv_weight.DEFAULT_LAYOUT`` to change it for the process (the benchmark
#: ``benchmarks/gemv_memory.py`` measures both)
DEFAULT_LAYOUT = "fragments"


def check_layout(layout: str | None) -> str:
    """``layout``, or ``DEFAULT_LAYOUT`` for None; ``InvalidInputError`` for a name not in ``LAYOUTS``."""
    if layout is None:
        layout = DEFAULT_LAYOUT
    if layout not in LAYOUTS:
        from portakern.errors import InvalidInputError

        raise InvalidInputError(f"layout={layout!r} is not a GEMV weight layout: choose one of "
                                f"{', '.join(map(repr, LAYOUTS))} (or None for the default, {DEFAULT_LAYOUT!r})")
    return layout


def prepare_gemv_weight(weight, device: Device, *, fragments: bool | None = None,
                        layout: str | None = None) -> PreparedGemvWeight:
    """Repack the ``QuantizedWeight`` ``weight`` (any packing) once into the GEMV layout, on ``device``.

    ``fragments``: whether to build the tensor-core fragment layout (for the formats ``frag_eligible`` accepts);
    None (the default, what every backend of ``GEMV_LAYOUT`` passes, since they share one cached copy):
    ``wants_fragments(device)``. ``layout``: one of ``LAYOUTS`` (None: ``DEFAULT_LAYOUT``); "fragments" keeps only
    the fragment layout where one is built (``qweight`` None).

    torch tensors are repacked with torch ops on the device they are moved to (``portakern.gemv_torch``): unpacked,
    re-packed and the scales transposed there, in one pass, never through host memory. numpy (and other host)
    arrays are repacked on the host with the numpy reference (``portakern.ir.packing.unpack`` and the packers of
    ``portakern.ir.gemv_layout``), then uploaded; cupy arrays are read through DLPack as torch tensors. Both give
    the same bits. On CUDA it synchronises the device once at the end: a kernel launched with programmatic
    dependent launch reads its first weight tiles before waiting for the previous work in the stream.

    Raises:
      CaptureError (``portakern.capture``) inside CUDA stream capture, where preparing cannot run: prepare
        before capture (``portakern.prepare``).
      InvalidInputError for an unknown ``layout``, or a weight whose native tensors were released
        (``portakern.prepare(..., keep_native=False)``) and that has no prepared copy for ``device``.
    """
    import torch

    from portakern import capture

    layout = check_layout(layout)
    capture.refuse_prepare(weight, device)
    if not weight.tensors:
        from portakern.errors import InvalidInputError

        have = ", ".join(sorted(str(d) for _, d in weight.prepared)) or "none"
        raise InvalidInputError(f"{capture.weight_label(weight)} has no native tensors (released by "
                                f"portakern.prepare(..., keep_native=False)) and no prepared copy for {device} "
                                f"(prepared for: {have}); use it on that device, or prepare it with "
                                "keep_native=True before moving")
    if fragments is None:
        fragments = wants_fragments(device)
    if layout == "words":
        fragments = False
    tdev = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    from portakern import gemv_kquants
    from portakern.gemv_torch import PACKINGS

    kinds = {type(t).__module__.split(".")[0] for t in weight.tensors.values()}
    if weight.fmt.packing in gemv_kquants.PACKINGS:
        prepared = gemv_kquants.prepare(weight, tdev, on_device=kinds <= {"torch", "cupy"})
    elif kinds <= {"torch", "cupy"} and weight.fmt.packing in PACKINGS:
        prepared = _prepare_torch(weight, tdev, fragments, layout)
    else:
        prepared = _prepare_host(weight, tdev, fragments, layout)
    if device.type == "cuda":
        # once per weight: a kernel launched with pdl reads its first weight tiles before waiting
        # for the previous work in the stream, so the repacking must be complete before any launch
        torch.cuda.synchronize(tdev)
    return prepared


def _act_order(group_equal_default: bool, counts_all_gs: bool) -> str:
    """How K is ordered: "plain" (groups of consecutive columns), "perm" (act-order with regular groups: permute
    K so that groups are contiguous) or "kgroup" (irregular groups: a per-column group table)."""
    if group_equal_default:
        return "plain"
    return "perm" if counts_all_gs else "kgroup"


def _prepare_host(weight, tdev: str, fragments: bool, layout: str) -> PreparedGemvWeight:
    """The numpy reference path: unpack and repack on the host, then upload."""
    import torch

    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack

    fmt, N, K = weight.fmt, weight.N, weight.K
    host = {k: np.asarray(to_numpy(v)) for k, v in weight.tensors.items()}
    codes, scales, zeros, group = unpack(fmt, host, N, K)
    # -- unsigned codes: GGUF Q8_0 stores signed codes with zero point 0
    offset = (1 << (fmt.bits - 1)) if fmt.packing is Packing.GGUF_Q8_0 else 0
    codes = codes + offset
    GS = fmt.group_size
    perm = kgroup = None
    how = _act_order(np.array_equal(group, np.arange(K) // GS),
                     bool(np.all(np.bincount(group, minlength=K // GS) == GS)))
    if how == "perm":
        perm = np.argsort(group, kind="stable").astype(np.int32)
        codes = codes[:, perm]
    elif how == "kgroup":
        kgroup = group.astype(np.int32)
    sdt = getattr(torch, fmt.scale_dtype.value)

    def dev(a, dtype=None):
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.to(device=tdev, dtype=dtype or t.dtype)

    def by_group(a):
        return host_by_group(a, N)

    frag = None
    if fragments and frag_eligible(fmt.bits, GS, perm is not None, kgroup is not None) is None:
        frag = dev(pack_fragments(codes, N_ALIGN_WORDS))
    words = None if frag is not None and layout == "fragments" else \
        dev(pack_internal(codes, fmt.bits, interleave_words(fmt.bits, GS, kgroup is not None)))
    return PreparedGemvWeight(
        qweight=words, scales=dev(by_group(scales), sdt),
        zeros=None if fmt.symmetric else dev(by_group(zeros + offset), sdt),
        perm=None if perm is None else dev(perm), kgroup=None if kgroup is None else dev(kgroup),
        bits=fmt.bits, group_size=GS, zero_point=int(fmt.zero_point + offset), N=N, K=K, frag=frag)


def host_by_group(a: np.ndarray, N: int) -> np.ndarray:
    """Per-group values ``(N, G)`` -> float32 ``(G, NP)`` (the scales' and zeros' layout); columns past N repeat
    column 0 (finite, never stored). ``portakern.gemv_torch.by_group`` is its torch form."""
    t = np.empty((a.shape[1], padded_columns(N)), dtype=np.float32)
    t[:, :N] = a.T
    t[:, N:] = a.T[:, :1]
    return t


def _prepare_torch(weight, tdev: str, fragments: bool, layout: str) -> PreparedGemvWeight:
    """The device path: the native tensors moved to ``tdev`` (no copy when they are there), then unpacked and
    repacked with torch ops there (``portakern.gemv_torch``)."""
    import torch

    from portakern import gemv_torch

    fmt, N, K = weight.fmt, weight.N, weight.K
    t = {k: (v if type(v).__module__.startswith("torch") else torch.from_dlpack(v)).to(tdev)
         for k, v in weight.tensors.items()}
    codes, scales, zeros, group = gemv_torch.unpack(fmt, t, N, K)
    offset = (1 << (fmt.bits - 1)) if fmt.packing is Packing.GGUF_Q8_0 else 0
    if offset:
        codes = codes + offset
    codes = codes.to(torch.uint8)
    GS = fmt.group_size
    perm = kgroup = None
    if group is not None:   # a GPTQ g_idx (from_gptq keeps only one that differs from the default)
        if bool(((group < 0) | (group >= K // GS)).any()):
            from portakern.errors import InvalidInputError

            raise InvalidInputError(f"tensors['g_idx'] names a group outside 0..{K // GS - 1} (K={K}, "
                                    f"group_size={GS}); pass the checkpoint's g_idx unchanged")
        default = torch.arange(K, device=group.device) // GS
        counts = torch.bincount(group, minlength=K // GS)
        how = _act_order(bool(torch.equal(group, default)), bool((counts == GS).all()))
        if how == "perm":
            perm = torch.argsort(group, stable=True).to(torch.int32)
            codes = codes[:, perm.long()]
        elif how == "kgroup":
            kgroup = group.to(torch.int32)
    sdt = getattr(torch, fmt.scale_dtype.value)
    frag = None
    if fragments and frag_eligible(fmt.bits, GS, perm is not None, kgroup is not None) is None:
        frag = gemv_torch.pack_fragments(codes, N_ALIGN_WORDS)
    words = None if frag is not None and layout == "fragments" else \
        gemv_torch.pack_words(codes, fmt.bits, interleave_words(fmt.bits, GS, kgroup is not None))
    return PreparedGemvWeight(
        qweight=words, scales=gemv_torch.by_group(scales, N, sdt),
        zeros=None if fmt.symmetric else gemv_torch.by_group(zeros.to(torch.int16) + offset, N, sdt),
        perm=perm, kgroup=kgroup, bits=fmt.bits, group_size=GS, zero_point=int(fmt.zero_point + offset),
        N=N, K=K, frag=frag)


def dequantize_prepared(p: PreparedGemvWeight) -> np.ndarray:
    """The float64 ``(N, K)`` weight a prepared copy holds (read on the host, from its words or, when it holds
    only fragments, from those): ``QuantizedWeight.dequantize`` after the native tensors were released."""
    from portakern.arrays import to_numpy
    from portakern.ir.gemv_layout import unpack_fragments, unpack_internal

    N, K = p.N, p.K
    if p.qweight is not None:
        codes = unpack_internal(np.asarray(to_numpy(p.qweight)), p.bits, p.interleave, N, K)
    else:
        codes = unpack_fragments(np.asarray(to_numpy(p.frag)), N, K)
    codes = codes.astype(np.float64)
    group = np.arange(K) // p.group_size
    if p.kgroup is not None:
        group = np.asarray(to_numpy(p.kgroup)).astype(np.int64)
    scales = np.asarray(to_numpy(p.scales.float())).astype(np.float64)[:, :N]                 # (G, N)
    zeros = (np.asarray(to_numpy(p.zeros.float())).astype(np.float64)[:, :N] if p.zeros is not None
             else np.full_like(scales, float(p.zero_point)))
    mins = 0.0 if p.mins is None else np.asarray(to_numpy(p.mins)).astype(np.float64)[:, :N][group].T
    if p.perm is not None:   # internal column k is original column perm[k], of group k // group_size
        w = np.empty((N, K))
        perm = np.asarray(to_numpy(p.perm)).astype(np.int64)
        w[:, perm] = (codes - zeros[group].T) * scales[group].T
        return w
    return (codes - zeros[group].T) * scales[group].T - mins


__all__ = ["DEFAULT_LAYOUT", "GEMV_LAYOUT", "LAYOUTS", "PreparedGemvWeight", "check_layout", "dequantize_prepared",
           "fragment_kernel_available", "prepare_gemv_weight", "wants_fragments"]
