"""Reference numpy packers: one readable ``pack_*`` / ``unpack_*`` pair per ``Packing``.

The byte layouts are the contract documented on ``portakern.ir.Packing``; this module is its
executable form. Everything meets in one *unpacked* form::

    codes   int64   (N, K)         integer codes (unsigned, GGUF Q8_0 signed)
    scales  float64 (N, n_groups)  n_groups = K // group_size
    zeros   float64 (N, n_groups)  integer zero points (symmetric: filled with fmt.zero_point)
    group   int64   (K,)           the group of each input channel k (k // group_size, or GPTQ g_idx)

    dequant[n, k] = (codes[n, k] - zeros[n, group[k]]) * scales[n, group[k]]

GGUF Q4_K and Q5_K also subtract a float minimum per group, which that form cannot hold: ``unpack_affine``
returns it as a fifth array ``mins`` (zero for every other packing), ``dequant = (codes - zeros) * scales -
mins``, and ``unpack`` refuses them. Their byte layouts, readers, writers and quantizer live in
``portakern.ir.gguf_kquants`` (as does Q6_K's); ``pack`` refuses all three K-quants (their scales are products
``d * sc`` of two stored integers, which the unpacked form does not split: use ``gguf_kquants.pack_fields`` or
``gguf_kquants.quantize``).

Inputs are numpy arrays (callers holding torch or cupy arrays convert with
``portakern.arrays.to_numpy`` first). numpy has no bfloat16: a ``scale_dtype`` of bfloat16 is stored
here as a float32 array holding bfloat16-exact values; ``validate_tensors`` accepts float32 (or a
real bfloat16 array) for it.

GPTQ v1 stores ``zero - 1`` in four bits and adds the one back, so its zero points lie in 1..16;
``pack_gptq`` refuses a zero point of 0 (AutoGPTQ's own packer would corrupt the word).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from . import gguf_kquants
from .dtypes import DType
from .errors import InvalidInputError, InvalidTypeError
from .quant import GGUF_LAYOUT, Packing, QuantFormat

#: AutoAWQ's interleave: nibble i of a word holds output channel 8j + AWQ_ORDER[i]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_IDENTITY = tuple(range(8))
GGUF_BLOCK_BYTES = {Packing.GGUF_Q4_0: 18, Packing.GGUF_Q8_0: 34,  # 2-byte fp16 scale + codes
                    **gguf_kquants.BLOCK_BYTES}                       # K-quants: a super-block of 256


# -- validation --------------------------------------------------------------------------------

def tensor_specs(fmt: QuantFormat, N: int, K: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], str]]:
    """The tensors a packing holds: ``name -> (shape, allowed dtype names, shape formula)``."""
    G = fmt.group_size
    ng = K // G
    scale = (fmt.scale_dtype.value,) + (("float32",) if fmt.scale_dtype is DType.bfloat16 else ())
    p = fmt.packing
    if p is Packing.NATIVE:
        specs = {"qweight": ((N, K * fmt.bits // 8), ("uint8",), f"(N, K * {fmt.bits} // 8)"),
                 "scales": ((N, ng), scale, "(N, K // group_size)")}
        if not fmt.symmetric:
            specs["zeros"] = ((N, ng), ("uint8",), "(N, K // group_size)")
        return specs
    if p is Packing.AWQ:
        return {"qweight": ((K, N // 8), ("int32",), "(K, N // 8)"),
                "qzeros": ((ng, N // 8), ("int32",), "(K // group_size, N // 8)"),
                "scales": ((ng, N), scale, "(K // group_size, N)")}
    if p is Packing.GPTQ:
        specs = {"qweight": ((K // 8, N), ("int32",), "(K // 8, N)"),
                 "qzeros": ((ng, N // 8), ("int32",), "(K // group_size, N // 8)"),
                 "scales": ((ng, N), scale, "(K // group_size, N)")}
        if fmt.has_g_idx:
            specs["g_idx"] = ((K,), ("int32",), "(K,)")
        return specs
    nbytes, block = GGUF_BLOCK_BYTES[p], GGUF_LAYOUT[p][2]
    return {"data": ((N, K // block * nbytes), ("uint8",), f"(N, K // {block} * {nbytes})")}


def _dtype_name(a: Any) -> str:
    return str(a.dtype).replace("torch.", "")


def validate_tensors(fmt: QuantFormat, tensors: Mapping[str, Any], N: int, K: int,
                     argument: str | None = "tensors") -> None:
    """Check names, shapes and dtypes of ``tensors`` against ``fmt``'s layout (no data is read).

    Works on any array with ``.shape`` and ``.dtype`` (numpy, torch, cupy). Raises
    ``InvalidInputError`` (bad format, missing/extra tensor, wrong shape) or ``InvalidTypeError``
    (wrong dtype) naming the tensor as ``argument['name']`` (just ``name`` when ``argument`` is None).
    """
    fmt.verify(K=K, N=N)  # also: GGUF formats embed float16 scales
    specs = tensor_specs(fmt, N, K)
    where = f"packing {fmt.packing.value} (bits={fmt.bits}, group_size={fmt.group_size}, N={N}, K={K})"
    label = (lambda n: f"{argument}[{n!r}]") if argument else (lambda n: n)
    missing = [n for n in specs if n not in tensors]
    extra = [n for n in tensors if n not in specs]
    if missing or extra:
        raise InvalidInputError(
            f"{argument or 'tensors'} has keys {sorted(tensors)} but {where} holds exactly "
            f"{sorted(specs)}" + (f"; missing {missing}" if missing else "")
            + (f"; unexpected {extra}" if extra else "")
            + " (see portakern.ir.Packing for each layout)")
    for name, (shape, dtypes, formula) in specs.items():
        a = tensors[name]
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise InvalidTypeError(f"{label(name)} is a {type(a).__name__}: expected a numpy array, "
                                   "torch tensor or cupy array")
        if tuple(a.shape) != shape:
            fits = [g for g in range(2, K + 1) if K % g == 0 and "group_size" in formula
                    and tensor_specs(replace(fmt, group_size=g), N, K)[name][0] == tuple(a.shape)]
            hint = f"; that shape fits group_size={fits[0]}: check group_size" if fits else ""
            raise InvalidInputError(f"{label(name)} has shape {tuple(a.shape)} but {where} needs "
                                    f"{formula} = {shape}{hint}")
        if _dtype_name(a) not in dtypes:
            raise InvalidTypeError(f"{label(name)} has dtype {_dtype_name(a)} but {where} stores it as "
                                   f"{' or '.join(dtypes)}; {_dtype_hint(_dtype_name(a), dtypes[0])}")


def _dtype_hint(have: str, want: str) -> str:
    """How to get from dtype ``have`` to ``want``: reinterpret words of the same width (uint32 packed
    words are int32 words), convert everything else (int64 words wrap to the same 32 bits)."""
    if want == "int32" and have == "uint32":
        return "reinterpret the same bits with .view(numpy.int32) (torch: .view(torch.int32))"
    if want == "bfloat16":  # numpy has none: float32 carries bf16 values
        return "convert it with torch .to(torch.bfloat16) (numpy: float32 holding bfloat16 values)"
    return f"convert it with .astype(numpy.{want}) (torch: .to(torch.{want}))"


def _check_range(name: str, a: np.ndarray, lo: int, hi: int, rule: str) -> None:
    if a.size and (a.min() < lo or a.max() > hi):
        bad = np.argwhere((a < lo) | (a > hi))[0]
        raise InvalidInputError(f"{name}[{', '.join(map(str, bad))}]={a[tuple(bad)]} is out of range: {rule} "
                                f"must lie in [{lo}, {hi}]; clip or requantize")


def check_g_idx(g_idx: np.ndarray, K: int, group_size: int, argument: str = "g_idx") -> None:
    """Raise ``InvalidInputError`` unless ``g_idx`` is (K,) with every group in [0, K // group_size);
    ``InvalidTypeError`` unless it holds integers (a float index would be truncated, not refused)."""
    if not np.issubdtype(g_idx.dtype, np.integer):
        raise InvalidTypeError(f"{argument} has dtype {g_idx.dtype}: it must hold integer group indices; "
                               "convert exact values with .astype(numpy.int32)")
    if g_idx.shape != (K,):
        raise InvalidInputError(f"{argument} has shape {g_idx.shape}: it must be (K,) = ({K},), the group "
                                "of each input channel")
    _check_range(argument, g_idx, 0, K // group_size - 1,
                 f"groups (K={K} // group_size={group_size} = {K // group_size} groups)")


def check_bf16_carrier(fmt: QuantFormat, scales: np.ndarray, argument: str = "tensors['scales']") -> None:
    """For a bfloat16 ``scale_dtype`` held in a float32 array (numpy has no bfloat16): raise
    ``InvalidInputError`` unless every value is a bfloat16 value (low 16 bits zero; NaN passes).

    Otherwise the float64 reference would use the float32 value while a backend that stores the
    scales in bfloat16 rounds them: two answers for one weight.
    """
    if fmt.scale_dtype is not DType.bfloat16 or scales.dtype != np.float32:
        return
    off = ((scales.view(np.uint32) & np.uint32(0xFFFF)) != 0) & ~np.isnan(scales)
    if off.any():
        bad = tuple(int(i) for i in np.argwhere(off)[0])
        raise InvalidInputError(
            f"{argument}[{', '.join(map(str, bad))}]={scales[bad]!s} is not a bfloat16 value, but the format has "
            "scale_dtype=bfloat16 (a float32 array may only carry bfloat16 values); round the scales to "
            "bfloat16 first (torch .to(torch.bfloat16)) or use scale_dtype=float32")


# -- bit helpers -------------------------------------------------------------------------------

def _pack_words(nibbles: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """Pack ``(R, 8C)`` 4-bit values into int32 ``(R, C)``: nibble i of word c = value 8c + order[i]."""
    v = nibbles.astype(np.uint32).reshape(nibbles.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for i, src in enumerate(order):
        words |= v[:, :, src] << np.uint32(4 * i)
    return words.view(np.int32)


def _unpack_words(words: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """Inverse of ``_pack_words``: int32 ``(R, C)`` -> int64 ``(R, 8C)``."""
    w = np.ascontiguousarray(words).view(np.uint32)
    out = np.empty(w.shape + (8,), dtype=np.int64)
    for i, dst in enumerate(order):
        out[:, :, dst] = (w >> np.uint32(4 * i)) & 0xF
    return out.reshape(w.shape[0], -1)


def gptq_v2_zeros_to_v1(qzeros: np.ndarray) -> np.ndarray:
    """GPTQ v2 ``qzeros`` (int32 ``(G, N // 8)``, eight zero points a word) in the v1 form ``Packing.GPTQ`` reads
    (each zero point minus one). Raises ``InvalidInputError`` for a zero point of 0, which v1 cannot hold."""
    z = _unpack_words(qzeros, _IDENTITY)
    if (z == 0).any():
        raise InvalidInputError(f"qzeros (checkpoint_format='gptq_v2') holds {int((z == 0).sum())} zero points of "
                                "0, which the v1 layout the kernels read (zero - 1 in four bits) cannot hold; "
                                "dequantize the checkpoint and requantize it with portakern.quantize(w, ...)")
    return _pack_words(z - 1, _IDENTITY)


def _store_scales(scales: np.ndarray, dtype: DType) -> np.ndarray:
    """Scales in ``dtype`` (round to nearest, ties to even); bfloat16 becomes float32 holding bf16 values.

    bfloat16 is rounded straight from float64 (8 significant bits, subnormal step 2^-133): going
    through float32 first would round twice, and a value just above a bf16 midpoint would land on
    it and then go to even -- one bf16 step off.
    """
    s = np.asarray(scales, dtype=np.float64)
    if dtype is DType.bfloat16:
        finite = np.isfinite(s)
        _, e = np.frexp(np.where(finite & (s != 0), s, 1.0))      # |s| in [2^(e-1), 2^e)
        step = np.ldexp(1.0, np.maximum(e - 8, -133))              # one bf16 unit in the last place
        with np.errstate(over="ignore"):                           # past the bf16 maximum: +-inf
            return np.where(finite, np.round(s / step) * step, s).astype(np.float32)
    return s.astype(np.float16 if dtype is DType.float16 else np.float32)


def _groups(fmt: QuantFormat, K: int) -> np.ndarray:
    return np.arange(K, dtype=np.int64) // fmt.group_size


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


# -- one pack/unpack pair per packing ----------------------------------------------------------

def unpack_native(fmt: QuantFormat, t: Mapping[str, np.ndarray], N: int, K: int):
    q = np.asarray(t["qweight"])
    if fmt.bits == 4:
        codes = np.stack([q & 0xF, q >> 4], axis=-1).reshape(N, K).astype(np.int64)
    else:
        codes = q.astype(np.int64)
    zeros = (_f64(t["zeros"]) if not fmt.symmetric
             else np.full((N, K // fmt.group_size), float(fmt.zero_point)))
    return codes, _f64(t["scales"]), zeros, _groups(fmt, K)


def pack_native(fmt, codes, scales, zeros, N, K, g_idx=None):
    c = codes.astype(np.uint8)
    qweight = (c[:, 0::2] | (c[:, 1::2] << np.uint8(4))) if fmt.bits == 4 else c
    out = {"qweight": np.ascontiguousarray(qweight), "scales": _store_scales(scales, fmt.scale_dtype)}
    if not fmt.symmetric:
        out["zeros"] = zeros.astype(np.uint8)
    return out


def unpack_awq(fmt, t, N, K):
    codes = _unpack_words(np.asarray(t["qweight"]), AWQ_ORDER).T          # (K, N) -> (N, K)
    zeros = _unpack_words(np.asarray(t["qzeros"]), AWQ_ORDER).T.astype(np.float64)
    return np.ascontiguousarray(codes), _f64(t["scales"]).T.copy(), zeros, _groups(fmt, K)


def pack_awq(fmt, codes, scales, zeros, N, K, g_idx=None):
    return {"qweight": _pack_words(codes.T, AWQ_ORDER), "qzeros": _pack_words(zeros.T, AWQ_ORDER),
            "scales": np.ascontiguousarray(_store_scales(scales, fmt.scale_dtype).T)}


def unpack_gptq(fmt, t, N, K):
    codes = _unpack_words(np.asarray(t["qweight"]).T, _IDENTITY)           # (N, K//8) words along K
    zeros = (_unpack_words(np.asarray(t["qzeros"]), _IDENTITY) + 1).T.astype(np.float64)
    group = np.asarray(t["g_idx"]).astype(np.int64) if fmt.has_g_idx else _groups(fmt, K)
    return codes, _f64(t["scales"]).T.copy(), zeros, group


def pack_gptq(fmt, codes, scales, zeros, N, K, g_idx=None):
    _check_range("zeros", zeros, 1, 16, "GPTQ v1 zero points (stored as zero - 1 in four bits)")
    out = {"qweight": np.ascontiguousarray(_pack_words(codes, _IDENTITY).T),
           "qzeros": _pack_words((zeros.T - 1), _IDENTITY),
           "scales": np.ascontiguousarray(_store_scales(scales, fmt.scale_dtype).T)}
    if fmt.has_g_idx:
        out["g_idx"] = np.asarray(g_idx).astype(np.int32)
    return out


def _gguf_blocks(fmt, t, N, K):
    blocks = np.ascontiguousarray(t["data"]).reshape(N, K // 32, GGUF_BLOCK_BYTES[fmt.packing])
    d = blocks[:, :, :2].copy().view("<f2")[:, :, 0].astype(np.float64)   # little-endian fp16
    return d, blocks[:, :, 2:]


def unpack_gguf_q4_0(fmt, t, N, K):
    d, qs = _gguf_blocks(fmt, t, N, K)
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(N, K).astype(np.int64)
    return codes, d, np.full_like(d, 8.0), _groups(fmt, K)


def unpack_gguf_q8_0(fmt, t, N, K):
    d, qs = _gguf_blocks(fmt, t, N, K)
    codes = qs.copy().view(np.int8).reshape(N, K).astype(np.int64)
    return codes, d, np.zeros_like(d), _groups(fmt, K)


def _gguf_pack(scales, payload, N, K):
    d = np.ascontiguousarray(scales.astype("<f2")).view(np.uint8).reshape(N, K // 32, 2)
    return {"data": np.concatenate([d, payload], axis=-1).reshape(N, -1)}


def pack_gguf_q4_0(fmt, codes, scales, zeros, N, K, g_idx=None):
    c = codes.astype(np.uint8).reshape(N, K // 32, 32)
    return _gguf_pack(scales, c[:, :, :16] | (c[:, :, 16:] << np.uint8(4)), N, K)


def pack_gguf_q8_0(fmt, codes, scales, zeros, N, K, g_idx=None):
    return _gguf_pack(scales, codes.astype(np.int8).view(np.uint8).reshape(N, K // 32, 32), N, K)


_PAIRS = {
    Packing.NATIVE: (pack_native, unpack_native),
    Packing.AWQ: (pack_awq, unpack_awq),
    Packing.GPTQ: (pack_gptq, unpack_gptq),
    Packing.GGUF_Q4_0: (pack_gguf_q4_0, unpack_gguf_q4_0),
    Packing.GGUF_Q8_0: (pack_gguf_q8_0, unpack_gguf_q8_0),
    **{p: (gguf_kquants.refuse_pack, gguf_kquants.unpack) for p in gguf_kquants.BLOCK_BYTES},
}


# -- public entry points -----------------------------------------------------------------------

def unpack(fmt: QuantFormat, tensors: Mapping[str, Any], N: int, K: int):
    """Unpack ``tensors`` (numpy) in ``fmt`` into ``(codes, scales, zeros, group_index)``.

    ``codes`` int64 (N, K), ``scales`` and ``zeros`` float64 (N, K // group_size), ``group_index``
    int64 (K,), such that ``dequant[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g]`` with
    ``g = group_index[k]``. Symmetric formats get ``zeros`` filled with ``fmt.zero_point``; GGUF
    Q8_0 codes are signed with zero point 0. Raises ``InvalidInputError``/``InvalidTypeError`` for
    tensors that do not match the layout, a GPTQ ``g_idx`` naming a group that does not exist, or
    float32 scales for a bfloat16 ``scale_dtype`` holding a value that is not a bfloat16; and
    ``InvalidInputError`` for GGUF Q4_K / Q5_K, whose float minimums only ``unpack_affine`` returns.
    """
    _check_unpack(fmt, tensors, N, K)
    return _PAIRS[fmt.packing][1](fmt, tensors, N, K)


def unpack_affine(fmt: QuantFormat, tensors: Mapping[str, Any], N: int, K: int):
    """``unpack`` with the float minimum of every group: ``(codes, scales, zeros, mins, group_index)``.

    ``mins`` float64 ``(N, K // group_size)`` with ``dequant[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g]
    - mins[n, g]``: ``dmin * m`` for GGUF Q4_K / Q5_K, zero for every other packing (whose other four arrays are
    ``unpack``'s). The same errors as ``unpack``, except that every packing is read.
    """
    if not fmt.has_mins:
        codes, scales, zeros, group = unpack(fmt, tensors, N, K)
        return codes, scales, zeros, np.zeros_like(scales), group
    _check_unpack(fmt, tensors, N, K)
    codes, scales, zeros, mins = gguf_kquants.affine(fmt.packing, tensors["data"], N, K)
    return codes, scales, zeros, mins, _groups(fmt, K)


def _check_unpack(fmt: QuantFormat, tensors: Mapping[str, Any], N: int, K: int) -> None:
    validate_tensors(fmt, tensors, N, K)
    if "scales" in tensors:  # GGUF blocks embed float16 scales
        check_bf16_carrier(fmt, np.asarray(tensors["scales"]))
    if fmt.has_g_idx:
        check_g_idx(np.asarray(tensors["g_idx"]), K, fmt.group_size, "tensors['g_idx']")


def dequantize(fmt: QuantFormat, tensors: Mapping[str, Any], N: int, K: int) -> np.ndarray:
    """The float64 ``(N, K)`` weight stored in ``tensors`` (numpy) with format ``fmt``.

    ``(codes - zeros[:, group]) * scales[:, group] - mins[:, group]`` from ``unpack_affine``, computed in
    float64 so the result is exact for every packing (codes and fp16/bf16/fp32 scales are exact in float64;
    for the K-quants see ``portakern.ir.gguf_kquants``).
    """
    codes, scales, zeros, mins, group = unpack_affine(fmt, tensors, N, K)
    out = (codes - zeros[:, group]) * scales[:, group]
    return out - mins[:, group] if fmt.has_mins else out


def pack(fmt: QuantFormat, codes: Any, scales: Any, zeros: Any, N: int, K: int,
         g_idx: Any = None) -> dict[str, np.ndarray]:
    """Pack unpacked data into ``fmt``'s documented layout: the inverse of ``unpack``.

    ``codes`` (N, K) integers in the packing's code range (``[0, 2^bits)``; GGUF Q8_0
    ``[-128, 127]``); ``scales`` (N, K // group_size), stored in ``fmt.scale_dtype`` (rounded to
    nearest); ``zeros`` (N, K // group_size) integers, or None for symmetric formats (where, if
    given, they must equal ``fmt.zero_point``); ``g_idx`` (K,) only for GPTQ with ``has_g_idx``.
    Returns numpy arrays keyed by the tensor names of ``portakern.ir.Packing``.
    """
    fmt.verify(K=K, N=N)
    if fmt.packing in gguf_kquants.BLOCK_BYTES:
        gguf_kquants.refuse_pack(fmt)
    ng = K // fmt.group_size
    codes = np.asarray(codes)
    if codes.shape != (N, K) or not np.issubdtype(codes.dtype, np.integer):
        raise InvalidInputError(f"codes has shape {codes.shape} and dtype {codes.dtype}: it must be an "
                                f"integer array of shape (N, K) = ({N}, {K})")
    lo, hi = (-128, 127) if fmt.packing is Packing.GGUF_Q8_0 else (0, (1 << fmt.bits) - 1)
    _check_range("codes", codes, lo, hi, f"{fmt.bits}-bit {fmt.packing.value} codes")
    try:
        scales = np.asarray(scales, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"scales is a {type(scales).__name__} that does not convert to float64: pass "
                               f"real numbers, shape (N, K // group_size) = ({N}, {ng})") from None
    if scales.shape != (N, ng):
        raise InvalidInputError(f"scales has shape {scales.shape}: it must be (N, K // group_size) = ({N}, {ng})")
    if fmt.symmetric:
        if zeros is not None and np.any(np.asarray(zeros) != fmt.zero_point):
            raise InvalidInputError(f"zeros must be None (or all {fmt.zero_point}) for a symmetric format: "
                                    f"{fmt.packing.value} has the fixed zero point {fmt.zero_point}")
        zeros = None
    else:
        if zeros is None:
            raise InvalidInputError(f"zeros=None but packing {fmt.packing.value} is asymmetric: pass the "
                                    f"integer zero points, shape (N, K // group_size) = ({N}, {ng})")
        zeros = np.asarray(zeros)
        if zeros.shape != (N, ng) or np.any(zeros != np.round(zeros)):
            raise InvalidInputError(f"zeros has shape {zeros.shape}: it must hold integers, shape "
                                    f"(N, K // group_size) = ({N}, {ng})")
        zeros = zeros.astype(np.int64)
        if fmt.packing is not Packing.GPTQ:
            _check_range("zeros", zeros, 0, (1 << fmt.bits) - 1, f"{fmt.bits}-bit zero points")
    if fmt.has_g_idx:
        if g_idx is None:
            raise InvalidInputError("g_idx=None but fmt.has_g_idx=True: pass the (K,) group of each input "
                                    "channel, or use a format with has_g_idx=False")
        check_g_idx(np.asarray(g_idx), K, fmt.group_size)
    elif g_idx is not None:
        raise InvalidInputError(f"g_idx was given but fmt.has_g_idx=False ({fmt.packing.value}): drop it, "
                                "or use packing gptq with has_g_idx=True")
    return _PAIRS[fmt.packing][0](fmt, codes, scales, zeros, N, K, g_idx)


# -- round-to-nearest quantizer ----------------------------------------------------------------

def ceil_to_dtype(x: np.ndarray, dtype: DType) -> np.ndarray:
    """The smallest value representable in ``dtype`` that is >= ``x`` (x > 0), as float64."""
    with np.errstate(over="ignore"):  # overflow -> inf, reported by the caller
        y = x.astype(np.float16 if dtype is DType.float16 else np.float32)
    y = np.where(y.astype(np.float64) < x, np.nextafter(y, np.inf), y)
    if dtype is DType.bfloat16:  # bf16 = top half of fp32: truncate, then step up if bits were lost
        bits = y.astype(np.float32).view(np.uint32)
        top = bits & np.uint32(0xFFFF0000)
        y = np.where(top != bits, top + np.uint32(0x10000), top).astype(np.uint32).view(np.float32)
    return y.astype(np.float64)


def quantize_native(w: Any, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                    scale_dtype: DType | str = DType.float16) -> tuple[dict[str, np.ndarray], QuantFormat]:
    """Round-to-nearest min/max quantization of ``w (N, K)`` into the NATIVE packing.

    Per group of ``group_size`` along K:

    * asymmetric: the range is widened to include 0 (``lo = min(w, 0)``, ``hi = max(w, 0)``, as
      AutoGPTQ does), ``scale = (hi - lo) / (2^bits - 1)``, ``zero = round(-lo / scale)``,
      ``q = clip(round(w / scale) + zero, 0, 2^bits - 1)``; zeros of ``w`` dequantize exactly.
    * symmetric: ``scale = max|w| / (2^(bits-1) - 1)``, ``q = round(w / scale) + 2^(bits-1)``
      (codes 1 .. 2^bits - 1; code 0 is unused so nothing clips).

    The scale is rounded *up* to ``scale_dtype`` before the codes are computed, so the range always
    fits and ``max|w - dequant| <= scale / 2`` holds with the stored scale. An all-zero group gets
    scale 1 (any scale is exact there). Returns ``(tensors, fmt)``; raises ``InvalidInputError`` for
    a bad shape, bits, group size, non-finite values or a scale that overflows ``scale_dtype``, and
    ``InvalidTypeError`` for a ``symmetric`` that is not a bool.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise InvalidInputError(f"w has shape {w.shape}: expected a 2-D weight (N, K) = (out, in features)")
    N, K = w.shape
    if bits not in (4, 8):
        raise InvalidInputError(f"bits={bits!r} is not supported by the native packing: choose 4 or 8")
    if not isinstance(symmetric, (bool, np.bool_)):  # bool("False") is True: refuse, never guess
        raise InvalidTypeError(f"symmetric={symmetric!r} must be True or False (a bool, not a "
                               f"{type(symmetric).__name__})")
    fmt = QuantFormat(bits=bits, group_size=group_size, symmetric=bool(symmetric),
                      packing=Packing.NATIVE, scale_dtype=DType.parse(scale_dtype, argument="scale_dtype"))
    fmt.verify(K=K, N=N)
    if not np.isfinite(w).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(w))[0])
        raise InvalidInputError(f"w{list(bad)}={w[bad]}: w must be finite to quantize; replace NaN/Inf first")
    wg = w.reshape(N, K // group_size, group_size)
    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        raw = np.abs(wg).max(axis=-1) / qmax
    else:
        qmax = (1 << bits) - 1
        lo, hi = np.minimum(wg.min(axis=-1), 0.0), np.maximum(wg.max(axis=-1), 0.0)
        raw = (hi - lo) / qmax
    scales = ceil_to_dtype(np.where(raw == 0, 1.0, raw), fmt.scale_dtype)
    if not np.isfinite(scales).all():
        big = float(np.abs(w).max())
        wider = "pass scale_dtype='float32' or " if fmt.scale_dtype is DType.float16 else ""
        raise InvalidInputError(f"w has values up to {big:.4g}: its scale overflows scale_dtype="
                                f"{fmt.scale_dtype.value}; {wider}rescale w")
    s = scales[..., None]
    if symmetric:
        zeros = None
        codes = np.clip(np.round(wg / s), -qmax, qmax) + fmt.zero_point
    else:
        zeros = np.clip(np.round(-lo / scales), 0, qmax)
        codes = np.clip(np.round(wg / s) + zeros[..., None], 0, qmax)
    codes = codes.astype(np.int64).reshape(N, K)
    return pack(fmt, codes, scales, zeros, N, K), fmt
