"""llama.cpp's K-quants Q4_K, Q5_K and Q6_K: numpy readers, writers and a round-to-nearest quantizer.

A K-quant row is a run of *super-blocks* of ``QK_K = 256`` weights along K. Each super-block holds one or two
float16 super-scales and, per *sub-block*, a small integer scale (and minimum) relative to them, so the
effective per-sub-block scale ``d * sc`` is a product, not a stored float. All multi-byte values are
little-endian. Byte layout of one super-block (offsets in bytes):

Q4_K (144 bytes; 8 sub-blocks of 32; ``bits=4, group_size=32``)::

    [0:2]    d      float16  super-scale of the sub-block scales
    [2:4]    dmin   float16  super-scale of the sub-block minimums
    [4:16]   scales 12 bytes: eight 6-bit scales sc[j] and eight 6-bit minimums m[j], packed as
             j < 4:  sc[j] = b[j] & 63             m[j] = b[j + 4] & 63
             j >= 4: sc[j] = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4
                     m[j]  = (b[j + 4] >> 4) | (b[j] >> 6) << 4
             (b = these 12 bytes: the top two bits of bytes 0..7 carry the high bits of sub-blocks 4..7)
    [16:144] qs     128 bytes: byte 32c + i holds weight 64c + i (sub-block 2c) in its low nibble and weight
             64c + 32 + i (sub-block 2c + 1) in its high nibble, c = 0..3, i = 0..31

    w = d * sc[j] * q - dmin * m[j]        q in [0, 15], j = sub-block of the weight

Q5_K (176 bytes; 8 sub-blocks of 32; ``bits=5, group_size=32``): Q4_K's d, dmin and scales, then::

    [16:48]  qh     32 bytes: bit j of qh[i] is bit 4 (the fifth bit) of weight 32j + i
    [48:176] qs     128 bytes: the low four bits of every weight, laid out as Q4_K's qs

    w = d * sc[j] * q - dmin * m[j]        q in [0, 31]

Q6_K (210 bytes; 16 sub-blocks of 16; ``bits=6, group_size=16``)::

    [0:128]   ql     the low four bits: for weight 128h + r (h = 0, 1; r = 0..127), the low nibble of
              ql[64h + r] when r < 64, else the high nibble of ql[64h + r - 64]
    [128:192] qh     the top two bits: bits 2s, 2s + 1 of qh[32h + i] are bits 4..5 of weight 128h + 32s + i
              (s = 0..3, i = 0..31)
    [192:208] scales 16 int8 sub-block scales sc[j] (signed)
    [208:210] d      float16 super-scale

    w = d * sc[j] * (q - 32)               q in [0, 63] (stored unsigned, zero point 32)

In portakern's unpacked form (``portakern.ir.packing.unpack_affine``) these are ``codes = q``, ``scales = d * sc``
(exact in float64, and in float32: at most 19 significant bits), ``zeros`` 0 (Q4_K, Q5_K) or 32 (Q6_K) and
``mins = dmin * m`` (Q4_K, Q5_K; 0 for Q6_K): ``dequant = (codes - zeros) * scales - mins``. The minimum is a float
offset per sub-block, not an integer zero point: ``dmin * m / (d * sc)`` is in general no integer, so Q4_K and
Q5_K have no exact form ``(q - z) * s`` with an integer ``z`` (no exact repack into native, AWQ or GPTQ). Q6_K has
one: native 8-bit codes ``q`` with zero point 32 and float32 scales ``d * sc`` in groups of 16 (``q6_k_to_native``).

Exactness: every product above is exact in float64, and the difference ``d*sc*q - dmin*m`` spans fewer than 53
bits (float16 values lie in [2^-24, 2^16)), so float64 holds every dequantized value exactly; rounding it once
to float32 gives bit for bit what gguf-py's float32 dequantizer computes (its products are exact in float32 and
its one subtraction rounds once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import DType
from .errors import InvalidInputError
from .quant import Packing

QK_K = 256
#: bytes of one super-block of 256 weights
BLOCK_BYTES = {Packing.GGUF_Q4_K: 144, Packing.GGUF_Q5_K: 176, Packing.GGUF_Q6_K: 210}
#: (bits, weights per sub-block) of each K-quant
LAYOUT = {Packing.GGUF_Q4_K: (4, 32), Packing.GGUF_Q5_K: (5, 32), Packing.GGUF_Q6_K: (6, 16)}


def _blocks(packing: Packing, data: Any, N: int, K: int) -> np.ndarray:
    """``data`` as uint8 ``(N, K // 256, block bytes)``."""
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(N, K // QK_K, BLOCK_BYTES[packing])


def _f16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes (..., 2) as float16 (...)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0]


def _scales_mins(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes ``(..., 12)`` -> 6-bit ``sc``, ``m`` ``(..., 8)`` (see the module docstring)."""
    lo, mid, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _pack_scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    return np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K ``qs (..., 128)`` -> the low four bits of the 256 weights ``(..., 256)``."""
    q = qs.reshape(qs.shape[:-1] + (4, 1, 32)) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 15).reshape(qs.shape[:-1] + (QK_K,))


def unpack_fields(packing: Packing, data: Any, N: int, K: int) -> dict[str, np.ndarray]:
    """The stored fields of K-quant ``data`` (uint8 ``(N, K // 256 * block bytes)``), per super-block.

    Returns ``d`` float16 ``(N, K // 256)``, ``sc`` ``(N, K // 256, sub-blocks)`` (uint8 6-bit; Q6_K int8),
    ``q`` uint8 ``(N, K)`` (unsigned codes) and, for Q4_K/Q5_K, ``dmin`` float16 and ``m`` uint8 like ``d``/``sc``.
    """
    b = _blocks(packing, data, N, K)
    if packing is Packing.GGUF_Q6_K:
        ql, qh = b[..., 0:128], b[..., 128:192]
        low = ql.reshape(N, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)      # (N, nb, h, nib, 64)
        high = qh.reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)  # (N, nb, h, s, 32)
        q = (low & 15).reshape(N, -1, QK_K) | ((high & 3).reshape(N, -1, QK_K) << 4)
        return {"d": _f16(b[..., 208:210]), "sc": b[..., 192:208].copy().view(np.int8), "q": q.reshape(N, K)}
    sc, m = _scales_mins(b[..., 4:16])
    if packing is Packing.GGUF_Q4_K:
        q = _nibbles(b[..., 16:144])
    else:
        bits = b[..., 16:48].reshape(N, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        q = _nibbles(b[..., 48:176]) | ((bits & 1).reshape(N, -1, QK_K) << 4)
    return {"d": _f16(b[..., 0:2]), "dmin": _f16(b[..., 2:4]), "sc": sc, "m": m, "q": q.reshape(N, K)}


def pack_fields(packing: Packing, fields: dict[str, Any], N: int, K: int) -> np.ndarray:
    """The inverse of ``unpack_fields``: uint8 ``(N, K // 256 * block bytes)`` from the fields it returns.

    Raises ``InvalidInputError`` naming the field for a missing field, a wrong shape or a value out of its
    range (codes ``[0, 2^bits)``, 6-bit ``sc``/``m`` ``[0, 63]``, Q6_K ``sc`` ``[-128, 127]``).
    """
    bits, sub = LAYOUT[packing]
    nb = K // QK_K
    names = {"d": (N, nb), "sc": (N, nb, QK_K // sub), "q": (N, K)}
    if packing is not Packing.GGUF_Q6_K:
        names.update(dmin=(N, nb), m=(N, nb, QK_K // sub))
    for name, shape in names.items():
        if name not in fields:
            raise InvalidInputError(f"fields has no {name!r}: {packing.value} needs {sorted(names)}")
        if np.shape(fields[name]) != shape:
            raise InvalidInputError(f"fields[{name!r}] has shape {np.shape(fields[name])} but {packing.value} with "
                                    f"(N, K) = ({N}, {K}) needs {shape}")
    lim = {"q": (0, (1 << bits) - 1), "sc": (-128, 127) if packing is Packing.GGUF_Q6_K else (0, 63), "m": (0, 63)}
    for name, (lo, hi) in lim.items():
        a = np.asarray(fields.get(name, 0))
        if a.size and (a.min() < lo or a.max() > hi or not np.array_equal(a, np.round(a))):
            raise InvalidInputError(f"fields[{name!r}] holds values outside the integers [{lo}, {hi}] that "
                                    f"{packing.value} stores; clip or requantize")
    d = np.asarray(fields["d"]).astype("<f2").view(np.uint8).reshape(N, nb, 2)
    q = np.asarray(fields["q"]).astype(np.uint8).reshape(N, nb, QK_K)
    if packing is Packing.GGUF_Q6_K:
        qq = q.reshape(N, nb, 2, 2, 64)                                         # (h, nibble half, 64)
        ql = (qq[..., 0, :] & 15) | ((qq[..., 1, :] & 15) << 4)
        qs4 = q.reshape(N, nb, 2, 4, 32) >> 4                                   # (h, s, 32) top two bits
        qh = qs4[..., 0, :] | (qs4[..., 1, :] << 2) | (qs4[..., 2, :] << 4) | (qs4[..., 3, :] << 6)
        sc = np.asarray(fields["sc"]).astype(np.int8).view(np.uint8)
        out = np.concatenate([ql.reshape(N, nb, 128), qh.reshape(N, nb, 64), sc, d], axis=-1)
        return out.reshape(N, -1)
    dmin = np.asarray(fields["dmin"]).astype("<f2").view(np.uint8).reshape(N, nb, 2)
    pairs = q.reshape(N, nb, 4, 2, 32) & 15
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(N, nb, 128)
    parts = [d, dmin, _pack_scales_mins(np.asarray(fields["sc"]), np.asarray(fields["m"]))]
    if packing is Packing.GGUF_Q5_K:
        top = (q.reshape(N, nb, 8, 32) >> 4) & 1
        parts.append(np.bitwise_or.reduce(top << np.arange(8, dtype=np.uint8).reshape(8, 1), axis=2).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=-1).reshape(N, -1)


def affine(packing: Packing, data: Any, N: int, K: int):
    """``(codes, scales, zeros, mins)`` of K-quant ``data``: int64 ``(N, K)`` and float64 ``(N, K // group)`` each,
    with ``dequant = (codes - zeros) * scales - mins`` exact in float64 (see the module docstring)."""
    f = unpack_fields(packing, data, N, K)
    scales = (f["d"].astype(np.float64)[..., None] * f["sc"].astype(np.float64)).reshape(N, -1)
    if packing is Packing.GGUF_Q6_K:
        zeros, mins = np.full_like(scales, 32.0), np.zeros_like(scales)
    else:
        zeros = np.zeros_like(scales)
        mins = (f["dmin"].astype(np.float64)[..., None] * f["m"].astype(np.float64)).reshape(N, -1)
    return f["q"].astype(np.int64), scales, zeros, mins


def unpack(fmt, t, N: int, K: int):
    """``portakern.ir.packing.unpack``'s reader: Q6_K as ``(codes, scales, zeros, group)``; Q4_K / Q5_K refused,
    naming the reader that returns their float minimums."""
    if fmt.has_mins:
        raise InvalidInputError(
            f"packing {fmt.packing.value} subtracts a float minimum per group (d * sc * q - dmin * m), which "
            "(codes - zeros) * scales with integer zero points cannot hold exactly; read it with "
            "portakern.ir.packing.unpack_affine (which returns the minimums), or gemv_parts (the GPU GEMV layout's "
            "codes, scales and minimums)")
    codes, scales, zeros, _ = affine(fmt.packing, t["data"], N, K)
    return codes, scales, zeros, np.arange(K, dtype=np.int64) // fmt.group_size


def refuse_pack(fmt, *args: Any, **kwargs: Any):
    """``portakern.ir.packing.pack`` for a K-quant: always ``InvalidInputError`` naming the writers to use."""
    raise InvalidInputError(
        f"pack() cannot write packing {fmt.packing.value}: its scales are products d * sc of a float16 super-scale "
        "and a small integer, which (codes, scales, zeros) does not split; write the fields with "
        "portakern.ir.gguf_kquants.pack_fields, or quantize a float weight with gguf_kquants.quantize")


def _ceil_f16(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= ``x`` (x >= 0), as float64 (inf past the float16 range)."""
    with np.errstate(over="ignore"):
        y = x.astype(np.float16)
    return np.where(y.astype(np.float64) < x, np.nextafter(y, np.float16(np.inf)), y).astype(np.float64)


def quantize(packing: Packing, w: Any) -> np.ndarray:
    """Round-to-nearest min/max quantization of ``w (N, K)`` into K-quant ``packing``: uint8 block bytes.

    Per sub-block: Q4_K/Q5_K take ``lo = min(w, 0)``, ``hi = max(w, 0)``, the minimum ``-lo`` and the scale
    ``(hi - lo) / (2^bits - 1)``; Q6_K the scale ``max|w| / 31``. The float16 super-scales are the largest
    sub-block scale (minimum) over 63 (Q6_K: 127) rounded up, the sub-block integers are rounded up (so the
    range fits), then ``q`` is rounded to nearest and clipped. It is simpler than llama.cpp's iterative search:
    the bytes differ from llama-quantize's, the layout is the same. Raises ``InvalidInputError`` for a shape
    that is not ``(N, K)`` with K a multiple of 256, a non-finite value or a scale past the float16 range.
    """
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] % QK_K or w.shape[0] < 1 or w.shape[1] < 1:
        raise InvalidInputError(f"w has shape {w.shape}: {packing.value} quantizes a 2-D (N, K) weight with K a "
                                f"positive multiple of {QK_K} (super-blocks along K); pad K")
    if not np.isfinite(w).all():
        raise InvalidInputError(f"w holds NaN or Inf: {packing.value} quantizes finite weights only; replace them")
    N, K = w.shape
    bits, sub = LAYOUT[packing]
    wg = w.reshape(N, K // QK_K, QK_K // sub, sub)
    with np.errstate(divide="ignore", invalid="ignore"):
        if packing is Packing.GGUF_Q6_K:
            raw = np.abs(wg).max(axis=-1) / 31
            d = _ceil_f16(raw.max(axis=-1) / 127)
            sc = np.where(d[..., None] > 0, np.clip(np.ceil(raw / d[..., None]), 0, 127), 0)
            s = (d[..., None] * sc)[..., None]
            q = np.where(s > 0, np.clip(np.round(wg / s), -32, 31), 0) + 32
            fields = {"d": d, "sc": sc, "q": q.reshape(N, K)}
        else:
            qmax = (1 << bits) - 1
            lo, hi = np.minimum(wg.min(axis=-1), 0.0), np.maximum(wg.max(axis=-1), 0.0)
            dmin = _ceil_f16(-lo.min(axis=-1) / 63)
            m = np.where(dmin[..., None] > 0, np.clip(np.ceil(-lo / dmin[..., None]), 0, 63), 0)
            off = dmin[..., None] * m                                       # the stored minimum
            d = _ceil_f16((hi + off).max(axis=-1) / qmax / 63)
            sc = np.where(d[..., None] > 0, np.clip(np.ceil((hi + off) / qmax / d[..., None]), 0, 63), 0)
            s = (d[..., None] * sc)[..., None]
            q = np.where(s > 0, np.clip(np.round((wg + off[..., None]) / s), 0, qmax), 0)
            fields = {"d": d, "dmin": dmin, "sc": sc, "m": m, "q": q.reshape(N, K)}
    if not all(np.isfinite(fields[k]).all() for k in ("d", "dmin") if k in fields):
        raise InvalidInputError(f"w has values up to {np.abs(w).max():.4g}: the {packing.value} super-scale "
                                "overflows float16; rescale w")
    return pack_fields(packing, fields, N, K)


def q6_k_to_native(data: Any, N: int, K: int) -> dict[str, np.ndarray]:
    """Q6_K ``data`` as the tensors of an exactly equal native weight: ``QuantFormat(8, 16, False, NATIVE,
    float32)``, ``qweight`` the codes ``q``, ``zeros`` 32, ``scales`` ``d * sc`` in float32 (exact: at most
    19 significant bits, and float16 exponents lie well inside float32's)."""
    codes, scales, zeros, _ = affine(Packing.GGUF_Q6_K, data, N, K)
    return {"qweight": codes.astype(np.uint8), "scales": scales.astype(np.float32), "zeros": zeros.astype(np.uint8)}


#: the code width of the GPU GEMV layout (``portakern.ir.gemv_layout``) that holds each K-quant's codes: Q4_K's
#: nibbles as they are, Q5_K's 5 and Q6_K's 6 bits one per byte (the layout packs 4- or 8-bit codes)
GEMV_BITS = {Packing.GGUF_Q4_K: 4, Packing.GGUF_Q5_K: 8, Packing.GGUF_Q6_K: 8}


def gemv_bits(fmt) -> int:
    """The code width of the GPU GEMV layout for ``fmt`` (a ``QuantFormat``): ``GEMV_BITS`` for a K-quant, else
    ``fmt.bits``."""
    return GEMV_BITS.get(fmt.packing, fmt.bits)


def prepared_scale_dtype(fmt) -> DType:
    """The dtype of the scales (and minimums) of ``fmt`` in the GPU GEMV layout: float32 for a K-quant (``d * sc``
    and ``dmin * m`` are exact there, not in float16), else the format's ``scale_dtype``."""
    return DType.float32 if fmt.packing in GEMV_BITS else fmt.scale_dtype


def gemv_parts(packing: Packing, data: Any, N: int, K: int) -> dict[str, Any]:
    """K-quant ``data`` as the parts of the GPU GEMV layout (the numpy reference; ``portakern.gemv_kquants``
    computes the same bits with torch ops on a device).

    Returns ``codes`` uint8 ``(N, K)`` (unsigned ``q``), ``scales`` float32 ``(N, K // group)`` = ``d * sc`` and
    ``mins`` float32 ``(N, K // group)`` = ``dmin * m`` (None for Q6_K), ``zero_point`` (0 for Q4_K / Q5_K, 32 for
    Q6_K) and ``bits`` (``GEMV_BITS``), so that ``dequant = (codes - zero_point) * scales - mins``. Both products
    are exact in float32 (a float16 times an integer of at most 8 bits: at most 19 significant bits, and float16
    exponents lie well inside float32's), so the float32 parts hold the stored weight bit for bit.
    """
    f = unpack_fields(packing, data, N, K)
    scales = (f["d"].astype(np.float32)[..., None] * f["sc"].astype(np.float32)).reshape(N, -1)
    mins = None
    if packing is not Packing.GGUF_Q6_K:
        mins = (f["dmin"].astype(np.float32)[..., None] * f["m"].astype(np.float32)).reshape(N, -1)
    return {"codes": f["q"], "scales": scales, "mins": mins, "bits": GEMV_BITS[packing],
            "zero_point": 32 if packing is Packing.GGUF_Q6_K else 0}


def kquant_refusal(fmt, backend: str, served_by: str) -> str | None:
    """The reason a backend without a K-quant GEMV gives for GGUF Q4_K, Q5_K and Q6_K ``fmt`` (None for every
    other packing), naming the backends that run it (``served_by``, e.g. "triton on NVIDIA and AMD GPUs")."""
    if fmt.packing not in GEMV_BITS:
        return None
    what = "a float scale and a float minimum per group" if fmt.has_mins else "float32 scales d * sc per group"
    return (f"quant_gemv(packing={fmt.packing.value}) is not supported by {backend}: its kernels have no GGUF "
            f"K-quant form ({what}); it is served by {served_by}, and by backend='cpu'")
