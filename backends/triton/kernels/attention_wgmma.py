"""Dense prefill attention for sm_90 (Gluon): a TMA producer warp and two consumer warpgroups.

The ``@triton.jit`` kernel (``attention_fwd.py``) runs each warpgroup's softmax and its wgmma in
sequence, and Triton 3.6 keeps the two warpgroups of a program in step; its tensor pipe is ~47%
busy at D=128 (``ncu-h200.txt``, ``docs/design/attention-prefill.md``). This kernel is written in Gluon so the
schedule is ours:

* one program = ``2 * QR`` query rows of one (batch, query head); partition 0 (the default, 4
  warps) and partition 1 (4 warps) each own ``QR = 64`` rows, partition 2 (one warp) issues every
  TMA load: the two query halves once, then K and V tiles through two rings, ``KSTAGES`` K buffers
  and ``STAGES`` V buffers (``k_ready``/``v_ready`` per stage; ``k_empty`` released by both consumers
  once their scores of the tile are done, ``v_empty`` once their ``P V`` is), K one tile ahead of V;
* the consumers share nothing but the ring, so they drift apart and one's softmax runs while the
  other's wgmma uses the tensor cores;
* ``PINGPONG`` (off: measured mixed, -8% to +10% on the H200, ``attention-wgmma-pingpong-h200.json``) makes the consumers take turns
  issuing their MMAs through two mbarriers, FA3's inter-warpgroup schedule;
* within a consumer, tile t's scores ``q k_t^T`` and tile t-1's ``P v_{t-1}`` are both in flight,
  and the softmax of tile t waits only for its scores while ``P v_{t-1}`` runs (FA3's
  intra-warpgroup overlap): issue S_t, issue PV_{t-1}, wait S_t, softmax(S_t), wait PV_{t-1}, rescale.

Row maximum on the raw scores (positive ``scale``): ``p = exp2(s * c - m * c)`` with
``c = scale * log2(e)``. Causal is bottom-right aligned (key n visible to row r iff
``n <= r + seqlen_k - seqlen_q``); the host admits it only for ``seqlen_k >= seqlen_q``, so every
program sees at least one key. Keys past ``seqlen_k`` in the last tile are masked to -inf (the 3-D
descriptors zero-fill past each batch's end, so no tile reads the next batch's rows).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from . import load

tma_load = load("gluon_compat").tma_load

NEG_INF = gl.constexpr(float("-inf"))
LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)

@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                    b, q_col, kv_col, m0, n_tiles, QR: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                    KSTAGES: gl.constexpr):
    """Producer: the program's two query halves, then K and V of every tile through their rings, K one
    tile ahead of V (a consumer needs ``K_t`` a tile before ``V_t``)."""
    # -- phase 1: queries (one barrier for both halves), then the first key tile
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma_load(q_desc, (b, m0, q_col), q_bar, q_smem.index(0))
    tma_load(q_desc, (b, m0 + QR, q_col), q_bar, q_smem.index(1))
    mbarrier.expect(k_ready.index(0), k_desc.block_type.nbytes)
    tma_load(k_desc, (b, 0, kv_col), k_ready.index(0), k_smem.index(0))
    # -- phase 2: K_{t+1}, then V_t; a stage is refilled once both consumers released it
    for t in range(n_tiles):
        if t + 1 < n_tiles:
            ks = (t + 1) % KSTAGES
            mbarrier.wait(k_empty.index(ks), (((t + 1) // KSTAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
            tma_load(k_desc, (b, (t + 1) * BN, kv_col), k_ready.index(ks), k_smem.index(ks))
        vs = t % STAGES
        mbarrier.wait(v_empty.index(vs), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
        tma_load(v_desc, (b, t * BN, kv_col), v_ready.index(vs), v_smem.index(vs))


@gluon.jit
def _masked(s, t, r0, sk, delta, QR: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
            s_layout: gl.constexpr):
    """Scores of tile ``t`` with invisible keys at -inf (past ``sk``; above the causal diagonal)."""
    cols = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    ok = (cols < sk)[None, :]
    if CAUSAL:
        rows = r0 + gl.arange(0, QR, layout=gl.SliceLayout(1, s_layout))
        ok = ok & (cols[None, :] <= (rows + delta)[:, None])
    return gl.where(ok, s, NEG_INF)


@gluon.jit
def _softmax_step(s, m_i, l_i, c):
    """Online-softmax update for one tile of raw scores: ``(p, m_new, l_new, alpha)``."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == NEG_INF, 0.0, m_new)        # a row with no visible key yet
    mc = m_use * c
    p = gl.exp2(s * c - mc[:, None])
    alpha = gl.exp2(m_i * c - mc)                            # 0 on a row's first visible tile
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def _take_turn(turn, half, event, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other consumer has issued its MMAs of the previous event, so the two
    warpgroups' MMAs alternate on the tensor cores and each one's softmax runs under the other's."""
    if PINGPONG:
        mbarrier.wait(turn.index(half), event & 1)


@gluon.jit
def _pass_turn(turn, half, PINGPONG: gl.constexpr):
    """Ping-pong: let the other consumer issue its next MMAs."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - half))


@gluon.jit
def _consumer(half: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE,
              so_b, so_s, so_h, sl_b, sl_h, sl_s, b, h, m0, sq, sk, n_tiles, scale,
              QR: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
              STAGES: gl.constexpr, KSTAGES: gl.constexpr, CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr,
              PINGPONG: gl.constexpr):
    """Consumer warpgroup ``half`` (0: the default partition) and its ``QR`` rows: the key walk with
    scores one tile ahead of ``P V``, then the store."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    c = scale * LOG2E
    r0 = m0 + half * QR
    delta = sk - sq
    # tiles that need a mask: the last partial one, and (causal) those crossing this half's diagonal
    n_free = sk // BN
    if CAUSAL:
        n_free = gl.minimum(n_free, (r0 + delta + 1) // BN)

    # -- prologue: scores and softmax of tile 0
    q = q_smem.index(half).reshape([QR, D])
    zero_s = gl.zeros([QR, BN], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turn, half, 0, PINGPONG)
    s_tok = warpgroup_mma(q, k_smem.index(0).reshape([BN, D]).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _pass_turn(turn, half, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(0))                        # K_0 read: its stage may refill
    if n_free < 1:
        s = _masked(s, 0, r0, sk, delta, QR, BN, CAUSAL, s_layout)
    m_i = gl.full([QR], NEG_INF, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([QR], gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    acc = gl.zeros([QR, DV], gl.float32, o_layout)

    # -- main loop: S_t and PV_{t-1} in flight together; softmax of S_t under PV_{t-1}
    for t in range(1, n_tiles):
        st = t % KSTAGES
        pt = (t - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (t // KSTAGES) & 1)
        mbarrier.wait(v_ready.index(pt), ((t - 1) // STAGES) & 1)
        _take_turn(turn, half, t, PINGPONG)
        s_tok = warpgroup_mma(q, k_smem.index(st).reshape([BN, D]).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(pt).reshape([BN, DV]), acc, is_async=True)
        _pass_turn(turn, half, PINGPONG)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(st))                   # S_t done: K_t's stage may refill
        if t >= n_free:
            s = _masked(s, t, r0, sk, delta, QR, BN, CAUSAL, s_layout)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(pt))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)

    # -- the last tile's P V
    lt = n_tiles - 1
    mbarrier.wait(v_ready.index(lt % STAGES), (lt // STAGES) & 1)
    _take_turn(turn, half, n_tiles, PINGPONG)
    acc = warpgroup_mma(p_op, v_smem.index(lt % STAGES).reshape([BN, DV]), acc, is_async=True)
    _pass_turn(turn, half, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(lt % STAGES))

    # -- epilogue: normalise, store the rows inside seqlen_q
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / l_o[:, None]
    rows = r0 + gl.arange(0, QR, layout=row_o)
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    base = O + b.to(gl.int64) * so_b + h.to(gl.int64) * so_h
    ptrs = base + rows.to(gl.int64)[:, None] * so_s + cols[None, :]
    gl.store(ptrs, out.to(O.dtype.element_ty), mask=(rows < sq)[:, None])
    if RETURN_LSE:
        lse_rows = r0 + gl.arange(0, QR, layout=gl.SliceLayout(1, s_layout))
        lse = (m_i * c + gl.log2(l_i)) * LN2
        lbase = LSE + b.to(gl.int64) * sl_b + h.to(gl.int64) * sl_h
        gl.store(lbase + lse_rows.to(gl.int64) * sl_s, lse, mask=lse_rows < sq)


@gluon.jit
def attn_fwd_wgmma(q_desc, k_desc, v_desc, O, LSE,
                   so_b, so_s, so_h, sl_b, sl_h, sl_s,
                   HQ, GROUP, sq, sk, scale,
                   QR: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                   STAGES: gl.constexpr, KSTAGES: gl.constexpr, CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr):
    """Grid ``(cdiv(sq, 2 QR), B * HQ)``; ``q_desc`` is 3-D over ``(B, Sq, HQ * D)`` with block
    ``(1, QR, D)``, ``k_desc``/``v_desc`` over ``(B, Sk, HKV * D)`` with block ``(1, BN, D)``;
    ``O`` is ``(B, Sq, HQ, DV)`` (strides ``so_*``, last 1), ``LSE`` ``(B, HQ, Sq)`` when returned."""
    # -- which rows: the heaviest causal programs (last query rows) start first
    n_m = gl.num_programs(0)
    m0 = (n_m - 1 - gl.program_id(0)) * (2 * QR)
    bh = gl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    n_tiles = gl.cdiv(sk, BN)
    if CAUSAL:
        n_tiles = gl.minimum(n_tiles, gl.cdiv(m0 + 2 * QR + sk - sq, BN))

    # -- shared memory: the query halves, the K/V ring, barriers
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KSTAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [KSTAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [KSTAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    if PINGPONG:
        mbarrier.arrive(turn.index(0))          # consumer 0 issues first
    for i in gl.static_range(KSTAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)             # both consumers release a stage
    for i in gl.static_range(STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)

    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE,
                     so_b, so_s, so_h, sl_b, sl_h, sl_s, b, h, m0, sq, sk, n_tiles, scale,
                     QR, BN, D, DV, STAGES, KSTAGES, CAUSAL, RETURN_LSE, PINGPONG)),
        (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, turn, O, LSE,
                     so_b, so_s, so_h, sl_b, sl_h, sl_s, b, h, m0, sq, sk, n_tiles, scale,
                     QR, BN, D, DV, STAGES, KSTAGES, CAUSAL, RETURN_LSE, PINGPONG)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                           v_empty, b, h * D, (h // GROUP) * D, m0, n_tiles, QR, BN, STAGES, KSTAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
