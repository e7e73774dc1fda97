"""Quantization formats: data describing how a weight ``W (N, K)`` is stored.

``dequant(W)[n, k] = (q[n, k] - z[n, g]) * s[n, g]`` with ``g`` the group of ``k`` (``k //
group_size`` unless a GPTQ ``g_idx`` says otherwise). Symmetric formats have a fixed zero point.
GGUF Q4_K / Q5_K subtract a float minimum per group as well: ``(q - z) * s - min`` (``has_mins``).
Every packing below states its exact byte layout; ``portakern.ir.packing`` holds the numpy
pack/unpack pair for each, and a round-trip test per packing.
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass

from .dtypes import DType
from .errors import InvalidInputError


class Packing(str, enum.Enum):
    """Byte layouts of the quantized payload. Tensor names are the keys of ``QuantizedWeight.tensors``.

    NATIVE: portakern's own layout, for 4 and 8 bits.
        ``qweight`` uint8 ``(N, K * bits // 8)``: row n holds the codes of W[n, :] in order of k;
        at 4 bits, byte j holds k = 2j in its low nibble and k = 2j+1 in its high nibble.
        Codes are unsigned in ``[0, 2^bits)``.
        ``scales`` ``(N, K // G)`` in ``scale_dtype``.
        ``zeros`` uint8 ``(N, K // G)`` integer zero points (asymmetric only; any uint8 value: at 4 bits
        a zero point above 15 shifts every code of its group below zero, which the reference and the
        kernels compute alike; ``pack`` and ``quantize`` never write one). Symmetric formats
        use the fixed zero point ``2^(bits-1)`` (8 at 4 bits, 128 at 8 bits) and have no ``zeros``.

    AWQ: AutoAWQ's GEMM layout, 4 bits, asymmetric, weight stored transposed (in=K, out=N).
        ``qweight`` int32 ``(K, N // 8)``: word ``[k, j]`` holds W[8j + ORDER[i], k] in bits
        ``4i .. 4i+3`` for i = 0..7, ORDER = (0, 2, 4, 6, 1, 3, 5, 7).
        ``qzeros`` int32 ``(K // G, N // 8)``: the integer zero points, packed like qweight.
        ``scales`` float16 ``(K // G, N)``.

    GPTQ: AutoGPTQ v1 checkpoints ("zero-point minus one" convention), 4 bits.
        ``qweight`` int32 ``(K // 8, N)``: word ``[r, n]`` holds W[n, 8r + i] in bits 4i .. 4i+3.
        ``qzeros`` int32 ``(G_count, N // 8)``: word ``[g, j]`` holds ``z[8j + i, g] - 1`` in bits
        4i .. 4i+3 (the v1 checkpoint stores the zero point minus one; dequant adds it back).
        ``scales`` float16 ``(G_count, N)``.
        ``g_idx`` int32 ``(K,)`` (optional, act-order): the group of each input channel k;
        absent means ``k // G``.

    GGUF_Q4_0: llama.cpp Q4_0, group size 32, symmetric.
        ``data`` uint8 ``(N, K // 32 * 18)``: per block of 32 weights, a little-endian float16
        scale d then 16 bytes qs; weight j (0..15) is the low nibble of qs[j], weight j + 16 the
        high nibble. ``dequant = (q - 8) * d``.

    GGUF_Q8_0: llama.cpp Q8_0, group size 32, symmetric.
        ``data`` uint8 ``(N, K // 32 * 34)``: per block, a float16 scale d then 32 int8 codes q.
        ``dequant = q * d``.

    GGUF_Q4_K, GGUF_Q5_K: llama.cpp K-quants, 4 / 5 bits, super-blocks of 256 weights, groups (sub-blocks) of 32,
        asymmetric through a float minimum per group (``symmetric=False``, no integer zero points).
        ``data`` uint8 ``(N, K // 256 * 144)`` (Q5_K: ``* 176``): float16 d and dmin, 6-bit sub-block scales
        sc and minimums m, then the codes. ``dequant = d * sc * q - dmin * m``.

    GGUF_Q6_K: llama.cpp K-quant, 6 bits, super-blocks of 256, groups of 16, symmetric (zero point 32).
        ``data`` uint8 ``(N, K // 256 * 210)``: codes, int8 sub-block scales sc, float16 d.
        ``dequant = d * sc * (q - 32)``. The exact byte layouts are in ``portakern.ir.gguf_kquants``.
    """

    NATIVE = "native"
    AWQ = "awq"
    GPTQ = "gptq"
    GGUF_Q4_0 = "gguf_q4_0"
    GGUF_Q8_0 = "gguf_q8_0"
    GGUF_Q4_K = "gguf_q4_k"
    GGUF_Q5_K = "gguf_q5_k"
    GGUF_Q6_K = "gguf_q6_k"


def _is_int(x: object, kind: type = int) -> bool:
    """An instance of ``kind`` (``int``; ``numbers.Integral`` takes numpy integers too), never a bool."""
    return isinstance(x, kind) and not isinstance(x, bool)


#: bits each packing can hold
PACKING_BITS = {
    Packing.NATIVE: (4, 8),
    Packing.AWQ: (4,),
    Packing.GPTQ: (4,),
    Packing.GGUF_Q4_0: (4,),
    Packing.GGUF_Q8_0: (8,),
    Packing.GGUF_Q4_K: (4,),
    Packing.GGUF_Q5_K: (5,),
    Packing.GGUF_Q6_K: (6,),
}

#: the fixed layout of each GGUF packing: (group_size, symmetric, weights per block along K)
GGUF_LAYOUT = {
    Packing.GGUF_Q4_0: (32, True, 32),
    Packing.GGUF_Q8_0: (32, True, 32),
    Packing.GGUF_Q4_K: (32, False, 256),
    Packing.GGUF_Q5_K: (32, False, 256),
    Packing.GGUF_Q6_K: (16, True, 256),
}


@dataclass(frozen=True)
class QuantFormat:
    """How a quantized weight is stored: bits, grouping, zero points, scale dtype and packing."""

    bits: int
    group_size: int
    symmetric: bool
    packing: Packing = Packing.NATIVE
    scale_dtype: DType = DType.float16
    has_g_idx: bool = False

    def verify(self, K: int | None = None, N: int | None = None) -> None:
        """Raise ``InvalidInputError`` naming the field, value and rule when the format is invalid."""
        def fail(msg: str) -> None:
            raise InvalidInputError(f"QuantFormat: {msg}")

        if not isinstance(self.packing, Packing):
            fail(f"packing={self.packing!r} must be one of {', '.join(p.value for p in Packing)}")
        if not _is_int(self.bits):
            fail(f"bits={self.bits!r} must be an int: one of {PACKING_BITS[self.packing]} for packing "
                 f"{self.packing.value}")
        for name in ("symmetric", "has_g_idx"):  # a truthy string would silently pick the other layout
            if not isinstance(getattr(self, name), bool):
                fail(f"{name}={getattr(self, name)!r} must be True or False (a bool, not a "
                     f"{type(getattr(self, name)).__name__})")
        if not isinstance(self.scale_dtype, DType):
            fail(f"scale_dtype={self.scale_dtype!r} must be a DType (DType.float16, DType.bfloat16 or "
                 f"DType.float32); convert a name with DType({self.scale_dtype!r})")
        for name, value in (("K", K), ("N", N)):
            if value is not None and (not _is_int(value, numbers.Integral) or value < 1):
                fail(f"{name}={value!r} must be a positive int (the weight is (N, K) = (out, in features))")
        if self.bits not in PACKING_BITS[self.packing]:
            fail(f"bits={self.bits} is not supported by packing {self.packing.value}: "
                 f"allowed {PACKING_BITS[self.packing]}")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            fail(f"group_size={self.group_size!r} must be an int >= 2")
        if self.packing in GGUF_LAYOUT:
            group, symmetric, block = GGUF_LAYOUT[self.packing]
            if self.group_size != group:
                fail(f"group_size={self.group_size} must be {group} for {self.packing.value}")
            if symmetric and not self.symmetric:
                fail(f"symmetric=False is impossible for {self.packing.value} (it has no zero points)")
            if not symmetric and self.symmetric:
                fail(f"symmetric=True is impossible for {self.packing.value}: it subtracts a float minimum per "
                     "group (dequant = d * sc * q - dmin * m); pass symmetric=False")
            if K is not None and block != group and K % block:  # whole blocks (Q4_0 and Q8_0: the group check)
                fail(f"K={K} must be a multiple of {block} for {self.packing.value} (blocks of {block} weights "
                     f"along K); pad K to {-(-K // block) * block} with zero input columns")
            if self.scale_dtype is not DType.float16:
                fail(f"scale_dtype={self.scale_dtype.value} is impossible for {self.packing.value}: GGUF "
                     "blocks embed float16 scales; use float16")
        if self.packing in (Packing.AWQ, Packing.GPTQ) and self.symmetric:
            fail(f"symmetric=True is not a {self.packing.value} layout: it always stores zero points")
        if self.has_g_idx and self.packing is not Packing.GPTQ:
            fail(f"has_g_idx=True is only meaningful for packing gptq, not {self.packing.value}")
        if self.scale_dtype not in (DType.float16, DType.bfloat16, DType.float32):
            fail(f"scale_dtype={self.scale_dtype.value} must be float16, bfloat16 or float32")
        if K is not None:
            if K % self.group_size != 0:
                fail(f"group_size={self.group_size} does not divide K={K}; pick a group size that "
                     f"divides K (or pad K to a multiple of {self.group_size})")
            if self.bits == 4 and K % 2 != 0:
                fail(f"K={K} must be even for 4-bit packing (two codes a byte); pad K to {K + 1} with a "
                     "zero input column")
            if self.packing is Packing.GPTQ and K % 8 != 0:
                fail(f"K={K} must be a multiple of 8 for gptq (8 codes per int32 along K)")
        if N is not None and self.packing in (Packing.AWQ, Packing.GPTQ) and N % 8 != 0:
            fail(f"N={N} must be a multiple of 8 for {self.packing.value} (8 codes per int32 along N)")

    @property
    def zero_point(self) -> int:
        """The fixed zero point of symmetric formats (GGUF Q8_0 stores signed codes: 0; Q6_K: 32); the unpacked
        zero point of GGUF Q4_K / Q5_K, 0 (their offset is the float minimum, see ``has_mins``)."""
        if self.packing is Packing.GGUF_Q8_0 or self.has_mins:
            return 0
        return 1 << (self.bits - 1)

    @property
    def has_mins(self) -> bool:
        """Whether dequantization subtracts a float minimum per group (GGUF Q4_K, Q5_K): ``(q - z) * s - min``,
        which no integer zero point expresses exactly (``portakern.ir.packing.unpack_affine``)."""
        return self.packing in (Packing.GGUF_Q4_K, Packing.GGUF_Q5_K)

    def to_json(self) -> dict:
        """The format as a JSON-ready dict (enum members by value); ``from_json`` inverts it."""
        return {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric,
                "packing": self.packing.value, "scale_dtype": self.scale_dtype.value,
                "has_g_idx": self.has_g_idx}

    @classmethod
    def from_json(cls, d: dict) -> "QuantFormat":
        """Rebuild a format from ``to_json()``'s dict (``has_g_idx`` may be absent: False).

        Raises ``InvalidInputError`` naming the key for a missing key or an unknown packing or
        scale dtype; the fields themselves are checked by ``verify()``.
        """
        def fail(msg: str) -> None:
            raise InvalidInputError(f"QuantFormat.from_json: {msg}; pass the dict QuantFormat.to_json() made")

        if not isinstance(d, dict):
            fail(f"got a {type(d).__name__}: it must be a dict")
        missing = [k for k in ("bits", "group_size", "symmetric", "packing", "scale_dtype") if k not in d]
        if missing:
            fail(f"missing {', '.join(map(repr, missing))}")
        enums = {}
        for key, enum_cls in (("packing", Packing), ("scale_dtype", DType)):
            try:
                enums[key] = enum_cls(d[key])
            except ValueError:
                fail(f"{key}={d[key]!r} is not one of {', '.join(m.value for m in enum_cls)}")
        return cls(bits=d["bits"], group_size=d["group_size"], symmetric=d["symmetric"],
                   packing=enums["packing"], scale_dtype=enums["scale_dtype"],
                   has_g_idx=d.get("has_g_idx", False))
