"""The configurations ``benchmarks/gemv.py --sweep`` times per problem, and a winner moved to another shape."""

from __future__ import annotations

from dataclasses import replace

from portakern.backends.triton import tuning
from portakern.backends.triton.quant_gemv import config
from portakern.backends.triton.quant_gemv.config import GemvConfig
from portakern.ir import gemv_layout
from portakern.ir.ops import QuantGemv


def sweep_candidates(M: int, dqs=(2,), swaps=(False,), stages=(1,), prefetch=(1,), pdls=(False,),
                     group_rows=(False,), mma=False, mma_grid=((64, 128), (4, 8), (1, 2, 3, 4)),
                     bits: int = 4) -> list[GemvConfig]:
    """What the sweep times per M (``split_k=0``: the automatic split and no split; for group-resident
    tiles half, once and twice the automatic split), for each dequant variant in ``dqs``, pipeline
    depth in ``stages`` and register prefetch depth in ``prefetch`` (CUDA-core kernel), operand order
    in ``swaps`` (tensor-core kernel), each programmatic-dependent-launch setting in ``pdls``, and
    (M=1) with ``True`` in ``group_rows`` the group-resident tiles: 4 or 8 columns per thread, 8 or 16
    word rows (int8: also 32, a whole group), 1, 2 or 4 warps. ``mma``: the group-scaled tensor-core kernel (also at M=1, where its
    MMA multiplies 15 rows of padding for free), 64 or 128 columns, 4 or 8 warps, 2 to 4 pipeline
    stages (its K tile is the group's)."""
    out = []
    if mma:
        out += [GemvConfig("mma", bn, 16, w, st, 0, x_runs=xr) for bn in mma_grid[0] for w in mma_grid[1]
                for st in mma_grid[2] for xr in (False, True)]
    for dq in dqs:
        if M == 1:
            out += [GemvConfig("fma", bn, bkw, w, st, 0, dq, prefetch=pf) for bn in (32, 64) for bkw in (32, 64)
                    for w in (4, 8) for st in stages for pf in prefetch if st == 1 or pf == 1]
            if True in group_rows:
                out += [GemvConfig("fma", 32 * cols * w, bkw, w, 1, 0, dq, group_rows=True)
                        for w in (1, 2, 4) for cols in (4, 8) for bkw in (8, 16) + ((32,) if bits == 8 else ())]
        elif M <= 4:
            out += [GemvConfig("fma", bn, bkw, 4, 1, 0, dq) for bn in (32, 64) for bkw in (32, 64)]
    for sw in swaps:
        if 1 < M <= 4:
            out += [GemvConfig("dot", bn, bkw, 4, 2, 0, 2, sw) for bn in (64, 128) for bkw in (16, 32)]
        if M > 4:
            out += [GemvConfig("dot", bn, bkw, 4, 2, 0, 2, sw) for bn in (32, 64, 128) for bkw in (16, 32)]
            out += [GemvConfig("dot", bn, 32, 8, 2, 0, 2, sw) for bn in (64, 128)]
    return [replace(c, pdl=bool(p)) for p in pdls for c in out]


def with_split(cfg: GemvConfig, op: QuantGemv, splits=None) -> list[GemvConfig]:
    """``split_k=0`` in a candidate means: the automatic choice, and 1."""
    if cfg.split_k:
        return [cfg]
    kwp = -(-(-(-op.K // (32 // op.fmt.bits))) // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    auto = config.split_k_for(op.N, kwp, cfg, 132)
    more = {max(1, auto // 2), 2 * auto} if (cfg.group_rows or cfg.kind == "mma") else {1}
    return [replace(cfg, split_k=s) for s in sorted({auto} | more | set(splits or ()))]


def frag_candidates(op: QuantGemv, pdls=(False,), num_sms: int = 132) -> list[GemvConfig]:
    """Kind "frag" (M = 2..16, int4 groups of a multiple of 128): the table's row counts (64 rows of 2 warps,
    128 and 256 of 4; 256 is the LM head's) at the automatic split of K, half and twice it, with each setting in
    ``pdls``."""
    if not tuning.FRAG_MIN_M <= op.M <= 16 or op.fmt.bits != 4 or op.fmt.group_size % 128:
        return []
    out = []
    for bn, w in ((64, 2), (128, 4), (256, 4)):
        base = GemvConfig("frag", bn, 32, w)
        auto = config.frag_split(op.N, op.K, base, op.M, num_sms)
        for sk in sorted({max(1, auto // 2), auto, min(2 * auto, tuning.FRAG_MAX_SPLIT)}):
            out += [replace(base, split_k=sk, pdl=bool(p)) for p in pdls]
    return out


def split_for_shape(cfg: GemvConfig, M: int, N: int, K: int, bits: int) -> GemvConfig:
    """``cfg`` (a sweep winner of another shape) with the split of K its kind's rule gives ``(N, K)``."""
    if cfg.kind == "frag":
        return replace(cfg, split_k=config.frag_split(N, K, cfg, M, 132))
    kwp = -(-(-(-K // (32 // bits))) // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    return replace(cfg, split_k=config.split_k_for(N, kwp, cfg, 132))
