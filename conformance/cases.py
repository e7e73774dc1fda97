"""The case catalogue ``cases-v3``: a cpu tier (goldens checked in) and a larger gpu tier.

Every case has a stable id that spells what it checks, e.g.
``attn-d128-sq113-sk512-h8g4-b1-causal-bf16`` or ``gemv-gptq-gidx-g128-m7-n200-k640-fp16``.
Ids never depend on list order; a case's inputs are seeded by its id. Changing a case means a new
id (or a new suite version): goldens are keyed by id and checked by input hash.

The cpu tier keeps big problems rare (one batch entry, few heads) so the float64 reference runs
the whole tier in well under 3 minutes on two cores. The gpu tier (``cases-v3-gpu``) adds
production-sized problems; its goldens are computed by the CPU reference on the fly and cached.

``cases-v2`` is ``cases-v1`` plus the cases with NaN and infinities in the inputs
(``conformance/nonfinite.py``, ids ``nf-*``), whose goldens follow ``docs/ir.md`` "Non-finite values".
``cases-v3`` is ``cases-v2`` plus the GEMV cases of the GGUF K-quants Q4_K, Q5_K and Q6_K (``KQUANT_FORMATS``,
ids ``gemv-q4_k-*``, ``gemv-q5_k-*``, ``gemv-q6_k-*``).
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Sequence

from portakern.ir import expr as E

from .case import DTYPE_SHORT, AttentionCase, GemvCase

SUITE = "cases-v3"
TIERS = ("cpu", "gpu")
DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (32, 59, 64, 96, 111, 128, 256)

# -- attention variants: name -> call options (causal, window, softcap, score_mod, mask_mod) ------

_diag = E.q_idx + E.seqlen_k - E.seqlen_q
#: custom score_mod: a batch-dependent, distance-decaying bias minus a per-head offset
BIAS_SCORE = E.score + E.where(E.b.eq(1), 0.5, -0.25) * E.exp(-abs(E.q_idx - E.kv_idx) / 32.0) - E.h * 0.125
#: custom mask_mod with fully masked rows: head 0 hides every key from its first 3 query rows
ROW_MASK = (E.q_idx >= 3) | (E.h > 0)
#: custom mask_mod: causal but never fewer than 3 keys, and head 1 skips keys 4..6
CUSTOM_MASK = (E.kv_idx <= E.maximum(_diag, 2)) & ~((E.kv_idx > 3) & (E.kv_idx < 7) & E.h.eq(1))


def variant(name: str, Hq: int, Sk: int) -> dict:
    """Call options of a named variant for a problem with ``Hq`` query heads and ``Sk`` keys."""
    if name == "none":
        return {}
    if name == "causal":
        return {"causal": True}
    if name == "window":
        return {"window": (48, 0)}
    if name == "window2":
        return {"window": (16, 8)}
    if name == "softcap":
        return {"softcap": 5.0}
    if name == "capcausal":
        return {"softcap": 3.0, "causal": True}
    if name == "alibi":
        return {"causal": True, "score_mod": E.alibi_score(E.alibi_slopes(Hq))}
    if name == "bias":
        return {"score_mod": BIAS_SCORE}
    if name == "rowmask":
        return {"mask_mod": ROW_MASK}
    if name == "custommask":
        return {"mask_mod": CUSTOM_MASK}
    if name == "biasmask":
        return {"score_mod": BIAS_SCORE, "mask_mod": CUSTOM_MASK, "scale": 0.09}
    if name == "prefixlm":
        return {"mask_mod": E.prefix_lm_mask(8)}
    if name == "docmask":
        return {"mask_mod": E.document_mask((max(1, Sk // 3), max(2, (2 * Sk) // 3)))}
    if name == "scale":
        return {"scale": 0.3, "causal": True}
    raise KeyError(f"unknown attention variant {name!r}")


def _attn(dtype: str, B: int, Sq: int, Sk: int, Hq: int, Hkv: int, D: int, var: str, *, Dv: int = 0,
          layout: str = "dense", lse: bool = False, tier: str = "cpu", extra: str = "", **kw) -> AttentionCase:
    parts = [f"attn-d{D}"] + ([f"dv{Dv}"] if Dv and Dv != D else []) + [
        f"sq{Sq}", f"sk{Sk}", f"h{Hq}g{Hq // Hkv}", f"b{B}"]
    if layout == "paged":
        parts.append(f"paged{kw['page_size']}")
    elif layout != "dense":
        parts.append(layout)
    elif kw.get("seqlens_k") is not None:
        parts.append("lens")
    parts += [p for p in (extra, var, DTYPE_SHORT[dtype]) if p] + (["lse"] if lse else [])
    return AttentionCase(id="-".join(parts), dtype=dtype, B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv,
                         layout=layout, return_lse=lse, tier=tier, tags=(var,),
                         **variant(var, Hq, Sk), **kw)


def _paged(dtype, Sq, Hq, Hkv, D, var, lens: Sequence[int], ps: int, *, lse=False, tier="cpu", spare=3):
    need = [-(-L // ps) for L in lens]
    max_pages = max(max(need), 1) + 1          # one spare column: never read
    return _attn(dtype, len(lens), Sq, max_pages * ps, Hq, Hkv, D, var, layout="paged", lse=lse, tier=tier,
                 seqlens_k=tuple(lens), page_size=ps, num_pages=sum(need) + spare)


def _varlen(dtype, Hq, Hkv, D, var, q_lens, k_lens, *, name: str, lse=False, tier="cpu"):
    return _attn(dtype, len(q_lens), max(q_lens), max(k_lens), Hq, Hkv, D, var, layout="varlen",
                 lse=lse, tier=tier, extra=name, q_lens=tuple(q_lens), k_lens=tuple(k_lens))


# -- attention, cpu tier ---------------------------------------------------------------------------

SEQ_PAIRS = ((1, 1), (1, 4096), (239, 1), (113, 512), (48, 20), (17, 300))
GQA = ((2, 2), (4, 1), (8, 1))                          # ratios 1, 4, 8
GRID_VARIANTS = ("none", "causal", "window", "softcap", "alibi", "bias")
RICH_VARIANTS = ("causal", "window", "window2", "softcap", "capcausal", "alibi", "bias", "rowmask",
                 "custommask", "biasmask", "prefixlm", "docmask")


def attention_cpu() -> list[AttentionCase]:
    out: list[AttentionCase] = []
    # 1. head dim x sequence pair grid, two cases each (a Latin square over variant, dtype, GQA)
    for di, D in enumerate(HEAD_DIMS):
        for pi, (Sq, Sk) in enumerate(SEQ_PAIRS):
            big = Sq >= 48
            for j in range(2):
                var = GRID_VARIANTS[(di + pi) % 6] if j == 0 else (
                    "causal" if GRID_VARIANTS[(di + pi) % 6] != "causal" else "none")
                Hq, Hkv = GQA[(2 * di + pi + j) % 3]
                if big and Hq > 4 and D >= 64:   # keep the big prefill outputs small
                    Hq, Hkv = 4, 1
                B = 3 if Sq == Sk == 1 else 1
                out.append(_attn(DTYPES[(di + 2 * pi + j) % 3], B, Sq, Sk, Hq, Hkv, D, var,
                                 lse=(di + pi + j) % 3 == 0))
    # 2. the long square prefill, one head
    for D, var, dt, lse in ((32, "none", "float32", True), (64, "causal", "bfloat16", False),
                            (128, "causal", "float16", False), (59, "window", "bfloat16", True),
                            (256, "capcausal", "bfloat16", False)):
        out.append(_attn(dt, 1, 1023, 1023, 1, 1, D, var, lse=lse))
    # 3. every variant on four shapes and three dtypes
    shapes = ((1, 24, 300, 4, 1, 64), (3, 1, 777, 8, 1, 128), (1, 33, 16, 2, 2, 96), (1, 48, 48, 2, 2, 32))
    for si, (B, Sq, Sk, Hq, Hkv, D) in enumerate(shapes):
        for vi, var in enumerate(RICH_VARIANTS):
            for ti, dt in enumerate(DTYPES):
                out.append(_attn(dt, B, Sq, Sk, Hq, Hkv, D, var, lse=(si + vi + ti) % 4 == 0))
    # 4. paged KV, page sizes 16 / 64 / 256, shuffled block tables
    for pi, ps in enumerate((16, 64, 256)):
        dts = [DTYPES[(pi + i) % 3] for i in range(6)]
        out += [_paged(dts[0], 1, 8, 2, 128, "none", (1, 300, 1000, 17), ps, lse=True),
                _paged(dts[1], 1, 8, 2, 128, "window", (1, 300, 1000, 17), ps),
                _paged(dts[2], 37, 4, 4, 64, "causal", (37, 530), ps, lse=pi == 1),
                _paged(dts[3], 37, 4, 4, 64, "capcausal", (37, 530), ps),
                _paged(dts[4], 5, 4, 1, 96, "causal", (0, 260, 5), ps, lse=True),
                _paged(dts[5], 5, 4, 1, 96, "alibi", (0, 260, 5), ps)]
    # 5. varlen (packed) batches; set B has an empty key sequence and one with more queries than keys
    sets = (("vA", 4, 2, 64, (3, 17, 1, 40), (3, 30, 200, 40)),
            ("vB", 8, 1, 64, (5, 12, 0, 9), (0, 10, 7, 300)))
    for name, Hq, Hkv, D, ql, kl in sets:
        for vi, var in enumerate(("none", "causal", "window", "softcap", "alibi")):
            for ti, dt in enumerate(DTYPES):
                out.append(_varlen(dt, Hq, Hkv, D, var, ql, kl, name=name, lse=(vi + ti) % 3 == 0))
    # 6. dense with per-batch key lengths (one empty)
    for var in ("none", "causal"):
        for ti, dt in enumerate(DTYPES):
            out.append(_attn(dt, 3, 7, 300, 4, 4, 64, var, seqlens_k=(300, 0, 123), lse=ti == 0))
    # 7. value head dim != key head dim
    for D, Dv, var, dt in ((128, 64, "causal", "bfloat16"), (64, 128, "none", "float16"),
                           (192, 128, "causal", "float32"), (96, 32, "softcap", "float16"),
                           (256, 128, "scale", "bfloat16"), (32, 96, "alibi", "float32")):
        out.append(_attn(dt, 2, 19, 67, 4, 2, D, var, Dv=Dv, lse=True))
    return out


# -- quantized GEMV ----------------------------------------------------------------------------

#: (packing, bits, symmetric, g_idx, short name)
FORMATS = (("native", 4, True, False, "native4s"), ("native", 4, False, False, "native4a"),
           ("native", 8, True, False, "native8s"), ("native", 8, False, False, "native8a"),
           ("awq", 4, False, False, "awq"), ("gptq", 4, False, False, "gptq"),
           ("gptq", 4, False, True, "gptq-gidx"), ("gguf_q4_0", 4, True, False, "q4_0"),
           ("gguf_q8_0", 8, True, False, "q8_0"))
#: GGUF K-quants: super-blocks of 256 weights along K, groups (sub-blocks) of 32 (Q6_K: 16), float16 super-scales
#: times small integer sub-block scales, and (Q4_K, Q5_K) a float minimum per group
KQUANT_FORMATS = (("gguf_q4_k", 4, False, False, "q4_k"), ("gguf_q5_k", 5, False, False, "q5_k"),
                  ("gguf_q6_k", 6, True, False, "q6_k"))
#: (M, N, K) of the K-quant cases: batch 1 and small batches, K a multiple of 256, N not a multiple of 64
KQUANT_SHAPES = ((1, 77, 256), (3, 130, 512), (1, 199, 1024), (8, 61, 768), (16, 33, 256))
GROUPS = (32, 64, 128, 0)                  # 0: one group spanning K
MS = (1, 2, 7, 16)
#: K per group size: never a multiple of 64 where the group allows it
K_FOR_GROUP = {32: 352, 64: 448, 128: 640, 0: 200}


def _gemv(dtype, M, N, K, fmt, G, *, scale_dtype="float16", tier="cpu", prologue="") -> GemvCase:
    packing, bits, sym, gidx, short = fmt
    gname = "gK" if G == K else f"g{G}"
    sd = "" if scale_dtype == "float16" else f"-s{DTYPE_SHORT[scale_dtype]}"
    pro = "-silu" if prologue == "silu_mul" else ""
    cid = f"gemv-{short}-{gname}-m{M}-n{N}-k{K}-{DTYPE_SHORT[dtype]}{sd}{pro}"
    return GemvCase(id=cid, dtype=dtype, M=M, N=N, K=K, packing=packing, bits=bits, symmetric=sym,
                    group_size=G, scale_dtype=scale_dtype, has_g_idx=gidx, tier=tier,
                    tags=(short,) + (("silu",) if prologue else ()), prologue=prologue)


def gemv_cpu() -> list[GemvCase]:
    out: list[GemvCase] = []
    for fi, fmt in enumerate(FORMATS):
        gguf = fmt[0].startswith("gguf")
        n_words = fmt[0] in ("awq", "gptq")     # N packed 8 per int32
        for gi, G in enumerate((32,) if gguf else GROUPS):
            K = K_FOR_GROUP[G]
            for mi, M in enumerate(MS):
                N = (72, 200, 136, 328)[mi] if n_words else (77, 199, 130, 333)[mi]
                dt = DTYPES[(fi + gi + mi) % 3]
                out.append(_gemv(dt, M, N, K, fmt, G or K))
        if gguf:  # a longer K and the other dtypes for the fixed-group formats
            for mi, (M, dt) in enumerate(((1, "float16"), (3, "bfloat16"), (16, "float32"), (5, "float16"))):
                out.append(_gemv(dt, M, (65, 250, 99, 31)[mi], (1024, 96, 160, 2080)[mi], fmt, 32))
    # scale dtypes other than float16 (native packing stores any of the three)
    for fmt in FORMATS[:4]:
        for sd, dt, M in (("bfloat16", "bfloat16", 2), ("float32", "float32", 7)):
            out.append(_gemv(dt, M, 101, 192, fmt, 64, scale_dtype=sd))
    # a long K at batch 1 and a wide N at batch 16
    for fmt in (FORMATS[1], FORMATS[4], FORMATS[6]):
        out.append(_gemv("bfloat16", 1, 72, 4096, fmt, 128))
        out.append(_gemv("float16", 16, 1032, 256, fmt, 32))
    # GGUF K-quants: every dtype over the shapes, and the silu_mul prologue at a small batch
    for fi, fmt in enumerate(KQUANT_FORMATS):
        group = 16 if fmt[0] == "gguf_q6_k" else 32
        for si, (M, N, K) in enumerate(KQUANT_SHAPES):
            out.append(_gemv(DTYPES[(fi + si) % 3], M, N, K, fmt, group))
        out.append(_gemv(DTYPES[fi], 2, 48, 512, fmt, group, prologue="silu_mul"))
    # the silu_mul prologue (x = gate | up): int4 / int8, act-order, GGUF, batch 1 to 16, every dtype
    # (M = 1 runs in the gpu tier and the GEMV tests: a cpu-tier "m1" case would join the "gemv-*m1-*" subsets)
    for fmt, G, M, dt in ((FORMATS[1], 128, 3, "bfloat16"), (FORMATS[3], 64, 7, "float16"),
                          (FORMATS[6], 32, 2, "float32"), (FORMATS[7], 32, 16, "bfloat16")):
        out.append(_gemv(dt, M, 96, K_FOR_GROUP[G], fmt, G, prologue="silu_mul"))
    return out


# -- gpu tier: production shapes (goldens computed on the fly) -------------------------------------

def attention_gpu() -> list[AttentionCase]:
    out: list[AttentionCase] = []
    t = "gpu"
    for D in (64, 128, 256):
        for var, dt in (("causal", "bfloat16"), ("none", "float16"), ("window", "bfloat16")):
            out.append(_attn(dt, 2, 2048, 2048, 16, 4, D, var, tier=t, lse=var == "causal"))
    for D in (59, 96, 111):
        out.append(_attn("float16", 1, 1000, 1000, 8, 8, D, "causal", tier=t))
    for Hq, Hkv in ((32, 32), (32, 8), (32, 4)):
        for dt in DTYPES:
            out.append(_attn(dt, 8, 1, 8192, Hq, Hkv, 128, "none", tier=t, lse=dt == "float32"))
    for ps in (16, 64, 256):
        lens = (8000, 1, 3000, 4096, 17, 6000, 2048, 100)
        for var, dt in (("none", "bfloat16"), ("softcap", "float16"), ("window", "bfloat16")):
            out.append(_paged(dt, 1, 32, 8, 128, var, lens, ps, tier=t, lse=var == "none"))
        out.append(_paged("bfloat16", 64, 16, 4, 128, "causal", (1000, 64, 2500, 700), ps, tier=t))
    for var in ("causal", "softcap", "alibi", "bias", "custommask", "docmask"):
        for dt in ("bfloat16", "float16"):
            out.append(_attn(dt, 2, 1024, 1536, 8, 2, 256 if var == "softcap" else 128, var, tier=t))
    ql, kl = (512, 1, 900, 33, 0, 1200, 77, 300), (512, 2000, 900, 20, 64, 1200, 4000, 300)
    for var in ("none", "causal", "window"):
        for dt in ("bfloat16", "float16"):
            out.append(_varlen(dt, 16, 4, 128, var, ql, kl, name="vG", tier=t, lse=var == "causal"))
    out.append(_attn("float32", 1, 4096, 4096, 4, 1, 64, "causal", tier=t))
    out.append(_attn("bfloat16", 4, 239, 1, 32, 8, 128, "causal", tier=t))
    out.append(_attn("bfloat16", 1, 1, 131072, 8, 1, 128, "none", tier=t, lse=True))
    return out


def gemv_gpu() -> list[GemvCase]:
    out: list[GemvCase] = []
    shapes = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096))
    for fi, fmt in enumerate(FORMATS):
        gs = (32,) if fmt[0].startswith("gguf") else (128, 32)
        for si, (N, K) in enumerate(shapes[: 2 if fi % 2 else 4]):
            for G in gs:
                for mi, M in enumerate((1, 16) if si % 2 else (1, 4, 16)):
                    dt = ("bfloat16", "float16", "float32")[(fi + si + mi) % 3]
                    out.append(_gemv(dt, M, N, K, fmt, G, tier="gpu"))
    # GGUF K-quants on a square projection, batch 1 and 16
    for fi, fmt in enumerate(KQUANT_FORMATS):
        for M, dt in ((1, "bfloat16"), (16, ("float16", "float32", "float16")[fi])):
            out.append(_gemv(dt, M, 4096, 4096, fmt, 16 if fmt[0] == "gguf_q6_k" else 32, tier="gpu"))
    # the silu_mul prologue on a down projection's shape (x = gate | up of width 2 x 11008)
    for fmt in (FORMATS[1], FORMATS[3], FORMATS[5]):
        for M, dt in ((1, "bfloat16"), (16, "float16")):
            out.append(_gemv(dt, M, 4096, 11008, fmt, 128, tier="gpu", prologue="silu_mul"))
    return out


# -- access --------------------------------------------------------------------------------------

_CACHE: dict[str, list] = {}


def all_cases(tier: str = "cpu") -> list:
    """Every case of ``tier``: "cpu" is the checked-in tier, "gpu" adds the production shapes."""
    if tier not in TIERS:
        from portakern.errors import InvalidInputError

        raise InvalidInputError(f"tier={tier!r} is unknown: expected one of {', '.join(TIERS)}")
    if tier not in _CACHE:
        from .nonfinite import attention_nonfinite, gemv_nonfinite

        cases = attention_cpu() + gemv_cpu() + attention_nonfinite() + gemv_nonfinite()
        if tier == "gpu":
            from .nonfinite import nonfinite_gpu

            cases += attention_gpu() + gemv_gpu() + nonfinite_gpu()
        ids = [c.id for c in cases]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise AssertionError(f"duplicate case ids in {SUITE}: {dup[:5]}")
        _CACHE[tier] = cases
    return list(_CACHE[tier])


def select(cases: Iterable, patterns: Sequence[str] | str | None) -> list:
    """Cases whose id matches any glob in ``patterns`` (comma-separated string or list); all if None."""
    if not patterns:
        return list(cases)
    if isinstance(patterns, str):
        patterns = [patterns]
    globs = [g.strip() for p in patterns for g in p.split(",") if g.strip()]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, g) for g in globs)]


def by_id(case_id: str, tier: str = "gpu"):
    for c in all_cases(tier):
        if c.id == case_id:
            return c
    raise KeyError(f"no case {case_id!r} in {SUITE} (tier {tier}); list the ids with: "
                   f"portakern conformance --list --tier {tier}")
