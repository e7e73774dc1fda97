"""Split-KV decode attention for sm_90 (Gluon): a load warp that walks the block table, one consumer warpgroup.

``attn_fwd``'s split decode issues its own K/V loads from every thread, and with pages smaller than a key
tile each key's row address waits for its page id: Triton's pipeliner keeps the ids one tile ahead,
which leaves about one L2 round trip per tile on the critical path (pages of 16 cost ~4 us more than
dense keys at 8k: ``decode-ws-h200.json``, ``docs/design/attention-decode.md``). Here the
schedule is ours:

* one program = one split of the keys of one (batch, KV head); its ``GROUP`` query heads are the first
  rows of a 64-row wgmma tile (the other rows are the next heads' queries or zeros: computed and dropped);
* partition 1 (one warp) loads q once, then reads the block table itself and fills a ring of ``STAGES``
  K/V stages with TMA copies, ``BN // PR`` boxes of ``PR`` rows per tile (one per page when pages are
  smaller than a tile), so page ids never wait in the consumer's loop;
* partition 0 (4 warps) runs the prefill kernel's loop (``attention_wgmma``): tile t's scores and tile
  t-1's ``P V`` in flight together; a stage is released once its ``P V`` is done;
* the last tile of a sequence may hold rows past its end (the rest of a page or of the tensor's rows, or a
  repeat of the tile's last box where no page holds the keys): its scores are masked and those V rows
  zeroed in shared memory before ``P V``.

K/V go through 2-D descriptors over ``(rows, HKV * D)``: dense ``(B * S, ...)`` (row ``b S + n``), paged
``(pages * PAGE, ...)`` (row ``page * PAGE + n % PAGE``); q through one over ``(B * HQ, D)``. Each split
writes its normalised partial output and log-sum-exp to the workspace that ``attn_combine`` merges
(``SPLITS > 1``), or the output itself.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import load

cta_barrier = load("gluon_compat").cta_barrier
tma_load = load("gluon_compat").tma_load
wait_for_producer = load("gluon_compat").wait_for_producer
launch_dependents = load("gluon_compat").launch_dependents
_softmax_step = load("attention_wgmma")._softmax_step      # the prefill kernel's online-softmax update

NEG_INF = gl.constexpr(float("-inf"))
LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
QROWS = gl.constexpr(64)        # the wgmma tile's rows: the program's query heads, then padding

@gluon.jit
def _split_range(n_tiles, split, SPLITS: gl.constexpr):
    """Tiles ``[lo, hi)`` of ``split``: the tiles shared out as evenly as possible (floor / ceil)."""
    lo = (split * n_tiles) // SPLITS
    hi = ((split + 1) * n_tiles) // SPLITS
    return lo, hi


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                    BT, stride_btb, stride_btp, b, q_row, kv_col, sk, seqlen_kv, t_lo, t_hi,
                    BN: gl.constexpr, PR: gl.constexpr, PAGE: gl.constexpr, PAGED: gl.constexpr,
                    STAGES: gl.constexpr):
    """Producer: q once, then per tile K and V box by box (one box per page when pages are smaller than a
    tile). A box wholly past ``sk`` loads the tile's last box with keys again (a barrier expects a
    compile-time byte count, and its block-table entry may be anything): the consumer masks those keys."""
    NP: gl.constexpr = BN // PR
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, (q_row, 0), q_bar, q_smem)
    for i in range(t_hi - t_lo):
        t = t_lo + i
        s = i % STAGES
        ph = (i // STAGES) & 1
        n_box = gl.minimum(NP, gl.cdiv(sk - t * BN, PR))
        # -- a stage is refilled once its P V is done
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), 2 * NP * k_desc.block_type.nbytes)
        for p in gl.static_range(NP):
            key = t * BN + gl.minimum(p, n_box - 1) * PR
            if PAGED:
                page = gl.load(BT + b.to(gl.int64) * stride_btb + (key // PAGE) * stride_btp).to(gl.int32)
                row = page * PAGE + key % PAGE
            else:
                row = b * seqlen_kv + key
            tma_load(k_desc, (row, kv_col), ready.index(s), k_smem.index(s).slice(p * PR, PR))
            tma_load(v_desc, (row, kv_col), ready.index(s), v_smem.index(s).slice(p * PR, PR))


@gluon.jit
def _scores_masked(s, t, sk, BN: gl.constexpr, s_layout: gl.constexpr):
    """Scores of tile ``t`` with keys at or past ``sk`` at -inf."""
    cols = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
    return gl.where((cols < sk)[None, :], s, NEG_INF)


@gluon.jit
def _zero_tail_rows(v_stage, t, sk, BN: gl.constexpr, DV: gl.constexpr):
    """Zero the V rows of tile ``t`` at or past ``sk`` in shared memory (rows the sequence does not own: their
    ``p`` is 0, but 0 times a NaN is not), then order the writes before the wgmma that reads them (every
    warp's writes: a barrier of the consumer partition after each one's proxy fence)."""
    vl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = v_stage.load(vl)
    rows = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, vl))
    v_stage.store(gl.where((rows < sk)[:, None], v, gl.zeros_like(v)))
    fence_async_shared()
    cta_barrier()


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, ready, empty, O, LSE, WS_O, WS_LSE,
              so_b, so_h, sl_b, sl_h, b, nb, kvh, split, sk, t_lo, t_hi, scale, HQ,
              GROUP: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
              SPLITS: gl.constexpr, RETURN_LSE: gl.constexpr):
    """The key walk of one split (scores one tile ahead of ``P V``), then the split's rows out."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    c = scale * LOG2E
    n = t_hi - t_lo
    m_i = gl.full([QROWS], NEG_INF, gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([QROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([QROWS, DV], gl.float32, o_layout)
    if n > 0:
        zero_s = gl.zeros([QROWS, BN], gl.float32, s_layout)
        # -- prologue: scores and softmax of the first tile
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        if t_lo * BN + BN > sk:
            s = _scores_masked(s, t_lo, sk, BN, s_layout)
            _zero_tail_rows(v_smem.index(0), t_lo, sk, BN, DV)
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c)
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        # -- main loop: S_i and PV_{i-1} in flight together; softmax of S_i under PV_{i-1}
        for i in range(1, n):
            st = i % STAGES
            pt = (i - 1) % STAGES
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(pt), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            if (t_lo + i) * BN + BN > sk:
                s = _scores_masked(s, t_lo + i, sk, BN, s_layout)
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, c)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(pt))
            if (t_lo + i) * BN + BN > sk:
                _zero_tail_rows(v_smem.index(st), t_lo + i, sk, BN, DV)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        # -- the last tile's P V
        lt = (n - 1) % STAGES
        acc = warpgroup_mma(p_op, v_smem.index(lt), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(lt))

    # -- epilogue: the GROUP query heads' normalised rows and log-sum-exp (an empty split: 0 and -inf)
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.where(l_o != 0.0, l_o, 1.0)[:, None]      # a NaN sum (NaN / +inf score) keeps the row NaN
    r = gl.arange(0, QROWS, layout=row_o)
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    h = kvh * GROUP + r
    ok = r < GROUP
    lr = gl.arange(0, QROWS, layout=gl.SliceLayout(1, s_layout))
    lse = gl.where(l_i != 0.0, (m_i * c + gl.log2(gl.where(l_i != 0.0, l_i, 1.0))) * LN2, NEG_INF)
    lh = kvh * GROUP + lr
    if SPLITS == 1:
        base = O + b.to(gl.int64) * so_b
        gl.store(base + h.to(gl.int64)[:, None] * so_h + cols[None, :], out.to(O.dtype.element_ty), mask=ok[:, None])
        if RETURN_LSE:
            gl.store(LSE + b.to(gl.int64) * sl_b + lh.to(gl.int64) * sl_h, lse, mask=lr < GROUP)
    else:
        # workspace rows (split, b, head): attn_combine's (SPLITS, R, HQ, DV) and (SPLITS, R, HQ), R = B
        wrow = (split.to(gl.int64) * nb + b) * HQ
        gl.store(WS_O + (wrow + h.to(gl.int64))[:, None] * DV + cols[None, :], out, mask=ok[:, None])
        gl.store(WS_LSE + wrow + lh.to(gl.int64), lse, mask=lr < GROUP)


@gluon.jit
def attn_decode_ws(q_desc, k_desc, v_desc, O, LSE, WS_O, WS_LSE, BT, SEQLENS_K,
                   so_b, so_h, sl_b, sl_h, stride_btb, stride_btp, HQ, seqlen_kv, scale,
                   GROUP: gl.constexpr, BN: gl.constexpr, PR: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
                   DV: gl.constexpr, STAGES: gl.constexpr, SPLITS: gl.constexpr, PAGED: gl.constexpr,
                   HAS_SEQLENS: gl.constexpr, RETURN_LSE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                   PDL: gl.constexpr, LAUNCH_MERGE: gl.constexpr = False):
    """Grid ``(SPLITS, B * HKV)``. ``q_desc``: 2-D over ``(B * HQ, D)``, block ``(64, D)``; ``k_desc`` /
    ``v_desc``: 2-D over ``(rows, HKV * D)``, block ``(PR, D)`` (module docstring). ``O`` ``(B, 1, HQ, DV)``
    (strides ``so_b``, ``so_h``), ``LSE`` ``(B, HQ, 1)`` (``sl_b``, ``sl_h``); ``WS_O`` / ``WS_LSE`` the
    split workspace when ``SPLITS > 1``; ``BT`` the block table (strides ``stride_btb``, ``stride_btp``)
    when ``PAGED``; ``SEQLENS_K`` per batch when ``HAS_SEQLENS`` (else every sequence has ``seqlen_kv`` keys).
    ``PDL``: launched as a programmatic dependent of the previous kernel (whose KV-cache append or query it may
    read): every input is read after its completion, and ``attn_combine`` may launch behind this one.
    ``LAUNCH_MERGE`` (``AttnConfig.early_merge``): ``attn_combine``, launched as a dependent, may launch as soon
    as every program has started (it waits for this grid's completion before reading the partials)."""
    # -- shared memory and barriers first: with PDL, set up while the previous kernel drains
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, DV], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if LAUNCH_MERGE:
        launch_dependents()
    wait_for_producer(PDL)

    split = gl.program_id(0)
    bh = gl.program_id(1)
    hkv = HQ // GROUP
    b = bh // hkv
    kvh = bh % hkv
    if HAS_SEQLENS:
        sk = gl.load(SEQLENS_K + b).to(gl.int32)     # int32 or int64 lengths; TMA coordinates are int32
    else:
        sk = seqlen_kv
    t_lo, t_hi = _split_range(gl.cdiv(sk, BN), split, SPLITS)

    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, ready, empty, O, LSE, WS_O, WS_LSE,
                     so_b, so_h, sl_b, sl_h, b, gl.num_programs(1) // hkv, kvh, split, sk, t_lo, t_hi, scale, HQ,
                     GROUP, BN, D, DV, STAGES, SPLITS, RETURN_LSE)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                           BT, stride_btb, stride_btp, b, b * HQ + kvh * GROUP, kvh * D, sk, seqlen_kv, t_lo, t_hi,
                           BN, PR, PAGE, PAGED, STAGES))],
                       [1], [PRODUCER_REGS])   # the consumer warpgroup keeps the registers the load warp gives up
