"""Autotuning of the quantized GEMV (``PORTAKERN_TRITON_AUTOTUNE=1``): the candidates worth timing for a weight and
M, their problem bucket, and the cached winner (``common.autotune.cached_best``: keyed by device identity, portakern
and Triton versions, and the bucket; a later process reads it back without timing)."""

from __future__ import annotations

import itertools
from dataclasses import replace

from .. import tuning
from ..common.arch import PDL_ARCHS
from .config import GemvConfig, choose, fit, frag_split, next_pow2, split_k_for, stream_usable


def bucket(layout, M: int, N: int, dtype: str) -> str:
    """Tuning bucket: bits, group, zeros, permutation, dtype, M (exact up to 16), N and K rounded to
    powers of two, irregular act-order groups (``kg``: a per-code group table, ``kgroup``), a fragment
    layout (``fr``) and float minimums (``mn``: GGUF Q4_K / Q5_K). The last three decide which kinds ``fit``
    accepts ("mma", "stream" and "frag" need regular groups and no minimums; "frag" a fragment layout), so
    weights that differ in them must not share a cached configuration: a winner restored on a weight that rules
    it out would be a ``ValueError``."""
    mn = "-mn1" if getattr(layout, "has_mins", False) else ""   # buckets of other weights keep their names
    return (f"b{layout.bits}-g{layout.group_size}-z{int(layout.has_z)}-p{int(layout.has_perm)}"
            f"-{dtype}-m{M if M <= 16 else next_pow2(M)}-n{next_pow2(N)}-k{next_pow2(layout.K)}"
            f"-kg{int(getattr(layout, 'kgroup', None) is not None)}-fr{int(getattr(layout, 'frag', None) is not None)}"
            f"{mn}")


def candidates(layout, M: int, N: int, arch: str, num_sms: int, dtype: str = "bfloat16") -> list[GemvConfig]:
    """Configurations worth timing (the table's choice first)."""
    base = choose(layout, M, N, arch, num_sms, dtype=dtype)
    out = [base]
    if base.kind == "stream" or (arch in tuning.STREAM and stream_usable(layout, M, dtype) is None):
        # the stream-K kernel next to the CUDA-core tiles: columns, units ahead, programs per SM
        for bn, ahead, per_sm in itertools.product((256, 128), (1, 2), (1, 2, 4)):
            cand = fit(GemvConfig("stream", block_n=bn, block_kw=16, prefetch=ahead, per_sm=per_sm,
                                  pdl=arch in PDL_ARCHS), layout, M)
            if cand not in out:
                out.append(cand)
        if base.kind == "stream":   # and the table's choice without it, whose neighbours follow
            base = choose(layout, M, N, arch, num_sms, dtype=dtype, stream=False)
            out.append(base)
    if base.kind == "frag":  # rows per program (warps x units) and the split around the table's
        for bn, w in ((64, 2), (64, 4), (128, 4), (128, 2), (256, 4), (128, 8)):
            c = fit(replace(base, block_n=bn, num_warps=w), layout, M)
            auto = frag_split(N, layout.K, c, M, num_sms)
            for split in sorted({auto, max(1, auto // 2), min(tuning.FRAG_MAX_SPLIT, 2 * auto)}):
                cand = replace(c, split_k=split)
                if cand not in out:
                    out.append(cand)
        return out
    if base.kind == "mma":   # the K tile is the group's; columns, warps, pipeline depth and x path vary
        for bn, w, st, xr in itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (False, True)):
            c = fit(replace(base, block_n=bn, num_warps=w, num_stages=st, x_runs=xr), layout, M)
            auto = split_k_for(N, layout.KWP, c, num_sms)
            for split in sorted({auto, max(1, auto // 2), 2 * auto}):
                cand = replace(c, split_k=split)
                if cand not in out:
                    out.append(cand)
        return out
    grid = [(bn, bkw, w, False) for bn in (32, 64, 128) for bkw in (16, 32, 64) for w in (4, 8)]
    if base.kind == "fma" and M == 1 and not layout.per_elem_group and not layout.has_perm:
        # group-resident tiles (4 columns per thread; 8 with one warp of 256): the rows sweep's winners
        grid += [(bn, bkw, w, True) for bn, w in ((128, 1), (256, 1), (256, 2), (512, 4)) for bkw in (8, 16)]
    for bn, bkw, w, rows in grid:
        c = fit(replace(base, block_n=bn, block_kw=bkw, num_warps=w, group_rows=rows), layout, M)
        auto = split_k_for(N, layout.KWP, c, num_sms)
        for split in sorted({auto, max(1, auto // 2)} if rows else {auto, 1}):
            cand = replace(c, split_k=split)
            if cand not in out:
                out.append(cand)
    return out


def tuned(layout, M: int, N: int, dtype: str, device, arch: str, num_sms: int, timer) -> GemvConfig:
    """The cached best configuration of the bucket, timing ``candidates`` with ``timer(cfg) -> s``."""
    from ..common.autotune import cached_best

    return cached_best("triton-gemv", device, bucket(layout, M, N, dtype),
                       candidates(layout, M, N, arch, num_sms, dtype), timer,
                       default=lambda: choose(layout, M, N, arch, num_sms, dtype=dtype),
                       restore=lambda d: fit(GemvConfig(**d), layout, M))
