"""The per-tile math of the CuTe DSL attention kernel: score_mod, mask, online softmax, final normalisation.

Plain Python over CuTe DSL values, no ``if`` on run-time values (selects instead), so the same functions trace into
the Hopper kernel (``attn_fwd_sm90.py``) and into a host ``@cute.jit`` function that runs on the CPU -- the tests
check them there against numpy. Each works on one thread's view of a score tile as ``(rows, cols)``
(``s_mn[r, c]``) with the tile coordinates of every element (``coords[r, c] = (row, col)`` within the tile); the
rows a thread holds are also held by 3 other lanes (each with other columns), so row reductions end with
``reduce_max`` / ``reduce_sum`` across those lanes (``quad_max`` / ``quad_sum`` on the GPU; the identity on the
host, where one thread holds whole rows).

Scores live in log2 units: ``t = scale * q.k * log2(e)`` (``score_mod(scale * q.k) * log2(e)`` with a score_mod),
so ``p = exp2(t - m)`` and the LSE is ``(m + log2(l)) * ln(2)``; a negative scale needs no special case.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2_E = 1.4426950408889634     # 1 / ln 2: exp(x) = exp2(x * LOG2_E)
LN_2 = 0.6931471805599453       # ln 2: ln(x) = log2(x) * LN_2


def quad_max(x):
    """Max over the 4 lanes of a quad (lanes 4k .. 4k+3 hold the same rows of a wgmma accumulator)."""
    x = cutlass.max(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cutlass.max(x, cute.arch.shuffle_sync_bfly(x, offset=2))


def quad_sum(x):
    """Sum over the 4 lanes of a quad."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


class TileContext:
    """What the score_mod / mask_mod of one (batch, head) read besides the element's indices: ``score_fn(score,
    q_idx, kv_idx)`` and ``mask_fn(q_idx, kv_idx)`` lower the op's expressions (``expr_cute``) with ``b``, ``h``,
    ``seqlen_q`` and ``seqlen_k`` bound; either is None when the op has no such expression. Subtrees that read only
    those four (ALiBi's per-head slope, say) are evaluated here, once, where the context is made -- before the key
    loop -- and every element reuses them."""

    def __init__(self, score_mod, mask_mod, b, h, seqlen_q, seqlen_k):
        from ..expr_cute import CuteLowering, invariant_subtrees

        fixed = {"b": b, "h": h, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
        known: dict = {}
        for sub in invariant_subtrees(score_mod) + invariant_subtrees(mask_mod):
            if sub not in known:
                known[sub] = CuteLowering(fixed).emit(sub)

        def lowering(**kw):
            return CuteLowering({**fixed, **kw}, known)

        self.score_fn = None if score_mod is None else (
            lambda score, q_idx, kv_idx: lowering(score=score, q_idx=q_idx, kv_idx=kv_idx).flt(score_mod))
        self.mask_fn = None if mask_mod is None else (
            lambda q_idx, kv_idx: lowering(q_idx=q_idx, kv_idx=kv_idx).truth(mask_mod))


def same(x):
    """No cross-lane reduction (a thread that holds whole rows: the host tests)."""
    return x


def to_log2_units(s_mn, coords, row0, col0, scale, ctx):
    """``s_mn`` (raw q.k) in place -> ``scale * q.k * log2(e)``, through ``ctx.score_fn`` when the op has a
    score_mod (``score_fn(score, q_idx, kv_idx)`` -> the new score)."""
    for r in range(cute.size(s_mn, mode=[0])):
        for c in range(cute.size(s_mn, mode=[1])):
            if ctx.score_fn is None:
                s_mn[r, c] = s_mn[r, c] * (scale * LOG2_E)
            else:
                q_idx, kv_idx = row0 + Int32(coords[r, c][0]), col0 + Int32(coords[r, c][1])
                s_mn[r, c] = Float32(ctx.score_fn(s_mn[r, c] * scale, q_idx, kv_idx)) * LOG2_E


def mask(s_mn, coords, row0, col0, seqlen_k, ctx):
    """Hide (-inf) the elements of keys at or past ``seqlen_k`` and those ``ctx.mask_fn(q_idx, kv_idx)`` rejects."""
    for r in range(cute.size(s_mn, mode=[0])):
        for c in range(cute.size(s_mn, mode=[1])):
            q_idx, kv_idx = row0 + Int32(coords[r, c][0]), col0 + Int32(coords[r, c][1])
            hidden = kv_idx >= seqlen_k
            if ctx.mask_fn is not None:
                hidden = cutlass.or_(hidden, cutlass.not_(ctx.mask_fn(q_idx, kv_idx)))
            s_mn[r, c] = Float32(cutlass.select_(hidden, -Float32.inf, s_mn[r, c]))


def online_softmax(s_mn, row_max, row_sum, correction, reduce_max):
    """One key tile of the online softmax: per row, the new running max ``m`` (over this thread's columns, then
    ``reduce_max`` over the row's lanes), ``p = exp2(t - m)`` in place of ``t`` in ``s_mn``, the running sum
    ``l = l * exp2(m_old - m) + sum(p)`` (this thread's columns only: ``finish`` reduces it), and that factor
    ``exp2(m_old - m)`` in ``correction[r]``: O's row must be scaled by it (``rescale``) before this tile's P V is
    added. A row whose keys are all hidden so far keeps ``m = -inf`` and gets ``p = 0`` (its max is taken as 0 for
    the subtraction, so no ``-inf - -inf``)."""
    for r in range(cute.size(s_mn, mode=[0])):
        m_tile = s_mn[r, 0]
        for c in range(1, cute.size(s_mn, mode=[1])):
            m_tile = cutlass.max(m_tile, s_mn[r, c])
        m_new = cutlass.max(row_max[r], reduce_max(m_tile))
        m_safe = Float32(cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new))
        correction[r] = cute.math.exp2(row_max[r] - m_safe, fastmath=True)
        row_max[r] = m_new
        l_tile = Float32(0.0)
        for c in range(cute.size(s_mn, mode=[1])):
            p = cute.math.exp2(s_mn[r, c] - m_safe, fastmath=True)
            s_mn[r, c] = p
            l_tile = l_tile + p
        row_sum[r] = row_sum[r] * correction[r] + l_tile


def rescale(o_mn, correction):
    """O's rows times their ``correction`` (from ``online_softmax``)."""
    for r in range(cute.size(o_mn, mode=[0])):
        for c in range(cute.size(o_mn, mode=[1])):
            o_mn[r, c] = o_mn[r, c] * correction[r]


def finish(row_max, row_sum, inv_out, lse_out, reduce_sum):
    """Per row: ``l`` summed over the row's lanes, ``inv_out[r] = 1 / l`` and ``lse_out[r] = (m + log2(l)) ln 2``.
    A row whose max is -inf saw no visible key (or only -inf scores) and gets 0 and -inf: zeros, never NaN. A NaN
    or +inf score of a visible key made ``m`` or ``l`` NaN, which flows into the row's output and LSE as NaN."""
    for r in range(cute.size(row_sum)):
        l_row = reduce_sum(row_sum[r])
        no_key = row_max[r] == -Float32.inf
        l_safe = Float32(cutlass.select_(no_key, Float32(1.0), l_row))
        inv_out[r] = Float32(cutlass.select_(no_key, Float32(0.0), Float32(1.0) / l_safe))
        lse = (row_max[r] + cute.math.log2(l_safe, fastmath=True)) * LN_2
        lse_out[r] = Float32(cutlass.select_(no_key, -Float32.inf, lse))


__all__ = ["LN_2", "LOG2_E", "TileContext", "finish", "mask", "online_softmax", "quad_max", "quad_sum", "rescale",
           "same", "to_log2_units"]
