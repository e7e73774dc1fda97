"""Blackwell (sm_100a) attention forward in CuTe DSL: TMA loads, tcgen05 MMAs into tensor memory, online softmax.

One CTA computes a 128 x ``D`` block of the output for one (batch, query head) with six warps, each with one role:

- warps 0-3, the **softmax warpgroup**: tcgen05 loads put one row of the S tile into each thread's registers (the
  32x32b shape: warp ``w`` reads TMEM lanes ``32w .. 32w+31``, i.e. query rows), so every row reduction stays in
  one thread. Per key tile: score_mod, mask, online softmax in log2 units (``attn_softmax``), O's rescale in tensor
  memory (tcgen05 load, multiply, tcgen05 store) in a warp where some row's max moved, P in the input dtype
  written to shared memory; at the end O / l and the LSE go out.
- warp 4, the **MMA warp**: allocates tensor memory (S: ``tile_n`` columns, then O: ``D`` columns) and issues
  every tcgen05 MMA from one thread: ``S = Q K^T`` (both operands in shared memory, K-major) and ``O += P V`` (P
  K-major and V MN-major in shared memory), each followed by a ``tcgen05.commit`` on the mbarrier its consumer
  waits on. ``S_{i+1}`` is issued as soon as the softmax has read ``S_i`` out of tensor memory, so the next tile's
  ``Q K^T`` runs during this tile's softmax.
- warp 5, the **load warp**: TMA loads of the Q tile (once) and of K and V tile by tile into ``stages``-deep rings.

Hand-offs are mbarrier pipelines: Q, K, V (TMA -> MMA, ``PipelineTmaUmma``), S (MMA -> softmax, ``PipelineUmmaAsync``:
full when the QK^T MMA completes, empty when the softmax has loaded S) and P (softmax -> MMA,
``PipelineAsyncUmma``: full when P is in shared memory and O rescaled, empty when the P V MMA that read them is
done -- so the softmax never touches O or P while an MMA uses them).

Semantics are the Hopper kernel's (``attn_fwd_sm90.py``) and portakern's (``docs/ir.md``): the same per-tile
functions, the same key-tile range and mask skipping (``AttnFwdSm90.key_tiles`` / ``needs_mask``), a row with no
visible key writes zeros and LSE = -inf, NaN and +inf flow to NaN. Shapes are run-time values.

Status: compiled for sm_100a without a GPU (``attention.compile_for_target``), never executed: no Blackwell GPU has
run it, so ``attention.supports`` does not serve it on one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from . import attn_softmax as sm
from .attn_fwd_sm90 import AttnFwdSm90

#: warps by role
SOFTMAX_WARPS, MMA_WARP, LOAD_WARP = (0, 1, 2, 3), 4, 5
#: named barriers: the TMEM address hand-out, and the end of all TMEM reads before the MMA warp frees it
TMEM_ALLOC_BARRIER, TMEM_FREE_BARRIER = 1, 2
#: columns of O a thread loads / stores at a time (rescale and epilogue)
O_CHUNK = 32
#: elements of P a thread stores to shared memory at once (16 bytes: contiguous within a 128-byte swizzle atom)
P_VEC = 8


def tmem_fence(after: bool) -> None:
    """``tcgen05.fence::after_thread_sync`` (after a wait, before tcgen05 operations that depend on it) or
    ``::before_thread_sync`` (after tcgen05 operations, before the arrive that hands their results on): the PTX
    memory model orders tcgen05 loads, stores and MMAs of different threads only through these around the mbarrier
    or named-barrier synchronisation."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC if after else nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC)


def check_row_fragment(c_mn, cols: int) -> None:
    """Trace-time check of what the P store assumes: the 32x32b load puts column ``c`` of the thread's row at
    element ``c`` of its fragment (static coordinates). Plain Python, so the DSL does not stage the loop."""
    for c in range(cols):
        col = c_mn[0, c][1]
        if not isinstance(col, int) or col != c:
            raise AssertionError(f"the S fragment's element {c} holds column {col}, not {c}")


def tmem_columns(tile_n: int, head_dim: int) -> int:
    """Tensor-memory columns to allocate: S (``tile_n`` fp32 columns) then O (``head_dim``), rounded up to a power
    of two of at least 32 (the allocation granule)."""
    need = tile_n + head_dim
    cols = 32
    while cols < need:
        cols *= 2
    if cols > 512:
        raise ValueError(f"S ({tile_n}) and O ({head_dim}) need {need} TMEM columns; a CTA has 512")
    return cols


class AttnFwdSm100:
    """The sm_100a kernel for one specialisation: ``dtype`` (cutlass.Float16 / BFloat16), ``head_dim`` (= Dv),
    ``score_mod`` / ``mask_mod`` (IR expressions or None) and ``return_lse`` are compile-time; shapes and the scale
    are run-time. ``tile_n`` keys a tile (64 at D = 256 so that Q, two K and V stages and P fit shared memory)."""

    def __init__(self, dtype, head_dim: int, score_mod, mask_mod, return_lse: bool, tile_n: int = 128,
                 stages: int = 2):
        self.dtype = dtype
        self.head_dim = head_dim
        self.return_lse = return_lse
        self.tile_m, self.tile_n, self.stages = 128, tile_n, stages
        self.threads = 32 * (len(SOFTMAX_WARPS) + 2)
        self.tmem_cols = tmem_columns(tile_n, head_dim)
        # the key-tile range, mask skipping and per-tile softmax are shared with the Hopper kernel
        self.tiles = AttnFwdSm90(dtype, head_dim, score_mod, mask_mod, return_lse, tile_m=self.tile_m,
                                 tile_n=tile_n)
        self.score_mod, self.mask_mod = score_mod, mask_mod

    # -- host side: tiled MMAs, shared-memory layouts, TMA atoms, launch -----------------------------------------

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse, scale: Float32, stream):
        """Host side: build the tcgen05 tiled MMAs, shared-memory layouts and TMA atoms, and launch one CTA per (128
        query rows, query head, batch) on ``stream``. q, o: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); lse: (B, Hq, Sq)
        float32 or None; ``scale`` multiplies q.k."""
        # re-view BSHD as (S, D, H, B); V as (D, Sk, H, B): the P V MMA's B operand, MN-major
        mQ, mK, mV, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                          for t in (q, k, v, o)]
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 0, 2, 3]))
        D, BM, BN = self.head_dim, self.tile_m, self.tile_n
        one = tcgen05.CtaGroup.ONE
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        mma_qk = sm100_utils.make_trivial_tiled_mma(self.dtype, K, K, Float32, one, (BM, BN))
        mma_pv = sm100_utils.make_trivial_tiled_mma(self.dtype, K, MN, Float32, one, (BM, D))
        tiler_qk, tiler_pv = (BM, BN, D), (BM, D, BN)
        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, tiler_qk, self.dtype, 1)
        sK_layout = sm100_utils.make_smem_layout_b(mma_qk, tiler_qk, self.dtype, self.stages)
        sV_layout = sm100_utils.make_smem_layout_b(mma_pv, tiler_pv, self.dtype, self.stages)
        sP_layout = sm100_utils.make_smem_layout_a(mma_pv, tiler_pv, self.dtype, 1)

        cta_layout = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma_qk.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        tma_q, tQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), tiler_qk,
                                                     mma_qk, cta_layout.shape)
        tma_k, tK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, cute.select(sK_layout, mode=[0, 1, 2]), tiler_qk,
                                                     mma_qk, cta_layout.shape)
        tma_v, tV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mVt, cute.select(sV_layout, mode=[0, 1, 2]), tiler_pv,
                                                     mma_pv, cta_layout.shape)
        bytes_q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2]))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            mbar_s: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_p: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: Int32
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        grid = (cute.ceil_div(cute.size(mQ.shape[0]), BM), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(tQ, tK, tV, mO, lse, tma_q, tma_k, tma_v, scale, sQ_layout, sK_layout, sV_layout, sP_layout,
                    mma_qk, mma_pv, cta_layout, SharedStorage, bytes_q, bytes_k, bytes_v).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # -- device side ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma,
               cta_layout: cute.Layout, SharedStorage: cutlass.Constexpr, bytes_q: cutlass.Constexpr,
               bytes_k: cutlass.Constexpr, bytes_v: cutlass.Constexpr):
        """Device side: shared memory, the five pipelines and tensor memory, then the three roles."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mO.shape[0], mK.shape[0]     # mK: (Sk, D, Hkv, B) TMA view; mO: (Sq, D, Hq, B)
        head_kv = head // (mO.shape[2] // mK.shape[2])
        if warp_idx == LOAD_WARP:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        # -- phase: shared memory and the pipelines ------------------------------------------------------------
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        softmax = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(SOFTMAX_WARPS))

        def tma_pipe(mbar, stages, tx):
            return pipeline.PipelineTmaUmma.create(barrier_storage=mbar.data_ptr(), num_stages=stages,
                                                   producer_group=one, consumer_group=one, tx_count=tx,
                                                   cta_layout_vmnk=cta_layout, defer_sync=True)
        pipe_q = tma_pipe(storage.mbar_q, 1, bytes_q)
        pipe_k = tma_pipe(storage.mbar_k, self.stages, bytes_k)
        pipe_v = tma_pipe(storage.mbar_v, self.stages, bytes_v)
        pipe_s = pipeline.PipelineUmmaAsync.create(barrier_storage=storage.mbar_s.data_ptr(), num_stages=1,
                                                   producer_group=one, consumer_group=softmax,
                                                   cta_layout_vmnk=cta_layout, defer_sync=True)
        pipe_p = pipeline.PipelineAsyncUmma.create(barrier_storage=storage.mbar_p.data_ptr(), num_stages=1,
                                                   producer_group=softmax, consumer_group=one,
                                                   cta_layout_vmnk=cta_layout, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        # -- phase: tensor memory: the MMA warp allocates, the softmax warps read the address ------------------
        tmem = cutlass.utils.TmemAllocator(
            storage.tmem_addr.ptr, allocator_warp_id=MMA_WARP,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_ALLOC_BARRIER,
                                                       num_threads=32 * (len(SOFTMAX_WARPS) + 1)))
        free_barrier = pipeline.NamedBarrier(barrier_id=TMEM_FREE_BARRIER, num_threads=32 * (len(SOFTMAX_WARPS) + 1))
        thr_qk, thr_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        BM, BN, D = self.tile_m, self.tile_n, self.head_dim
        tStS_layout = thr_qk.make_fragment_C(thr_qk.partition_shape_C((BM, BN))).layout
        tOtO_layout = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BM, D))).layout

        n_start, n_blocks = self.tiles.key_tiles(m_block, seqlen_q, seqlen_k)

        if warp_idx == LOAD_WARP:
            # -- load warp: every TMA load -------------------------------------------------------------------------
            self.load(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, thr_qk, thr_pv, pipe_q, pipe_k, pipe_v, m_block,
                      head, head_kv, batch, n_start, n_blocks)
        if warp_idx == MMA_WARP:
            # -- MMA warp: allocate TMEM, every tcgen05 MMA, free TMEM once the softmax warps are done -------------
            tmem.allocate(self.tmem_cols)
            tmem.wait_for_alloc()
            base = tmem.retrieve_ptr(Float32)
            tStS = cute.make_tensor(base, tStS_layout)
            tOtO = cute.make_tensor(base + BN, tOtO_layout)
            self.mma(mma_qk, mma_pv, sQ, sK, sV, sP, tStS, tOtO, pipe_q, pipe_k, pipe_v, pipe_s, pipe_p, n_blocks)
            tmem.relinquish_alloc_permit()
            free_barrier.arrive_and_wait()
            tmem_fence(after=True)
            tmem.free(base)
        if warp_idx < len(SOFTMAX_WARPS):
            # -- softmax warpgroup ---------------------------------------------------------------------------------
            tmem.wait_for_alloc()
            base = tmem.retrieve_ptr(Float32)
            tStS = cute.make_tensor(base, tStS_layout)
            tOtO = cute.make_tensor(base + BN, tOtO_layout)
            self.softmax(thr_qk, thr_pv, tStS, tOtO, sP, mO, mLSE, pipe_s, pipe_p, tidx, m_block, head, batch,
                         n_start, n_blocks, seqlen_q, seqlen_k, scale)
            tmem_fence(after=False)
            free_barrier.arrive_and_wait()

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, thr_qk, thr_pv, pipe_q, pipe_k, pipe_v, m_block,
             head, head_kv, batch, n_start, n_blocks):
        """Load warp: the Q tile once, then K and V tile ``n_start + i`` into ring slot ``i % stages``."""
        BM, BN, D = self.tile_m, self.tile_n, self.head_dim
        gQ = cute.local_tile(mQ[None, None, head, batch], (BM, D), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (BN, D), (None, 0))          # (BN, D, n)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (D, BN), (0, None))          # (D, BN, n)
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                         cute.group_modes(thr_qk.partition_A(gQ), 0, 3))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                         cute.group_modes(thr_qk.partition_B(gK), 0, 3))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                         cute.group_modes(thr_pv.partition_B(gV), 0, 3))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQg, tQs[None, 0], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for i in cutlass.range(n_blocks, unroll=1):
            pipe_k.producer_acquire(kv_state)
            cute.copy(tma_k, tKg[None, n_start + i], tKs[None, kv_state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
            pipe_v.producer_acquire(kv_state)
            cute.copy(tma_v, tVg[None, n_start + i], tVs[None, kv_state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
            kv_state.advance()

    @cute.jit
    def gemm(self, tiled_mma, acc, tA, tB, accumulate):
        """``acc (+)= A B`` over the K blocks of the fragments, issued by the MMA warp; ``accumulate`` (a run-time
        Boolean) says whether the first K block adds to ``acc`` or overwrites it."""
        atom = cute.make_mma_atom(tiled_mma.op)      # its own atom: the ACCUMULATE field is per-call state
        atom.set(tcgen05.Field.ACCUMULATE, accumulate)
        for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
            atom.set(tcgen05.Field.ACCUMULATE, True)

    @cute.jit
    def mma(self, mma_qk, mma_pv, sQ, sK, sV, sP, tStS, tOtO, pipe_q, pipe_k, pipe_v, pipe_s, pipe_p, n_blocks):
        """MMA warp: ``S_0``; then per tile ``i``: ``S_{i+1} = Q K_{i+1}^T`` (once the softmax has read ``S_i``),
        ``O (+)= P_i V_i`` (once P_i is written and O rescaled); each MMA commits to its consumer's barrier."""
        tSrQ = mma_qk.make_fragment_A(sQ)[None, None, None, 0]
        tSrK = mma_qk.make_fragment_B(sK)
        tOrP = mma_pv.make_fragment_A(sP)[None, None, None, 0]
        tOrV = mma_pv.make_fragment_B(sV)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        if n_blocks > 0:
            # -- phase: S_0 = Q K_0^T ----------------------------------------------------------------------------
            pipe_k.consumer_wait(k_state)
            pipe_s.producer_acquire(s_state)
            tmem_fence(after=True)
            self.gemm(mma_qk, tStS, tSrQ, tSrK[None, None, None, k_state.index], False)
            pipe_s.producer_commit(s_state)
            pipe_k.consumer_release(k_state)
            s_state.advance()
            k_state.advance()
        for i in cutlass.range(n_blocks, unroll=1):
            if i + 1 < n_blocks:
                # -- phase: S_{i+1} = Q K_{i+1}^T, once S_i is in the softmax warps' registers ---------------------
                pipe_k.consumer_wait(k_state)
                pipe_s.producer_acquire(s_state)
                tmem_fence(after=True)
                self.gemm(mma_qk, tStS, tSrQ, tSrK[None, None, None, k_state.index], False)
                pipe_s.producer_commit(s_state)
                pipe_k.consumer_release(k_state)
                s_state.advance()
                k_state.advance()
            # -- phase: O (+)= P_i V_i; its completion frees P and O for the softmax warps -------------------------
            pipe_p.consumer_wait(p_state)
            pipe_v.consumer_wait(v_state)
            tmem_fence(after=True)
            self.gemm(mma_pv, tOtO, tOrP, tOrV[None, None, None, v_state.index], i > 0)
            pipe_p.consumer_release(p_state)
            pipe_v.consumer_release(v_state)
            p_state.advance()
            v_state.advance()
        pipe_q.consumer_release(q_state)

    @cute.jit
    def softmax(self, thr_qk, thr_pv, tStS, tOtO, sP, mO, mLSE, pipe_s, pipe_p, tidx, m_block, head, batch,
                n_start, n_blocks, seqlen_q, seqlen_k, scale):
        """Softmax warpgroup: per key tile S from tensor memory, the per-tile math, O's rescale in tensor memory,
        P to shared memory; then the epilogue. Thread ``t`` holds query row ``t`` of the tile."""
        BM, BN, D = self.tile_m, self.tile_n, self.head_dim
        # -- phase: the tcgen05 load of S (one row a thread) and the (row, col) of each element -------------------
        tSAcc = tStS[(None, None), 0, 0]                                                # (BM, BN) in TMEM
        ld_s = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        thr_ld_s = tcgen05.make_tmem_copy(ld_s, tSAcc).get_slice(tidx)
        tStS_t2r = thr_ld_s.partition_S(tSAcc)
        tScS = thr_ld_s.partition_D(thr_qk.partition_C(cute.make_identity_tensor((BM, BN)))[(None, None), 0, 0])
        tSrS = cute.make_rmem_tensor(tScS.shape, Float32)
        row_view = cute.make_layout((1, BN), stride=(0, 1))
        s_mn = cute.composition(tSrS, row_view)
        c_mn = cute.composition(tScS, row_view)
        row = c_mn[0, 0][0]
        check_row_fragment(c_mn, BN)
        # P in the input dtype, written to this thread's row of sP P_VEC elements (16 bytes) at a time
        tSrP = cute.make_rmem_tensor(cute.make_layout(BN), self.dtype)
        tSrP_v = cute.logical_divide(tSrP, cute.make_layout(P_VEC))
        tPsP_v = cute.logical_divide(self.p_view(sP)[row, None], cute.make_layout(P_VEC))

        row_max = cute.make_rmem_tensor(1, Float32)
        row_sum = cute.make_rmem_tensor(1, Float32)
        correction = cute.make_rmem_tensor(1, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        ctx = sm.TileContext(self.score_mod, self.mask_mod, Int32(batch), Int32(head), seqlen_q, seqlen_k)
        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        row0 = m_block * BM
        for i in cutlass.range(n_blocks, unroll=1):
            # -- phase: S_i from tensor memory; the slot goes back to the MMA warp for S_{i+1} -------------------
            pipe_s.consumer_wait(s_state)
            tmem_fence(after=True)
            cute.copy(thr_ld_s, tStS_t2r, tSrS)
            cute.arch.fence_view_async_tmem_load()
            tmem_fence(after=False)
            pipe_s.consumer_release(s_state)
            s_state.advance()
            # -- phase: score_mod, mask, online softmax (a thread holds its whole row: no cross-lane reduction) --
            n = n_start + i
            sm.to_log2_units(s_mn, c_mn, row0, n * BN, scale, ctx)
            if self.tiles.needs_mask(n, m_block, seqlen_q, seqlen_k):
                sm.mask(s_mn, c_mn, row0, n * BN, seqlen_k, ctx)
            sm.online_softmax(s_mn, row_max, row_sum, correction, sm.same)
            # -- phase: once P_{i-1} V_{i-1} is done: O rescaled in tensor memory, P_i to shared memory ----------
            pipe_p.producer_acquire(p_state)
            tmem_fence(after=True)
            # conditional rescale (exact): a warp whose rows' max did not move (every correction is 1) leaves O as
            # it is; the loads and stores are warp-collective, so the whole warp decides together. A NaN
            # correction differs from 1 and is applied
            if i > 0:
                if cute.arch.vote_any_sync(correction[0] != Float32(1.0)):
                    self.rescale_o(thr_pv, tOtO, tidx, correction[0])
            tSrP.store(tSrS.load().to(self.dtype))
            for g in cutlass.range_constexpr(BN // P_VEC):
                cute.autovec_copy(tSrP_v[None, g], tPsP_v[None, g])
            cute.arch.fence_view_async_shared()
            tmem_fence(after=False)
            pipe_p.producer_commit(p_state)
            p_state.advance()
        # -- phase: epilogue: wait for the last P V, then O / l for rows < Sq and the LSE ---------------------------
        pipe_p.producer_acquire(p_state)
        tmem_fence(after=True)
        inv = cute.make_rmem_tensor(1, Float32)
        lse = cute.make_rmem_tensor(1, Float32)
        sm.finish(row_max, row_sum, inv, lse, sm.same)
        grow = row0 + row
        if grow < seqlen_q:
            self.store_o(thr_pv, tOtO, tidx, inv[0], mO, grow, head, batch)
            if const_expr(self.return_lse):
                mLSE[batch, head, grow] = lse[0]

    def p_view(self, sP):
        """P's shared memory (the P V MMA's A operand: ``((128, k), 1, BN / k)``, K-major, swizzled) as a
        ``(BM, BN)`` tensor: element ``(m, c)`` is ``sP[(m, c % k), 0, c // k]``."""
        sP = sP[None, None, None, 0]
        kin = cute.size(sP.shape[0][1])
        return cute.make_tensor(sP.iterator, cute.composition(
            sP.layout, cute.make_layout((self.tile_m, (kin, self.tile_n // kin)),
                                        stride=(1, (self.tile_m, self.tile_m * kin)))))

    def o_chunks(self, thr_pv, tOtO, tidx):
        """The tcgen05 load / store of ``O_CHUNK`` columns of O (one row a thread), the TMEM partition of the first
        chunk (chunk ``j`` is ``j * O_CHUNK`` columns further) and the (row, col) of each element of a chunk."""
        chunk = cute.make_layout((self.tile_m, O_CHUNK))
        tOtO_i = cute.composition(tOtO[(None, None), 0, 0], chunk)
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32), tOtO_i).get_slice(tidx)
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32), tOtO_i).get_slice(tidx)
        cO = cute.composition(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))[
            (None, None), 0, 0], chunk)
        return ld, st, ld.partition_S(tOtO_i), st.partition_D(tOtO_i), ld.partition_D(cO)

    @cute.jit
    def rescale_o(self, thr_pv, tOtO, tidx, factor):
        """This thread's row of O in tensor memory times ``factor`` (the online softmax's correction)."""
        ld, st, src, dst, cO = self.o_chunks(thr_pv, tOtO, tidx)
        frag = cute.make_rmem_tensor(cO.shape, Float32)
        for j in cutlass.range_constexpr(self.head_dim // O_CHUNK):
            cute.copy(ld, cute.make_tensor(src.iterator + j * O_CHUNK, src.layout), frag)
            cute.arch.fence_view_async_tmem_load()
            for c in cutlass.range_constexpr(cute.size(frag)):
                frag[c] = frag[c] * factor
            cute.copy(st, frag, cute.make_tensor(dst.iterator + j * O_CHUNK, dst.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def store_o(self, thr_pv, tOtO, tidx, inv, mO, grow, head, batch):
        """This thread's row of O times ``inv`` (1 / l), in the output dtype, to row ``grow`` of ``mO``. ``inv`` is 0
        exactly when the row saw no visible key (``finish``): such a row writes zeros without reading O, which no
        MMA wrote when the query tile has no key tile at all (and which holds 0 * V, NaN for a non-finite V, when
        it has some)."""
        ld, _, src, _, cO = self.o_chunks(thr_pv, tOtO, tidx)
        frag = cute.make_rmem_tensor(cO.shape, Float32)
        for j in cutlass.range_constexpr(self.head_dim // O_CHUNK):
            cute.copy(ld, cute.make_tensor(src.iterator + j * O_CHUNK, src.layout), frag)
            cute.arch.fence_view_async_tmem_load()
            for c in cutlass.range_constexpr(cute.size(frag)):
                o = Float32(cutlass.select_(inv == Float32(0.0), Float32(0.0), frag[c] * inv))
                mO[grow, j * O_CHUNK + cO[c][1], head, batch] = o.to(self.dtype)
