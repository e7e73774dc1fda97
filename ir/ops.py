"""Op nodes: ``Attention`` and ``QuantGemv``. Frozen, hashable, verified, JSON-serialisable."""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, fields, replace

from .dtypes import DType, STORAGE_FLOATS
from .errors import InvalidInputError, PortakernError
from .expr import Expr
from .quant import QuantFormat


class KVLayout(str, enum.Enum):
    """How keys and values are laid out in memory (see ``docs/ir.md``)."""

    DENSE = "dense"    # k (B, Sk, Hkv, D); optional per-batch lengths seqlens_k (B,)
    PAGED = "paged"    # k (num_pages, page_size, Hkv, D), block_table (B, max_pages), seqlens_k (B,)
    VARLEN = "varlen"  # q (total_q, Hq, D), k (total_k, Hkv, D), cu_seqlens_q/k (B + 1,)


def _fail(node: str, msg: str) -> None:
    raise InvalidInputError(f"{node}: {msg}")


@dataclass(frozen=True)
class Attention:
    """``out = softmax(mask(score_mod(scale * q k^T))) v`` per batch entry and query head.

    ``seqlen_q`` / ``seqlen_k`` are the dense lengths, the maxima for varlen, and for paged KV
    ``seqlen_k = max_pages * page_size`` (the block table's capacity).
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: DType
    scale: float
    score_mod: Expr | None = None
    mask_mod: Expr | None = None
    kv_layout: KVLayout = KVLayout.DENSE
    page_size: int = 0
    num_pages: int = 0
    has_seqlens_k: bool = False
    total_q: int = 0
    total_k: int = 0
    return_lse: bool = False

    kind = "attention"

    # -- shapes -------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, Hq = MQA)."""
        return self.heads_q // self.heads_kv

    @property
    def max_pages(self) -> int:
        return self.seqlen_k // self.page_size if self.page_size else 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every operand this node reads or writes, by argument name."""
        B, Sq, Sk, Hq, Hkv = self.batch, self.seqlen_q, self.seqlen_k, self.heads_q, self.heads_kv
        D, Dv = self.head_dim, self.head_dim_v
        if self.kv_layout is KVLayout.VARLEN:
            s = {"q": (self.total_q, Hq, D), "k": (self.total_k, Hkv, D), "v": (self.total_k, Hkv, Dv),
                 "out": (self.total_q, Hq, Dv), "lse": (Hq, self.total_q),
                 "cu_seqlens_q": (B + 1,), "cu_seqlens_k": (B + 1,)}
        elif self.kv_layout is KVLayout.PAGED:
            P, ps = self.num_pages, self.page_size
            s = {"q": (B, Sq, Hq, D), "k": (P, ps, Hkv, D), "v": (P, ps, Hkv, Dv),
                 "out": (B, Sq, Hq, Dv), "lse": (B, Hq, Sq),
                 "block_table": (B, self.max_pages), "seqlens_k": (B,)}
        else:
            s = {"q": (B, Sq, Hq, D), "k": (B, Sk, Hkv, D), "v": (B, Sk, Hkv, Dv),
                 "out": (B, Sq, Hq, Dv), "lse": (B, Hq, Sq)}
            if self.has_seqlens_k:
                s["seqlens_k"] = (B,)
        if not self.return_lse:
            del s["lse"]
        return s

    @property
    def flops(self) -> int:
        """Matmul flops of the unmasked problem, ``2 * B * Hq * Sq * Sk * (D + Dv)``."""
        return 2 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * (self.head_dim + self.head_dim_v)

    # -- verify -------------------------------------------------------------------------------
    def verify(self) -> "Attention":
        """Check every field; raise ``InvalidInputError`` naming field, value and rule. Returns self."""
        n = "Attention"
        for f in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "head_dim_v"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(n, f"{f}={v!r} must be a positive int")
        if self.heads_q % self.heads_kv:
            _fail(n, f"heads_q={self.heads_q} is not a multiple of heads_kv={self.heads_kv}: "
                     "grouped-query attention needs Hq % Hkv == 0")
        if self.dtype not in STORAGE_FLOATS:
            _fail(n, f"dtype={self.dtype} must be one of float16, bfloat16, float32")
        if not isinstance(self.scale, float) or not math.isfinite(self.scale) or self.scale == 0.0:
            _fail(n, f"scale={self.scale!r} must be a finite non-zero float")
        for f in ("score_mod", "mask_mod"):
            m = getattr(self, f)
            if isinstance(m, Expr):
                m.check(f"{n}.{f}")
        if self.score_mod is not None:
            if not isinstance(self.score_mod, Expr) or self.score_mod.is_bool():
                _fail(n, f"score_mod={self.score_mod} must be a numeric Expr (it returns the new score)")
        if self.mask_mod is not None:
            if not isinstance(self.mask_mod, Expr) or not self.mask_mod.is_bool():
                _fail(n, f"mask_mod={self.mask_mod} must be a boolean Expr (True keeps the key)")
            if "score" in self.mask_mod.variables():
                _fail(n, "mask_mod reads 'score': masks may depend on positions and heads only")
        lay = self.kv_layout
        if lay is KVLayout.PAGED:
            if self.page_size < 1 or self.num_pages < 1:
                _fail(n, f"page_size={self.page_size}, num_pages={self.num_pages} must be positive for paged KV")
            if self.seqlen_k % self.page_size:
                _fail(n, f"seqlen_k={self.seqlen_k} must equal max_pages * page_size={self.page_size}")
            if not self.has_seqlens_k:
                _fail(n, "paged KV needs seqlens_k (the number of valid keys per batch entry)")
        elif self.page_size or self.num_pages:
            _fail(n, f"page_size={self.page_size} / num_pages={self.num_pages} are only meaningful for paged KV")
        if lay is KVLayout.VARLEN:
            if self.total_q < 1 or self.total_k < 1:
                _fail(n, f"total_q={self.total_q}, total_k={self.total_k} must be positive for varlen")
            if self.has_seqlens_k:
                _fail(n, "varlen takes its key lengths from cu_seqlens_k; seqlens_k must be None")
        elif self.total_q or self.total_k:
            _fail(n, "total_q / total_k are only meaningful for varlen")
        return self

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = {"op": self.kind}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Expr):
                v = v.to_json()
            elif isinstance(v, enum.Enum):
                v = v.value
            d[f.name] = v
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Attention":
        kw = {k: v for k, v in d.items() if k != "op"}
        kw["dtype"] = DType(kw["dtype"])
        kw["kv_layout"] = KVLayout(kw["kv_layout"])
        for k in ("score_mod", "mask_mod"):
            if kw.get(k) is not None:
                kw[k] = Expr.from_json(kw[k])
        kw["scale"] = float(kw["scale"])
        return cls(**kw)

    def content_hash(self) -> str:
        return content_hash(self)

    def replace(self, **changes) -> "Attention":
        return replace(self, **changes)


#: The input transforms a ``QuantGemv`` may ask for (``QuantGemv.prologue``).
X_PROLOGUES = ("silu_mul",)


def x_columns(K: int, prologue: str | None) -> int:
    """Columns of a quant_gemv's stored ``x`` for weights of ``K`` inputs: ``K``, or ``2K`` (gate, up) with
    the ``silu_mul`` prologue."""
    return 2 * K if prologue == "silu_mul" else K


@dataclass(frozen=True)
class QuantGemv:
    """``out (M, N) = x (M, K) @ dequant(W (N, K))^T`` with fp32 accumulation.

    ``prologue`` (None or one of ``X_PROLOGUES``) forms the GEMV's input from a wider ``x``:

    * ``"silu_mul"``: ``x`` is ``(M, 2K)``, gate then up (the output of a fused gate/up projection); the input is
      ``silu(x[:, :K]) * x[:, K:]``, formed in float32 from the stored values and not rounded to ``dtype`` (a
      backend may round no coarser than float32).
    """

    M: int
    N: int
    K: int
    dtype: DType
    fmt: QuantFormat
    out_dtype: DType | None = None
    prologue: str | None = None

    kind = "quant_gemv"

    @property
    def result_dtype(self) -> DType:
        return self.out_dtype or self.dtype

    @property
    def x_columns(self) -> int:
        """Columns of ``x``: ``K``, or ``2K`` with the ``silu_mul`` prologue."""
        return x_columns(self.K, self.prologue)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {"x": (self.M, self.x_columns), "out": (self.M, self.N)}

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight payload with its scales and zeros (the GEMV floor's bulk)."""
        G = self.K // self.fmt.group_size
        scale_bytes = self.N * G * self.fmt.scale_dtype.itemsize
        zero_bytes = 0 if self.fmt.symmetric else self.N * G * self.fmt.bits / 8
        return int(self.N * self.K * self.fmt.bits / 8 + scale_bytes + zero_bytes)

    def verify(self) -> "QuantGemv":
        n = "QuantGemv"
        for f in ("M", "N", "K"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(n, f"{f}={v!r} must be a positive int")
        if self.dtype not in STORAGE_FLOATS:
            _fail(n, f"dtype={self.dtype} must be one of float16, bfloat16, float32")
        if self.out_dtype is not None and self.out_dtype not in STORAGE_FLOATS:
            _fail(n, f"out_dtype={self.out_dtype} must be one of float16, bfloat16, float32")
        if not isinstance(self.fmt, QuantFormat):
            _fail(n, f"fmt={self.fmt!r} must be a QuantFormat")
        if self.prologue is not None and self.prologue not in X_PROLOGUES:
            _fail(n, f"prologue={self.prologue!r} must be None or one of {', '.join(map(repr, X_PROLOGUES))}")
        self.fmt.verify(K=self.K, N=self.N)
        return self

    def to_json(self) -> dict:
        d = {"op": self.kind, "M": self.M, "N": self.N, "K": self.K, "dtype": self.dtype.value,
             "fmt": self.fmt.to_json(), "out_dtype": self.out_dtype.value if self.out_dtype else None}
        if self.prologue is not None:   # absent when unset: the hashes of plain GEMVs do not change
            d["prologue"] = self.prologue
        return d

    @classmethod
    def from_json(cls, d: dict) -> "QuantGemv":
        return cls(M=d["M"], N=d["N"], K=d["K"], dtype=DType(d["dtype"]),
                   fmt=QuantFormat.from_json(d["fmt"]),
                   out_dtype=DType(d["out_dtype"]) if d.get("out_dtype") else None, prologue=d.get("prologue"))

    def content_hash(self) -> str:
        return content_hash(self)

    def replace(self, **changes) -> "QuantGemv":
        return replace(self, **changes)


OPS = {Attention.kind: Attention, QuantGemv.kind: QuantGemv}


def op_from_json(d: dict):
    """Rebuild any op node from its ``to_json()`` form.

    Raises ``InvalidInputError`` for a ``d`` that is not a dict, names no known op, lacks a field or holds a value
    the field cannot take (naming the key); the node's own rules are checked by its constructor and ``verify()``.
    """
    if not isinstance(d, dict):
        _fail("op_from_json", f"got a {type(d).__name__}: it must be the dict an op's to_json() made")
    cls = OPS.get(d.get("op"))
    if cls is None:
        _fail("op_from_json", f"op={d.get('op')!r} is unknown: expected one of {', '.join(OPS)}")
    try:
        return cls.from_json(d)
    except PortakernError:
        raise
    except KeyError as e:
        _fail("op_from_json", f"the {cls.kind} dict lacks the key {e.args[0]!r}; pass the dict "
                              f"{cls.__name__}.to_json() made")
    except (ValueError, TypeError) as e:
        _fail("op_from_json", f"the {cls.kind} dict holds a value its field cannot take ({e}); pass the dict "
                              f"{cls.__name__}.to_json() made")


def content_hash(node) -> str:
    """Stable 16-hex-digit sha256 of the node's canonical JSON (cache keys, case ids)."""
    text = json.dumps(node.to_json(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
