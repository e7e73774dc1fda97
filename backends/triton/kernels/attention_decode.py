"""Packed decode attention with a key range per warp (``AttnConfig.warp_split``).

``attention_fwd.attn_fwd`` gives each program one online softmax over tiles of ``BLOCK_N`` keys: with a
decode tile of <= 16 packed (query row, head) rows, its four warps share every tile, so each tile's row
maximum, row sum and ``P`` cross the warps through shared memory behind CTA barriers, and one warp per
scheduler waits on that chain (H200, session 9: issue slots 17% busy at 75% of DRAM bandwidth).

Here each of the ``WARPS`` warps keeps its own online softmax over its own ``BLOCK_N / WARPS`` keys of
every tile: the tile is a batch of ``WARPS`` independent ``(BLOCK_M x D) @ (D x BLOCK_N / WARPS)``
products (``tl.dot`` on rank-3 operands places the batch across the warps), so the softmax never leaves
a warp and ``P`` feeds the second product from registers. The warps' states merge once, after the walk.

Same arguments, grid, workspace and split rule as ``attn_fwd`` (so one host path launches either; the
arguments this kernel does not serve -- varlen keys, TMA descriptors, the fused merge's counters --
are accepted and ignored, and the host never selects it for them: ``tuning.warp_split_blocker``).
"""

import triton
import triton.language as tl

from . import load

_fwd = load("attention_fwd")
_tile_range = _fwd._tile_range
_store_rows = _fwd._store_rows

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
PAGED: tl.constexpr = tl.constexpr(1)


@triton.jit
def _warp_pages(BLOCK_TABLE, bt_base, t, sk, stride_btp, WARPS: tl.constexpr, BNW: tl.constexpr,
                PAGE_SIZE: tl.constexpr):
    """Physical page of each key of tile ``t``, shape ``[WARPS, 1]`` when a page holds whole warp
    slices, else ``[WARPS, BNW]``."""
    w = tl.arange(0, WARPS)
    if PAGE_SIZE % BNW == 0:
        n0 = t * (WARPS * BNW) + w * BNW
        page = tl.load(BLOCK_TABLE + bt_base + (n0 // PAGE_SIZE) * stride_btp, mask=n0 < sk, other=0)[:, None]
    else:
        n = t * (WARPS * BNW) + w[:, None] * BNW + tl.arange(0, BNW)[None, :]
        page = tl.load(BLOCK_TABLE + bt_base + (n // PAGE_SIZE) * stride_btp, mask=n < sk, other=0)
    return page.to(tl.int64)


@triton.jit
def _warp_tiles(acc, l_i, m_i, q3, t_begin, t_end, K, V, BLOCK_TABLE, k_base, v_base, bt_base,
                stride_kb, stride_ks, stride_vb, stride_vs, stride_btp, scale, b, h3, qrow3, sq, sk,
                SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, MASKED: tl.constexpr,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                WARPS: tl.constexpr, BNW: tl.constexpr, LAYOUT: tl.constexpr, PAGE_SIZE: tl.constexpr,
                HAS_MASK: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, UPCAST: tl.constexpr,
                DOT_PREC: tl.constexpr, RAW_MAX: tl.constexpr):
    """Walk key tiles ``[t_begin, t_end)``; warp ``w`` takes keys ``[w * BNW, (w + 1) * BNW)`` of each.
    ``acc``: ``[WARPS, BLOCK_M, BLOCK_DV]``; ``l_i``, ``m_i``: ``[WARPS, BLOCK_M]`` (one state per warp)."""
    w = tl.arange(0, WARPS)
    j = tl.arange(0, BNW)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if LAYOUT == PAGED:
        page = _warp_pages(BLOCK_TABLE, bt_base, t_begin, sk, stride_btp, WARPS, BNW, PAGE_SIZE)
    for t in tl.range(t_begin, t_end):
        n = t * (WARPS * BNW) + w[:, None] * BNW + j[None, :]                  # [WARPS, BNW] key index
        # -- locate this tile's keys; the next tile's page ids are fetched while this one runs
        if LAYOUT == PAGED:
            cur = page
            page = _warp_pages(BLOCK_TABLE, bt_base, t + 1, sk, stride_btp, WARPS, BNW, PAGE_SIZE)
            k_rows = k_base + cur * stride_kb + (n % PAGE_SIZE) * stride_ks
            v_rows = v_base + cur * stride_vb + (n % PAGE_SIZE) * stride_vs
        else:
            k_rows = k_base + n.to(tl.int64) * stride_ks
            v_rows = v_base + n.to(tl.int64) * stride_vs
        # -- scores of each warp's keys: [WARPS, BLOCK_M, BNW]
        kmask = (offs_d < D)[None, :, None]
        if MASKED:
            kmask = kmask & (n < sk)[:, None, :]
        if MASKED or BLOCK_D != D:
            kt = tl.load(K + k_rows[:, None, :] + offs_d[None, :, None], mask=kmask, other=0.0)
        else:
            kt = tl.load(K + k_rows[:, None, :] + offs_d[None, :, None])
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q3, kt, input_precision=DOT_PREC)
        # base-2 units up to the factor c, as in attn_fwd (RAW_MAX: raw scores, c applied per row)
        if HAS_SCORE_MOD:
            s = SCORE_MOD(qk * scale, b, h3, qrow3, n[:, None, :], sq, sk) * LOG2E
        elif RAW_MAX:
            s = qk
        else:
            s = qk * (scale * LOG2E)
        if RAW_MAX:
            c = scale * LOG2E
        else:
            c = 1.0
        if MASKED:
            keep = (n < sk)[:, None, :]
            if HAS_MASK:
                keep = keep & MASK_MOD(b, h3, qrow3, n[:, None, :], sq, sk)
            s = tl.where(keep, s, NEG_INF)
        # -- online softmax, within each warp (rows that saw nothing yet stay at 0)
        m_new = tl.maximum(m_i, tl.max(s, 2) * c)
        m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s * c - m_use[:, :, None])
        l_i = l_i * alpha + tl.sum(p, 2)
        # -- accumulate P V: [WARPS, BLOCK_M, BNW] @ [WARPS, BNW, BLOCK_DV]
        vmask = (offs_dv < DV)[None, None, :]
        if MASKED:
            vmask = vmask & (n < sk)[:, :, None]
        if MASKED or BLOCK_DV != DV:
            v = tl.load(V + v_rows[:, :, None] + offs_dv[None, None, :], mask=vmask, other=0.0)
        else:
            v = tl.load(V + v_rows[:, :, None] + offs_dv[None, None, :])
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, :, None]
        m_i = m_new
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def attn_decode(
    Q, K, V, O, LSE, WS_O, WS_LSE, LOCKS, BLOCK_TABLE, SEQLENS_K, CU_Q, CU_K, K_DESC, V_DESC,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_btb, stride_btp,
    batch, seqlen_q, seqlen_k, total_rows, scale,
    SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr,
    HQ: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LAYOUT: tl.constexpr, HAS_SEQLENS: tl.constexpr, PAGE_SIZE: tl.constexpr, BATCH_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FUSED_COMBINE: tl.constexpr,
    HAS_LEFT: tl.constexpr, WIN_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, WIN_RIGHT: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_ALL: tl.constexpr, NEVER: tl.constexpr, HAS_SCORE_MOD: tl.constexpr,
    RETURN_LSE: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
    LAZY_RESCALE: tl.constexpr, TMA: tl.constexpr, RAW_MAX: tl.constexpr, WARPS: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_M // PACK          # query rows per tile
    BNW: tl.constexpr = BLOCK_N // WARPS          # keys per warp and tile
    if PDL:
        # a programmatic dependent of the previous kernel: wait for its writes, then let the merge launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    HB: tl.constexpr = HQ // PACK
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = pid_m % NUM_SPLITS
    blk = pid_m // NUM_SPLITS

    # -- which sequence, which rows (dense or paged keys)
    b = pid_h // HB
    hb = pid_h % HB
    sq = seqlen_q
    blk = tl.cdiv(sq, ROWS) - 1 - blk
    if HAS_SEQLENS:
        sk = tl.load(SEQLENS_K + b).to(tl.int32)
    else:
        sk = seqlen_k
    kvh = (hb * PACK) // GROUP
    if LAYOUT == PAGED:
        k_base = kvh.to(tl.int64) * stride_kh
        v_base = kvh.to(tl.int64) * stride_vh
    else:
        k_base = b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    bt_base = b.to(tl.int64) * stride_btb

    r = tl.arange(0, BLOCK_M)
    qrow = blk * ROWS + r // PACK
    h = hb * PACK + r % PACK
    row_ok = (qrow < sq) & (r < ROWS * PACK)
    offs_d = tl.arange(0, BLOCK_D)

    # -- q, once per warp: [WARPS, BLOCK_M, BLOCK_D], in registers for the whole walk
    q_rows = b.to(tl.int64) * stride_qb + qrow.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q3 = tl.broadcast_to(q[None, :, :], (WARPS, BLOCK_M, BLOCK_D))
    h3 = h[None, :, None]
    qrow3 = qrow[None, :, None]

    t_lo, t_flo, t_fhi, t_hi = _tile_range(blk * ROWS, sq, sk, split, HAS_LEFT, WIN_LEFT, HAS_RIGHT, WIN_RIGHT,
                                           NEVER, ROWS, BLOCK_N, NUM_SPLITS)
    if MASK_ALL:
        t_flo = t_lo
        t_fhi = t_lo

    m_i = tl.zeros([WARPS, BLOCK_M], dtype=tl.float32) + NEG_INF
    l_i = tl.zeros([WARPS, BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([WARPS, BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # -- masked head (window's left edge), unmasked band, masked tail (diagonal, window, key length)
    acc, l_i, m_i = _warp_tiles(acc, l_i, m_i, q3, t_lo, t_flo, K, V, BLOCK_TABLE, k_base, v_base, bt_base,
                                stride_kb, stride_ks, stride_vb, stride_vs, stride_btp, scale, b, h3, qrow3, sq, sk,
                                SCORE_MOD, MASK_MOD, True, D, DV, BLOCK_D, BLOCK_DV, WARPS, BNW, LAYOUT, PAGE_SIZE,
                                HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, RAW_MAX)
    acc, l_i, m_i = _warp_tiles(acc, l_i, m_i, q3, t_flo, t_fhi, K, V, BLOCK_TABLE, k_base, v_base, bt_base,
                                stride_kb, stride_ks, stride_vb, stride_vs, stride_btp, scale, b, h3, qrow3, sq, sk,
                                SCORE_MOD, MASK_MOD, False, D, DV, BLOCK_D, BLOCK_DV, WARPS, BNW, LAYOUT, PAGE_SIZE,
                                HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, RAW_MAX)
    acc, l_i, m_i = _warp_tiles(acc, l_i, m_i, q3, t_fhi, t_hi, K, V, BLOCK_TABLE, k_base, v_base, bt_base,
                                stride_kb, stride_ks, stride_vb, stride_vs, stride_btp, scale, b, h3, qrow3, sq, sk,
                                SCORE_MOD, MASK_MOD, True, D, DV, BLOCK_D, BLOCK_DV, WARPS, BNW, LAYOUT, PAGE_SIZE,
                                HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, RAW_MAX)

    # -- merge the warps' states (one cross-warp exchange per program)
    m = tl.max(m_i, 0)
    m_use = tl.where(m == NEG_INF, 0.0, m)
    wgt = tl.math.exp2(m_i - m_use[None, :])          # 0 for a warp that saw nothing
    l_all = tl.sum(l_i * wgt, 0)
    acc_all = tl.sum(acc * wgt[:, :, None], 0)
    _store_rows(acc_all, l_all, m, O, LSE, WS_O, WS_LSE, b.to(tl.int64) * stride_ob, b.to(tl.int64) * stride_lb,
                b * seqlen_q, qrow, h, row_ok, split, total_rows, stride_os, stride_oh, stride_ls, stride_lh,
                HQ, DV, BLOCK_DV, NUM_SPLITS, RETURN_LSE)
