"""Conformance case objects: an op call described as data, with inputs made by ``generate``.

A case holds shapes, dtype and call options; ``inputs()`` builds its arrays from the suite's
portable generator (seeded by the case id), as float32 numpy arrays whose values are exact in the
case's storage dtype plus integer index arrays. ``input_hash()`` is the sha256 of those arrays
(stored in the golden manifest). Plugins may return their own case objects from the
``portakern_conformance_cases`` hook: anything with this interface works.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from portakern.ir.expr import Expr

from . import generate as gen

DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
#: amplitudes of q, k, v: scores ``scale * q.k`` then have a standard deviation near 2
AMPLITUDE = {"q": 3.0, "k": 2.0, "v": 1.0}


def _plain(v: Any) -> Any:
    if isinstance(v, Expr):
        return v.to_json()
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


@dataclass(frozen=True)
class AttentionCase:
    """One ``portakern.attention`` call.

    ``layout`` is "dense" (``seqlens_k`` optional per-batch key lengths), "paged" (``seqlens_k``
    required; ``page_size``, ``num_pages``; the block table is a seeded shuffle of the page pool)
    or "varlen" (``q_lens`` / ``k_lens`` per sequence; ``Sq``/``Sk`` are their maxima).
    """

    id: str
    dtype: str
    B: int
    Sq: int
    Sk: int
    Hq: int
    Hkv: int
    D: int
    Dv: int = 0
    layout: str = "dense"
    seqlens_k: tuple[int, ...] | None = None
    page_size: int = 0
    num_pages: int = 0
    q_lens: tuple[int, ...] | None = None
    k_lens: tuple[int, ...] | None = None
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    scale: float | None = None
    score_mod: Expr | None = None
    mask_mod: Expr | None = None
    return_lse: bool = False
    tier: str = "cpu"
    tags: tuple[str, ...] = field(default=(), compare=False)

    kind = "attention"

    @property
    def dv(self) -> int:
        return self.Dv or self.D

    @property
    def seed(self) -> int:
        return gen.seed_of(self.id)

    # -- inputs -------------------------------------------------------------------------------
    def inputs(self) -> dict[str, np.ndarray]:
        """q, k, v (float32, exact in ``dtype``) and the index arrays this layout needs (int32)."""
        out = self._index_arrays()
        for name, shape in self._float_shapes().items():
            out[name] = gen.floats(self.seed, name, shape, self.dtype, AMPLITUDE[name])
        return out

    def placeholders(self) -> dict[str, np.ndarray]:
        """Like ``inputs()`` but q, k, v are uninitialised (only shapes matter): builds ops cheaply."""
        out = {k: v for k, v in self._index_arrays().items()}
        for name, shape in self._float_shapes().items():
            out[name] = np.empty(shape, dtype=np.float32)
        return out

    def _float_shapes(self) -> dict[str, tuple[int, ...]]:
        Hq, Hkv, D, Dv = self.Hq, self.Hkv, self.D, self.dv
        if self.layout == "varlen":
            tq, tk = sum(self.q_lens), sum(self.k_lens)
            return {"q": (tq, Hq, D), "k": (tk, Hkv, D), "v": (tk, Hkv, Dv)}
        if self.layout == "paged":
            ps, P = self.page_size, self.num_pages
            return {"q": (self.B, self.Sq, Hq, D), "k": (P, ps, Hkv, D), "v": (P, ps, Hkv, Dv)}
        return {"q": (self.B, self.Sq, Hq, D), "k": (self.B, self.Sk, Hkv, D), "v": (self.B, self.Sk, Hkv, Dv)}

    def _index_arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        if self.layout == "varlen":
            out["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)
            out["cu_seqlens_k"] = np.concatenate([[0], np.cumsum(self.k_lens)]).astype(np.int32)
        elif self.layout == "paged":
            out["block_table"] = self._block_table()
            out["seqlens_k"] = np.asarray(self.seqlens_k, dtype=np.int32)
        elif self.seqlens_k is not None:
            out["seqlens_k"] = np.asarray(self.seqlens_k, dtype=np.int32)
        return out

    def _block_table(self) -> np.ndarray:
        """(B, max_pages): pages handed out from a shuffled pool; unused slots hold page 0."""
        ps = self.page_size
        need = [-(-L // ps) for L in self.seqlens_k]
        pool = gen.permutation(self.seed, "pages", self.num_pages)
        table = np.zeros((self.B, self.Sk // ps), dtype=np.int32)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = pool[at:at + n]
            at += n
        return table

    def kwargs(self) -> dict[str, Any]:
        """The non-array keyword arguments of the call."""
        kw: dict[str, Any] = {"causal": self.causal, "return_lse": self.return_lse}
        if self.window is not None:
            kw["window"] = tuple(self.window)
        if self.softcap:
            kw["softcap"] = self.softcap
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.score_mod is not None:
            kw["score_mod"] = self.score_mod
        if self.mask_mod is not None:
            kw["mask_mod"] = self.mask_mod
        return kw

    def input_hash(self) -> str:
        return gen.hash_arrays(self.inputs())

    def output_size(self) -> int:
        rows = sum(self.q_lens) if self.layout == "varlen" else self.B * self.Sq
        return rows * self.Hq * self.dv

    def work(self) -> float:
        """Rough multiply-add count of the reference (for scheduling and budgets)."""
        if self.layout == "varlen":
            pairs = sum(a * b for a, b in zip(self.q_lens, self.k_lens))
        elif self.seqlens_k is not None:
            pairs = self.Sq * sum(self.seqlens_k)
        else:
            pairs = self.B * self.Sq * self.Sk
        return float(pairs) * self.Hq * (self.D + self.dv)

    def to_json(self) -> dict:
        d = {"id": self.id, "op": self.kind}
        for f in fields(self):
            if f.name in ("id",):
                continue
            d[f.name] = _plain(getattr(self, f.name))
        return d


@dataclass(frozen=True)
class GemvCase:
    """One ``portakern.quant_gemv`` call on a weight packed by ``portakern.ir.packing.pack``.

    Codes, scales and zero points come from the generator; ``group_size`` is the real group size
    (the "group = K" cases simply have ``group_size == K``). GGUF K-quants (``kquant``) store no free float
    scales: their fields (float16 super-scales ``d`` / ``dmin``, 6-bit (Q6_K: int8) sub-block scales ``sc`` and
    minimums ``m``, codes) come from the generator and are written by ``portakern.ir.gguf_kquants.pack_fields``.
    """

    id: str
    dtype: str
    M: int
    N: int
    K: int
    packing: str
    bits: int
    symmetric: bool
    group_size: int
    scale_dtype: str = "float16"
    has_g_idx: bool = False
    tier: str = "cpu"
    tags: tuple[str, ...] = field(default=(), compare=False)
    #: ``QuantGemv.prologue`` ("" for none): "silu_mul" makes x ``(M, 2K)``, gate then up
    prologue: str = ""

    kind = "quant_gemv"

    @property
    def x_columns(self) -> int:
        from portakern.ir.ops import x_columns

        return x_columns(self.K, self.prologue or None)

    @property
    def seed(self) -> int:
        return gen.seed_of(self.id)

    @property
    def fmt(self):
        from portakern.ir.dtypes import DType
        from portakern.ir.quant import Packing, QuantFormat

        return QuantFormat(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
                           packing=Packing(self.packing), scale_dtype=DType(self.scale_dtype),
                           has_g_idx=self.has_g_idx)

    def _code_range(self) -> tuple[int, int]:
        if self.packing == "gguf_q8_0":
            return -127, 128
        return 0, 1 << self.bits

    @property
    def kquant(self) -> bool:
        """Whether the packing is a GGUF K-quant (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights)."""
        return self.packing in ("gguf_q4_k", "gguf_q5_k", "gguf_q6_k")

    def _kquant_fields(self, out: dict[str, np.ndarray]) -> None:
        """The stored fields of a K-quant weight: float16 ``d`` (and ``dmin``) per super-block, sub-block scales
        ``sc`` (6-bit; Q6_K int8, signed) and minimums ``m`` (6-bit), so that ``d * sc`` lies within
        ``[0.002, 0.02)`` in magnitude, like the other formats' scales, and ``dmin * m`` in ``[0, 0.063)``."""
        s, N, nb, sub = self.seed, self.N, self.K // 256, 256 // self.group_size
        if self.packing == "gguf_q6_k":
            out["d"] = gen.round_to(1.25e-4 + 2.5e-5 * gen.uniform(s, "d", (N, nb)), "float16")
            sign = np.where(gen.integers(s, "sc_sign", (N, nb, sub), 0, 2) == 0, -1, 1)
            out["sc"] = sign * gen.integers(s, "sc", (N, nb, sub), 32, 128)
            return
        out["d"] = gen.round_to(3.75e-4 + 1.25e-4 * gen.uniform(s, "d", (N, nb)), "float16")
        out["sc"] = gen.integers(s, "sc", (N, nb, sub), 8, 40)
        out["dmin"] = gen.round_to(7.5e-4 + 2.5e-4 * gen.uniform(s, "dmin", (N, nb)), "float16")
        out["m"] = gen.integers(s, "m", (N, nb, sub), 0, 64)

    def inputs(self) -> dict[str, np.ndarray]:
        """x (float32, exact in ``dtype``), codes, scales (exact in ``scale_dtype``), zeros, g_idx; for a K-quant,
        x, codes and the fields of ``_kquant_fields``."""
        s, N, K, G = self.seed, self.N, self.K, self.group_size
        ng = K // G
        out = {"x": gen.floats(s, "x", (self.M, self.x_columns), self.dtype, 1.0)}
        lo, hi = self._code_range()
        out["codes"] = gen.integers(s, "codes", (N, K), lo, hi)
        if self.kquant:
            self._kquant_fields(out)
            return out
        mag = 0.012 + 0.008 * gen.uniform(s, "scales", (N, ng))          # in [0.004, 0.02)
        if self.packing == "gguf_q4_0":  # llama.cpp's Q4_0 scales are often negative
            mag = mag * np.where(gen.integers(s, "scale_sign", (N, ng), 0, 2) == 0, -1.0, 1.0)
        out["scales"] = gen.round_to(mag, self.scale_dtype)
        if not self.symmetric:
            zlo, zhi = (1, 17) if self.packing == "gptq" else (0, 1 << self.bits)
            out["zeros"] = gen.integers(s, "zeros", (N, ng), zlo, zhi)
        if self.has_g_idx:  # act-order: every group keeps exactly G channels, scattered over K
            perm = gen.permutation(s, "g_idx", K)
            g_idx = np.empty(K, dtype=np.int32)
            g_idx[perm] = np.arange(K) // G
            out["g_idx"] = g_idx
        return out

    def placeholders(self) -> dict[str, np.ndarray]:
        """x uninitialised and the packed tensors as empty arrays of the right shapes and dtypes."""
        from portakern.ir.packing import tensor_specs

        out = {"x": np.empty((self.M, self.x_columns), dtype=np.float32)}
        for name, (shape, dtypes, _) in tensor_specs(self.fmt, self.N, self.K).items():
            out["packed:" + name] = np.zeros(shape, dtype=dtypes[-1])
        return out

    def tensors(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The packed tensors of the weight (``portakern.ir.packing.pack``; K-quants ``gguf_kquants.pack_fields``)."""
        from portakern.ir.packing import pack

        if self.kquant:
            from portakern.ir.gguf_kquants import pack_fields
            from portakern.ir.quant import Packing

            fields = {k: inputs[k] for k in ("d", "sc", "dmin", "m") if k in inputs}
            return {"data": pack_fields(Packing(self.packing), dict(fields, q=inputs["codes"]), self.N, self.K)}

        return pack(self.fmt, inputs["codes"], inputs["scales"], inputs.get("zeros"), self.N, self.K,
                    g_idx=inputs.get("g_idx"))

    def weight(self, inputs: dict[str, np.ndarray]):
        """The ``QuantizedWeight`` (from ``inputs()``, or from ``placeholders()`` without packing)."""
        from portakern.quantized import QuantizedWeight

        packed = {k[7:]: v for k, v in inputs.items() if k.startswith("packed:")}
        return QuantizedWeight(self.fmt, self.N, self.K, packed or self.tensors(inputs))

    def dequantized(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """float64 ``W (N, K)`` straight from the generated codes (independent of the packers); a K-quant's
        ``d * sc * (q - z) - dmin * m`` (z: 32 for Q6_K, else 0) per sub-block of ``group_size`` columns."""
        G = self.group_size
        if self.kquant:
            scales = np.repeat((inputs["d"].astype(np.float64)[..., None] * inputs["sc"]).reshape(self.N, -1), G, 1)
            mins = 0.0
            if "m" in inputs:
                mins = np.repeat((inputs["dmin"].astype(np.float64)[..., None] * inputs["m"]).reshape(self.N, -1), G, 1)
            return (inputs["codes"] - float(self.fmt.zero_point)) * scales - mins
        group = inputs["g_idx"].astype(np.int64) if self.has_g_idx else np.arange(self.K) // G
        zero = inputs["zeros"].astype(np.float64) if not self.symmetric else float(self.fmt.zero_point)
        z = zero[:, group] if not self.symmetric else zero
        return (inputs["codes"].astype(np.float64) - z) * inputs["scales"].astype(np.float64)[:, group]

    def kwargs(self) -> dict[str, Any]:
        return {"prologue": self.prologue} if self.prologue else {}

    def input_hash(self) -> str:
        return gen.hash_arrays(self.inputs())

    def output_size(self) -> int:
        return self.M * self.N

    def work(self) -> float:
        return float(self.M + 4) * self.N * self.K

    def to_json(self) -> dict:
        d = {"id": self.id, "op": self.kind}
        for f in fields(self):
            if f.name != "id" and not (f.name == "prologue" and not self.prologue):   # absent when unset
                d[f.name] = _plain(getattr(self, f.name))
        return d
