"""Attention forward: one online-softmax kernel for prefill, decode, paged and varlen KV.

A program owns a tile of BLOCK_M query rows of one (batch entry, query head block) and walks the
key tiles of its KV range (one split of it under split-KV). Rows of a tile are
``(query row, head)`` pairs: PACK = 1 gives BLOCK_M query rows of one head (prefill); PACK = G
packs the G query heads that share a KV head (decode), so each K/V tile is loaded once for all
of them. Launched by ``backends/triton/attention/forward.py``; the layouts and the meaning of every
argument are documented there.

``LAZY_RESCALE``: the online softmax keeps a stale row maximum until a tile raises it by more than
2^8 (FlashAttention-4's conditional rescaling), so the accumulator is multiplied only on those tiles.

Key tiles fall in three ranges: masked head, unmasked middle, masked tail. Only masked tiles
evaluate ``MASK_MOD`` and the key-length bound; tiles outside the recognised causal/window
bounds are never visited.

``TMA`` (dense prefill, PACK = 1): K and V tiles come through host-built tensor descriptors
(``K_DESC``/``V_DESC``, 4-D over (B, Sk, Hkv, D), block [1, BLOCK_N, 1, BLOCK_D]) instead of
pointer tiles; the tensor-memory accelerator fills rows past Sk and columns past D with zeros, so
masked tiles only need the score mask (V rows past a ``SEQLENS_K`` length are zeroed explicitly).

Under split-KV (NUM_SPLITS > 1) each program writes its normalised partial output and LSE to the
workspace; with FUSED_COMBINE the last split of a query tile to arrive (an int32 counter per tile,
incremented acq_rel after a CTA barrier) merges them in ``_merge_splits``, otherwise
``attention_combine.attn_combine`` does it in a second launch.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # 1 / ln 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)    # ln 2
NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
#: LAZY_RESCALE: the running maximum is only moved when a row's new maximum exceeds it by more than
#: this (log2 units), so probabilities stay below 2^8 and most tiles skip rescaling the accumulator
RESCALE_LOG2: tl.constexpr = tl.constexpr(8.0)

DENSE: tl.constexpr = tl.constexpr(0)
PAGED: tl.constexpr = tl.constexpr(1)
VARLEN: tl.constexpr = tl.constexpr(2)


@triton.jit
def _varlen_block(CU_Q, blk, batch, total_q, ROWS: tl.constexpr, BATCH_P2: tl.constexpr):
    """Map a flat block index to (sequence, block within it, first packed row, length).

    Sequence ``batch`` is virtual: the padding rows after ``cu_seqlens_q[batch]``, which see no keys.
    """
    i = tl.arange(0, BATCH_P2)
    start = tl.load(CU_Q + i, mask=i <= batch, other=0).to(tl.int32)
    end = tl.load(CU_Q + i + 1, mask=i < batch, other=0).to(tl.int32)
    end = tl.where(i == batch, total_q, end)
    nblk = tl.where(i <= batch, (end - start + ROWS - 1) // ROWS, 0)
    cum = tl.cumsum(nblk, 0)
    b = tl.sum((cum <= blk).to(tl.int32), 0)
    first = tl.sum(tl.where(i == b, cum - nblk, 0), 0)
    q_start = tl.sum(tl.where(i == b, start, 0), 0)
    sq = tl.sum(tl.where(i == b, end - start, 0), 0)
    return b, blk - first, q_start, sq


@triton.jit
def _page_ids(BLOCK_TABLE, bt_base, t, sk, stride_btp, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Physical page of each key of tile ``t`` (one scalar when a page holds whole tiles)."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(BLOCK_TABLE + bt_base + ((t * BLOCK_N) // PAGE_SIZE) * stride_btp, mask=t * BLOCK_N < sk,
                       other=0)
    else:
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        page = tl.load(BLOCK_TABLE + bt_base + (n // PAGE_SIZE) * stride_btp, mask=n < sk, other=0)
    return page.to(tl.int64)


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, t_begin, t_end,
                  K, V, K_DESC, V_DESC, BLOCK_TABLE, k_base, v_base, bt_base, kv_row0, kvh,
                  stride_kb, stride_ks, stride_vb, stride_vs, stride_btp,
                  scale, b, h, qrow, sq, sk,
                  SCORE_MOD: tl.constexpr, MASK_MOD: tl.constexpr, MASKED: tl.constexpr,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, LAYOUT: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  HAS_MASK: tl.constexpr, HAS_SCORE_MOD: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PREC: tl.constexpr, LAZY_RESCALE: tl.constexpr, TMA: tl.constexpr,
                  RAW_MAX: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if LAYOUT == PAGED:
        page = _page_ids(BLOCK_TABLE, bt_base, t_begin, sk, stride_btp, BLOCK_N, PAGE_SIZE)
    for t in tl.range(t_begin, t_end):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        # -- locate the keys of this tile; the next tile's page ids are fetched while this one runs
        if TMA:
            pass  # the descriptors address tile t themselves
        elif LAYOUT == PAGED:
            cur = page
            page = _page_ids(BLOCK_TABLE, bt_base, t + 1, sk, stride_btp, BLOCK_N, PAGE_SIZE)
            k_rows = k_base + cur * stride_kb + (n % PAGE_SIZE) * stride_ks
            v_rows = v_base + cur * stride_vb + (n % PAGE_SIZE) * stride_vs
        else:
            pos = (kv_row0 + n).to(tl.int64)
            k_rows = k_base + pos * stride_ks
            v_rows = v_base + pos * stride_vs
        # -- compute qk
        if TMA:
            # rows past the tensor's Sk and columns past D arrive as zeros
            kt = tl.trans(K_DESC.load([b, t * BLOCK_N, kvh, 0]).reshape(BLOCK_N, BLOCK_D))
        elif MASKED:
            kt = tl.load(K + k_rows[None, :] + offs_d[:, None], mask=(n < sk)[None, :] & (offs_d < D)[:, None],
                         other=0.0)
        elif BLOCK_D == D:
            kt = tl.load(K + k_rows[None, :] + offs_d[:, None])
        else:
            kt = tl.load(K + k_rows[None, :] + offs_d[:, None], mask=(offs_d < D)[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=DOT_PREC)
        # s in base-2 units up to the factor c: a positive scale keeps the order of the raw scores, so
        # RAW_MAX leaves them raw (c = scale * log2 e, applied to the row maximum once per row and to each
        # score inside the exponent's FFMA); otherwise s is fully scaled (c = 1)
        if HAS_SCORE_MOD:
            s = SCORE_MOD(qk * scale, b, h[:, None], qrow[:, None], n[None, :], sq, sk) * LOG2E
        elif RAW_MAX:
            s = qk
        else:
            s = qk * (scale * LOG2E)
        if RAW_MAX:
            c = scale * LOG2E
        else:
            c = 1.0
        if MASKED:
            keep = (n < sk)[None, :]
            if HAS_MASK:
                keep = keep & MASK_MOD(b, h[:, None], qrow[:, None], n[None, :], sq, sk)
            s = tl.where(keep, s, NEG_INF)
        # -- update m_i and l_i (base-2 online softmax; rows with nothing visible yet stay at 0)
        if LAZY_RESCALE:
            # rescale acc and l only when some row's maximum grew by more than 2^RESCALE_LOG2;
            # otherwise keep the stale maximum (p <= 2^RESCALE_LOG2, exact in fp32/bf16/fp16 range)
            m_blk = tl.max(s, 1)
            grow = tl.where(m_blk > m_i, m_blk - m_i, 0.0)   # +inf for a row's first visible key
            if tl.max(grow, 0) > RESCALE_LOG2:
                m_new = tl.maximum(m_i, m_blk)
                alpha = tl.math.exp2(m_i - tl.where(m_new == NEG_INF, 0.0, m_new))
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.math.exp2(s - tl.where(m_i == NEG_INF, 0.0, m_i)[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * c)
            m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s * c - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
        # -- accumulate P V
        if TMA:
            v = V_DESC.load([b, t * BLOCK_N, kvh, 0]).reshape(BLOCK_N, BLOCK_DV)
            if MASKED:  # rows past a seqlens_k length lie inside the tensor: p is 0 there, v may not be
                v = tl.where((n < sk)[:, None], v, 0.0)
        elif MASKED:
            v = tl.load(V + v_rows[:, None] + offs_dv[None, :], mask=(n < sk)[:, None] & (offs_dv < DV)[None, :],
                        other=0.0)
        elif BLOCK_DV == DV:
            v = tl.load(V + v_rows[:, None] + offs_dv[None, :])
        else:
            v = tl.load(V + v_rows[:, None] + offs_dv[None, :], mask=(offs_dv < DV)[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if not LAZY_RESCALE:
            acc = acc * alpha[:, None]
            m_i = m_new
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
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
    LAZY_RESCALE: tl.constexpr, TMA: tl.constexpr, RAW_MAX: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_M // PACK          # query rows per tile
    if PDL:
        # launched as a programmatic dependent of the previous kernel: wait for it (its writes, e.g. a
        # KV-cache append, are visible after this) before the first read, then let the next kernel
        # (attn_combine, or whatever follows) launch; it waits for this grid's completion itself
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    HB: tl.constexpr = HQ // PACK                 # head blocks per batch entry
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = pid_m % NUM_SPLITS
    blk = pid_m // NUM_SPLITS

    # -- which sequence, which rows
    if LAYOUT == VARLEN:
        hb = pid_h
        b, blk, q_start, sq = _varlen_block(CU_Q, blk, batch, seqlen_q, ROWS, BATCH_P2)
        if b > batch:
            return
        kv_row0 = tl.load(CU_K + b, mask=b < batch, other=0).to(tl.int32)
        sk = tl.load(CU_K + b + 1, mask=b < batch, other=0).to(tl.int32) - kv_row0
        q_base = q_start.to(tl.int64) * stride_qs
        o_base = q_start.to(tl.int64) * stride_os
        l_base = q_start.to(tl.int64) * stride_ls
        k_base = tl.zeros([], tl.int64)
        v_base = tl.zeros([], tl.int64)
        grow0 = q_start
    else:
        b = pid_h // HB
        hb = pid_h % HB
        sq = seqlen_q
        blk = tl.cdiv(sq, ROWS) - 1 - blk         # longest (most keys) tiles first
        if HAS_SEQLENS:
            sk = tl.load(SEQLENS_K + b).to(tl.int32)
        else:
            sk = seqlen_k
        kv_row0 = 0
        q_base = b.to(tl.int64) * stride_qb
        o_base = b.to(tl.int64) * stride_ob
        l_base = b.to(tl.int64) * stride_lb
        if LAYOUT == PAGED:
            k_base = tl.zeros([], tl.int64)
            v_base = tl.zeros([], tl.int64)
        else:
            k_base = b.to(tl.int64) * stride_kb
            v_base = b.to(tl.int64) * stride_vb
        grow0 = b * seqlen_q
    bt_base = b.to(tl.int64) * stride_btb
    kvh = (hb * PACK) // GROUP
    k_base += kvh.to(tl.int64) * stride_kh
    v_base += kvh.to(tl.int64) * stride_vh

    r = tl.arange(0, BLOCK_M)
    qrow = blk * ROWS + r // PACK
    h = hb * PACK + r % PACK
    row_ok = (qrow < sq) & (r < ROWS * PACK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    # -- load q: it stays in registers for the whole walk
    q_rows = q_base + qrow.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # -- key range of this tile: [lo, hi) may be visible, [full_lo, full_hi) is visible to every row
    q0 = blk * ROWS
    q1 = tl.minimum(q0 + ROWS, sq) - 1
    off = sk - sq
    lo = 0
    hi = sk
    full_lo = 0
    full_hi = sk
    if HAS_LEFT:
        lo = tl.maximum(q0 + off - WIN_LEFT, 0)
        full_lo = tl.maximum(q1 + off - WIN_LEFT, 0)
    if HAS_RIGHT:
        hi = tl.minimum(q1 + off + WIN_RIGHT + 1, sk)
        full_hi = tl.minimum(q0 + off + WIN_RIGHT + 1, sk)
    if NEVER:
        hi = lo
    hi = tl.maximum(hi, lo)
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)
    t_flo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_lo), t_hi)
    t_fhi = tl.maximum(tl.minimum(full_hi // BLOCK_N, t_hi), t_flo)
    if NUM_SPLITS > 1:
        # split the visible tiles evenly (floor / ceil shares, adapting to each sequence's own length):
        # every split has work while the tiles are at least NUM_SPLITS, so the grid stays full
        n_t = t_hi - t_lo
        s_lo = t_lo + (split * n_t) // NUM_SPLITS
        s_hi = t_lo + ((split + 1) * n_t) // NUM_SPLITS
        t_lo = tl.maximum(t_lo, s_lo)
        t_flo = tl.minimum(tl.maximum(t_flo, s_lo), s_hi)
        t_fhi = tl.minimum(tl.maximum(t_fhi, s_lo), s_hi)
        t_hi = tl.minimum(t_hi, s_hi)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_INF
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if MASK_ALL:
        # one loop over every visible tile with the mask on each: a mask with terms the kernel cannot
        # reason about (MASK_ALL implies HAS_MASK)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, t_lo, t_hi, K, V, K_DESC, V_DESC, BLOCK_TABLE, k_base,
                                      v_base, bt_base, kv_row0, kvh, stride_kb, stride_ks, stride_vb, stride_vs,
                                      stride_btp, scale, b, h, qrow, sq, sk, SCORE_MOD, MASK_MOD, HAS_MASK,
                                      D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, LAYOUT, PAGE_SIZE,
                                      HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, LAZY_RESCALE, TMA, RAW_MAX)
    else:
        if HAS_LEFT:
            # stage 1: masked tiles before the fully visible band (sliding window's left edge)
            acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, t_lo, t_flo, K, V, K_DESC, V_DESC, BLOCK_TABLE, k_base,
                                          v_base, bt_base, kv_row0, kvh, stride_kb, stride_ks, stride_vb, stride_vs,
                                          stride_btp, scale, b, h, qrow, sq, sk, SCORE_MOD, MASK_MOD, True,
                                          D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, LAYOUT, PAGE_SIZE,
                                          HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, LAZY_RESCALE, TMA, RAW_MAX)
        # stage 2: the fully visible band, no mask
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, t_flo, t_fhi, K, V, K_DESC, V_DESC, BLOCK_TABLE, k_base,
                                      v_base, bt_base, kv_row0, kvh, stride_kb, stride_ks, stride_vb, stride_vs,
                                      stride_btp, scale, b, h, qrow, sq, sk, SCORE_MOD, MASK_MOD, False,
                                      D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, LAYOUT, PAGE_SIZE,
                                      HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, LAZY_RESCALE, TMA, RAW_MAX)
        # stage 3: masked tiles after it (causal diagonal, window's right edge, key-length tail)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, t_fhi, t_hi, K, V, K_DESC, V_DESC, BLOCK_TABLE, k_base,
                                      v_base, bt_base, kv_row0, kvh, stride_kb, stride_ks, stride_vb, stride_vs,
                                      stride_btp, scale, b, h, qrow, sq, sk, SCORE_MOD, MASK_MOD, True,
                                      D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, LAYOUT, PAGE_SIZE,
                                      HAS_MASK, HAS_SCORE_MOD, UPCAST, DOT_PREC, LAZY_RESCALE, TMA, RAW_MAX)

    # -- epilogue: normalise; rows that saw no key get 0 and lse = -inf. A NaN sum (a NaN or +inf
    # score, docs/ir.md "Non-finite values") is not 0, so its row is normalised by it and stays NaN
    seen = l_i != 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * LN2, NEG_INF)
    dv_ok = (offs_dv < DV)[None, :]
    if NUM_SPLITS == 1:
        o_rows = o_base + qrow.to(tl.int64) * stride_os + h.to(tl.int64) * stride_oh
        tl.store(O + o_rows[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None] & dv_ok)
        if RETURN_LSE:
            tl.store(LSE + l_base + h.to(tl.int64) * stride_lh + qrow.to(tl.int64) * stride_ls, lse, mask=row_ok)
    else:
        ws_rows = (split * total_rows + grow0 + qrow).to(tl.int64) * HQ + h
        tl.store(WS_O + ws_rows[:, None] * DV + offs_dv[None, :], out, mask=row_ok[:, None] & dv_ok)
        tl.store(WS_LSE + ws_rows, lse, mask=row_ok)
        if FUSED_COMBINE:
            # the last split of this tile to finish merges all of them (no second launch)
            tl.debug_barrier()
            group = pid_h * (tl.num_programs(0) // NUM_SPLITS) + pid_m // NUM_SPLITS
            done = tl.atomic_add(LOCKS + group, 1, sem="acq_rel", scope="gpu")
            if done == NUM_SPLITS - 1:
                tl.store(LOCKS + group, 0)  # ready for the next launch
                _merge_splits(WS_O, WS_LSE, O, LSE, o_base, l_base, grow0, qrow, h, row_ok, total_rows,
                              stride_os, stride_oh, stride_ls, stride_lh,
                              HQ, DV, BLOCK_M, BLOCK_DV, NUM_SPLITS, RETURN_LSE)


@triton.jit
def _merge_splits(WS_O, WS_LSE, O, LSE, o_base, l_base, grow0, qrow, h, row_ok, total_rows,
                  stride_os, stride_oh, stride_ls, stride_lh,
                  HQ: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, RETURN_LSE: tl.constexpr):
    """out = sum_s exp(lse_s - lse) O_s with lse = log sum_s exp(lse_s), over the split partials.

    Every load is independent of the others (unrolled over the splits), so they are all in flight at
    once: the merge costs about one L2 round trip, not NUM_SPLITS of them. Each split's LSEs are
    loaded in the rows' own layout, so the maximum and the weights are element-wise: no reduction
    crosses the warps. (A 2-D load of all LSEs reduces over the splits once per split -- 89 CTA
    barriers in the merge's SASS -- and cost the fused merge 3-6 us: docs/design/attention-decode.md.)
    """
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = row_ok[:, None] & (offs_dv < DV)[None, :]
    # -- the rows' largest LSE over the splits (.cg: the other programs' partials from L2, never L1)
    m = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_INF
    for s in tl.static_range(NUM_SPLITS):
        rows = (s * total_rows + grow0 + qrow).to(tl.int64) * HQ + h
        m = tl.maximum(m, tl.load(WS_LSE + rows, mask=row_ok, other=NEG_INF, cache_modifier=".cg"))
    m_use = tl.where(m == NEG_INF, 0.0, m)
    # -- weighted sum of the partial outputs
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        rows = (s * total_rows + grow0 + qrow).to(tl.int64) * HQ + h
        w_s = tl.math.exp2((tl.load(WS_LSE + rows, mask=row_ok, other=NEG_INF, cache_modifier=".cg") - m_use)
                           * LOG2E)
        o_s = tl.load(WS_O + rows[:, None] * DV + offs_dv[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        den += w_s
        acc += w_s[:, None] * o_s
    seen = den != 0.0   # a NaN split poisons the sum, and so the row (never 0 / -inf)
    den_safe = tl.where(seen, den, 1.0)
    out = acc / den_safe[:, None]
    o_rows = o_base + qrow.to(tl.int64) * stride_os + h.to(tl.int64) * stride_oh
    tl.store(O + o_rows[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty), mask=mask)
    if RETURN_LSE:
        lse = tl.where(seen, m_use + tl.log(den_safe), NEG_INF)
        tl.store(LSE + l_base + h.to(tl.int64) * stride_lh + qrow.to(tl.int64) * stride_ls, lse, mask=row_ok)
