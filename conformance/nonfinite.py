"""Cases with NaN and infinities in the inputs: the semantics of ``docs/ir.md`` ("Non-finite values").

Each case is an ordinary case of the cpu tier whose generated inputs then get a few elements
overwritten ("poisoned") with NaN, +inf or -inf. Their ids are ``nf-<what>-<the base case's id>``
(run them alone with ``--cases 'nf-*'``), e.g. ``nf-qnan-attn-d64-sq33-sk80-h4g2-b1-causal-fp16-lse``
or ``nf-snan-gemv-native4s-g32-m7-n130-k352-fp16``.

A poison entry is ``(tensor, where, value)``:

* attention ``q``, ``k``, ``v``: ``where`` is the logical index ``(b, position, head, dim)`` in every
  layout (the position inside sequence ``b``; paged keys are found through the block table, varlen
  rows through ``cu_seqlens``), or ``"unread"``: every key row of ``k`` / ``v`` that no sequence
  reads (past a ``seqlens_k`` length, unused pages and page tails), which must never reach an output;
* quantized GEMV ``x``: ``(m, column)``; ``scales``: ``(n, group)`` of the generated ``(N, K // G)``
  scales (packed afterwards, so every format stores the poisoned value);

and ``value`` is ``"nan"``, ``"inf"`` or ``"-inf"``. The poison only lands where a backend's result is
defined by ``docs/ir.md``: never a non-finite ``v`` of a key hidden from some row by the mask, and
never an infinite ``v`` in a float16 case (whose probabilities may underflow to 0, and 0 * inf is NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .case import AttentionCase, GemvCase

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _check_value(value: str) -> float:
    if value not in VALUES:
        raise ValueError(f"poison value {value!r} is not one of {', '.join(VALUES)}")
    return VALUES[value]


@dataclass(frozen=True)
class PoisonedAttentionCase(AttentionCase):
    """An ``AttentionCase`` whose generated q, k, v get the ``poison`` entries (module docstring)."""

    poison: tuple = ()

    def inputs(self) -> dict[str, np.ndarray]:
        out = super().inputs()
        for name, where, value in self.poison:
            x = _check_value(value)
            if where == "unread":
                out[name][self._unread_rows()] = x
            else:
                out[name][self._locate(name, where)] = x
        return out

    def _locate(self, name: str, where: tuple) -> tuple:
        b, pos, h, d = where
        if self.layout == "varlen":
            cu = self.q_lens if name == "q" else self.k_lens
            return int(np.sum(cu[:b])) + pos, h, d
        if self.layout == "paged" and name != "q":
            page = int(self._block_table()[b, pos // self.page_size])
            return page, pos % self.page_size, h, d
        return b, pos, h, d

    def _unread_rows(self) -> np.ndarray:
        """Boolean mask over the key rows (all but the last two axes) that no sequence reads."""
        if self.layout == "paged":
            read = np.zeros((self.num_pages, self.page_size), dtype=bool)
            table = self._block_table()
            for b, L in enumerate(self.seqlens_k):
                for i in range(-(-L // self.page_size)):
                    read[table[b, i], : min(self.page_size, L - i * self.page_size)] = True
            return ~read
        if self.layout == "varlen":  # the packed keys are exactly the sequences' keys: all are read
            return np.zeros(sum(self.k_lens), dtype=bool)
        read = np.zeros((self.B, self.Sk), dtype=bool)
        for b in range(self.B):
            read[b, : self.Sk if self.seqlens_k is None else self.seqlens_k[b]] = True
        return ~read


@dataclass(frozen=True)
class PoisonedGemvCase(GemvCase):
    """A ``GemvCase`` whose generated ``x`` and ``scales`` get the ``poison`` entries (module docstring)."""

    poison: tuple = ()

    def inputs(self) -> dict[str, np.ndarray]:
        out = super().inputs()
        for name, where, value in self.poison:
            out[name][tuple(where)] = _check_value(value)
        return out


def _poisoned(cls, base, tag: str, poison: tuple):
    """``base`` with ``poison``, its id ``nf-<tag>-<base id>``."""
    kw = {f.name: getattr(base, f.name) for f in fields(base)}
    kw["id"] = f"nf-{tag}-{base.id}"
    return cls(**kw, poison=poison)


def attention_nonfinite() -> list[AttentionCase]:
    """The attention cases with NaN / inf in q, k or v (prefill, decode, split-KV decode, paged, varlen)."""
    from .cases import _attn, _paged, _varlen

    def nf(case, tag, poison):
        return _poisoned(PoisonedAttentionCase, case, tag, poison)

    def dense(dt, B, Sq, Sk, Hq, Hkv, var, tag, poison, **kw):
        return nf(_attn(dt, B, Sq, Sk, Hq, Hkv, 64, var, **kw), tag, poison)

    out = [
        # NaN in q: that row of that head is NaN, every other row and head stays finite
        dense("float16", 2, 33, 80, 4, 2, "causal", "qnan", (("q", (1, 7, 2, 5), "nan"),), lse=True),
        # NaN in k of key 50: rows that see it are NaN, rows whose causal mask hides it are not
        dense("bfloat16", 1, 33, 80, 4, 2, "causal", "knan", (("k", (0, 50, 1, 9), "nan"),), lse=True),
        # +inf in k: a visible score of +inf (NaN row) or -inf (weight 0), by the sign of q
        dense("float32", 1, 24, 60, 4, 1, "none", "kinf", (("k", (0, 11, 0, 0), "inf"),), lse=True),
        # ... and softcap maps +-inf scores to +-softcap: every row stays finite
        dense("float32", 1, 24, 60, 4, 1, "softcap", "kinf", (("k", (0, 11, 0, 0), "inf"),), lse=True),
        dense("bfloat16", 1, 24, 60, 4, 1, "softcap", "kinf", (("k", (0, 11, 0, 0), "-inf"),)),
        # inf / -inf / NaN in v of keys every row sees: +inf, NaN (inf - inf) or NaN in those columns
        dense("float32", 1, 33, 80, 4, 2, "causal", "vinf",
              (("v", (0, 0, 0, 3), "inf"), ("v", (0, 1, 0, 7), "-inf"), ("v", (0, 2, 1, 8), "nan"),
               ("v", (0, 2, 1, 9), "inf"), ("v", (0, 3, 1, 9), "-inf")), lse=True),
        dense("bfloat16", 2, 5, 30, 4, 4, "none", "vinf", (("v", (1, 29, 2, 0), "inf"), ("v", (0, 4, 3, 1), "nan"))),
        # fully masked rows (head 0, rows 0..2) stay 0 / -inf even with NaN in their q
        dense("float16", 1, 12, 20, 2, 2, "rowmask", "qnan",
              (("q", (0, 1, 0, 4), "nan"), ("q", (0, 5, 0, 4), "nan")), lse=True),
        # keys past a seqlens_k length are never read, whatever they hold
        dense("float16", 3, 7, 96, 4, 2, "causal", "unread", (("k", "unread", "nan"), ("v", "unread", "nan")),
              seqlens_k=(96, 0, 41), lse=True),
        # decode over many keys (split-KV on a GPU): one poisoned head, one key of +inf
        dense("float16", 1, 1, 4096, 8, 2, "none", "qnan", (("q", (0, 0, 5, 17), "nan"),), lse=True),
        dense("float32", 2, 1, 4096, 8, 2, "none", "kinf", (("k", (1, 3000, 0, 2), "inf"),), lse=True),
        # paged decode: NaN garbage in unused pages and page tails, a NaN q head, a +inf key
        nf(_paged("float16", 1, 8, 2, 64, "none", (1, 40, 17, 200), 16, lse=True), "unread",
           (("k", "unread", "nan"), ("v", "unread", "nan"), ("q", (1, 0, 3, 0), "nan"),
            ("k", (3, 150, 1, 5), "inf"))),
        nf(_paged("bfloat16", 5, 4, 1, 64, "causal", (5, 260, 9), 64, lse=True), "vinf",
           (("k", "unread", "inf"), ("v", "unread", "nan"), ("v", (1, 0, 0, 2), "inf"),
            ("q", (2, 4, 3, 1), "nan"))),
        # varlen: NaN in one sequence's q row, +inf in another's k and in a third's v
        nf(_varlen("float32", 4, 2, 64, "causal", (3, 17, 1, 6), (3, 30, 50, 0), name="vC", lse=True), "mixed",
           (("q", (1, 4, 2, 0), "nan"), ("k", (2, 7, 0, 1), "inf"), ("v", (0, 0, 1, 6), "inf"),
            ("q", (3, 2, 0, 0), "nan"))),
    ]
    return out


def gemv_nonfinite() -> list[GemvCase]:
    """The quantized GEMV cases with NaN / inf in x or in the scales."""
    from .cases import FORMATS, _gemv

    def nf(fmt, G, tag, dt, M, N, K, poison, **kw):
        base = _gemv(dt, M, N, K, FORMATS[fmt], G, **kw)
        return _poisoned(PoisonedGemvCase, base, tag, poison)

    return [
        # NaN in x: every output of that row is NaN
        nf(1, 64, "xnan", "float16", 3, 77, 448, (("x", (1, 17), "nan"),)),
        nf(7, 32, "xnan", "bfloat16", 1, 65, 1024, (("x", (0, 1000), "nan"),)),
        # NaN in a scale: every output of that n is NaN
        nf(0, 32, "snan", "float16", 7, 130, 352, (("scales", (5, 2), "nan"), ("scales", (129, 10), "nan"))),
        nf(6, 128, "snan", "float16", 1, 72, 640, (("scales", (9, 3), "nan"),)),
        nf(4, 32, "snan", "float32", 2, 72, 352, (("scales", (70, 1), "nan"),)),
        nf(8, 32, "snan", "bfloat16", 1, 99, 160, (("scales", (3, 1), "nan"),)),
        nf(3, 64, "snan", "bfloat16", 2, 101, 192, (("scales", (100, 0), "nan"),), scale_dtype="bfloat16"),
        # shapes the cuda backend's kernel takes (groups of 128, M = 1 to 4, fp16 / bf16)
        nf(1, 128, "xnan", "bfloat16", 1, 200, 640, (("x", (0, 300), "nan"),)),
        nf(5, 128, "xnan", "float16", 3, 72, 1280, (("x", (2, 0), "nan"),)),
        nf(4, 128, "snan", "float16", 4, 136, 1024, (("scales", (77, 5), "nan"),)),
        nf(2, 128, "snan", "bfloat16", 2, 130, 640, (("scales", (0, 4), "nan"), ("scales", (129, 0), "nan"))),
        # the silu_mul prologue: NaN in the up half of x
        nf(1, 128, "xnan", "bfloat16", 3, 96, 640, (("x", (2, 700), "nan"),), prologue="silu_mul"),
    ]


def nonfinite_gpu() -> list:
    """Production-sized cases of the gpu tier (goldens computed on the fly), so the GPU-only kernel paths (TMA and
    warpgroup-MMA prefill, the warp-specialized split-KV decode, the GEMV kernels for large N and K) meet NaN and
    infinities too."""
    from .cases import FORMATS, _attn, _gemv, _paged

    def nf(case, tag, poison):
        return _poisoned(PoisonedAttentionCase, case, tag, poison)

    def gv(fmt, tag, dt, M, poison, N=4096, K=4096, G=128):
        return _poisoned(PoisonedGemvCase, _gemv(dt, M, N, K, FORMATS[fmt], G, tier="gpu"), tag, poison)

    t = "gpu"
    prefill = (("q", (0, 1500, 3, 7), "nan"), ("k", (0, 100, 1, 0), "inf"))
    decode = (("q", (1, 0, 5, 3), "nan"), ("k", (2, 5000, 3, 9), "inf"), ("v", (3, 7000, 0, 1), "inf"))
    return [
        nf(_attn("bfloat16", 1, 2048, 2048, 8, 2, 128, "causal", tier=t, lse=True), "mixed",
           prefill + (("v", (0, 0, 0, 5), "inf"),)),
        nf(_attn("float16", 1, 2048, 2048, 8, 2, 128, "none", tier=t, lse=True), "mixed", prefill),
        nf(_attn("bfloat16", 4, 1, 8192, 32, 8, 128, "none", tier=t, lse=True), "mixed", decode),
        nf(_attn("float16", 4, 1, 8192, 32, 8, 128, "none", tier=t), "mixed", decode[:2]),
        nf(_paged("float16", 1, 32, 8, 128, "none", (8000, 1, 3000, 17), 16, tier=t, lse=True), "unread",
           (("k", "unread", "nan"), ("v", "unread", "nan"), ("q", (2, 0, 30, 0), "nan"),
            ("k", (0, 7000, 7, 5), "inf"))),
        gv(1, "xnan", "bfloat16", 1, (("x", (0, 4000), "nan"),)),
        gv(4, "snan", "float16", 4, (("scales", (1000, 31), "nan"),)),
        gv(6, "snan", "bfloat16", 1, (("scales", (4095, 0), "nan"),)),
        gv(5, "xnan", "float16", 16, (("x", (9, 17), "nan"),)),
        gv(7, "snan", "bfloat16", 1, (("scales", (17, 3), "nan"),), N=11008, G=32),
    ]
