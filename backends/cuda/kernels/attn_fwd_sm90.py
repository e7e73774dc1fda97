"""Hopper (sm_90a) attention forward in CuTe DSL: TMA loads, wgmma for S = Q K^T and O += P V, online softmax in exp2.

One CTA computes a ``tile_m`` x ``D`` block of the output for one (batch, query head): 384 threads in three
warpgroups. Warpgroup 0 is the producer: one warp issues the TMA loads of the Q tile (once) and of the K and V tiles
(``stages``-deep rings, each slot guarded by a full / empty mbarrier pair). Warpgroups 1 and 2 are the consumers:
each owns 64 query rows; per key tile it waits for K, issues the S = Q K^T wgmma (both operands in shared memory),
applies the score_mod and the mask, updates the running row max / row sum and rescales its O accumulator
(``attn_softmax``), converts P to the input dtype in registers and issues the O += P V wgmma with P from registers
(RS) and V from shared memory, then frees the slots. Within a warpgroup the GEMMs of neighbouring tiles overlap
(FA3's intra-warpgroup overlap): S_i = Q K_i^T and O += P_{i-1} V_{i-1} are issued together and the softmax of S_i
runs while the P V GEMM does, O being rescaled once it is done. Between the two consumer warpgroups the tensor cores
take turns (FA3's ping-pong, two named barriers). The producer runs up to ``stages`` tiles ahead. Register budgets
follow the roles (``setmaxnreg``: 24 for the producer, 240 for the consumers).

Key tiles: only those some row of the query tile can see. A mask whose AND-ed terms hold the library bounds
(``causal_mask()``, ``window_mask(l, r)``: ``expr_cute.band``) narrows the range to the band; the per-element mask
runs only on tiles that cross the band's edges or ``Sk`` when the mask is exactly the band, on every tile otherwise.

Semantics are portakern's (``docs/ir.md``): BSHD tensors, GQA by ``h // (Hq // Hkv)``, bottom-right aligned masks,
fp32 softmax and accumulation, a row with no visible key writes zeros and LSE = -inf. Shapes are run-time values of
the compiled kernel: one compilation serves every (B, Sq, Sk, Hq, Hkv) of a specialisation (dtype, head dim, the
expressions, LSE).
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from . import attn_softmax as sm
from ..expr_cute import band

#: the first of the two named barriers of the consumers' ping-pong (0 is __syncthreads)
SCHED_BARRIER = 1


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """The wgmma accumulator's per-thread layout ``((2, 2, V), MMA_M, MMA_N)`` viewed as ``(rows, cols)``:
    ``((2, MMA_M), (2, V, MMA_N))`` -- each thread holds 2 rows per 64-row atom, its columns in pairs."""
    flat = cute.make_layout(acc_layout.shape)
    shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2]))
    stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[0][2], flat.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """The S accumulator ``((2, 2, N/8), MMA_M, MMA_N)`` read as the A operand of a 16-bit RS wgmma:
    ``((2, 2, 2), MMA_M, (N/16, MMA_N))`` (two 8-column groups make one k16 slice)."""
    divided = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    shape = ((divided.shape[0][0], divided.shape[0][1], divided.shape[0][2][0]), divided.shape[1],
             (divided.shape[0][2][1], divided.shape[2]))
    stride = ((divided.stride[0][0], divided.stride[0][1], divided.stride[0][2][0]), divided.stride[1],
              (divided.stride[0][2][1], divided.stride[2]))
    return cute.make_layout(shape, stride=stride)


def make_tiled_mmas(dtype, tile_m: int, tile_n: int, head_dim: int):
    """``(S = Q K^T, O += P V)`` tiled wgmmas: one 64-row atom per consumer warpgroup; Q, K K-major from shared
    memory; P from registers, V MN-major from shared memory."""
    qk = sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                           atom_layout_mnk=(tile_m // 64, 1, 1), tiler_mn=(64, tile_n))
    pv = sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                           atom_layout_mnk=(tile_m // 64, 1, 1), tiler_mn=(64, head_dim),
                                           a_source=warpgroup.OperandSource.RMEM)
    return qk, pv


class AttnFwdSm90:
    """The kernel for one specialisation: ``dtype`` (cutlass.Float16 / BFloat16), ``head_dim`` (= Dv),
    ``score_mod`` / ``mask_mod`` (IR expressions or None) and ``return_lse`` are compile-time; shapes and the scale
    are run-time. ``overlap`` selects the intra-warpgroup overlap, which holds S, P and O live at once: a
    specialisation whose expressions need more registers than that leaves builds without it (``attention.py``)."""

    def __init__(self, dtype, head_dim: int, score_mod, mask_mod, return_lse: bool, tile_m: int = 128,
                 tile_n: int = 128, stages: int = 2, overlap: bool = True):
        self.dtype = dtype
        self.overlap = overlap      # FA3's intra-warpgroup overlap (False: one tile's S, softmax, P V in turn)
        self.head_dim = head_dim
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.band = band(mask_mod)
        self.return_lse = return_lse
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.stages = stages
        self.mma_warpgroups = tile_m // 64
        self.threads = 128 * (self.mma_warpgroups + 1)
        self.producer_regs, self.mma_regs = 24, 240

    # -- host side: layouts, TMA atoms, launch ------------------------------------------------------------------

    def _smem_layout(self, rows: int, cols: int, stages: int | None = None):
        """A K-major (row-major) swizzled shared-memory layout of ``rows x cols`` elements, staged when asked."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols), self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse, scale: Float32, stream):
        """Host side: build the tiled wgmmas, shared-memory layouts and TMA atoms, and launch one CTA per (128 query
        rows, query head, batch) on ``stream``. q, o: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); lse: (B, Hq, Sq)
        float32 or None; ``scale`` multiplies q.k."""
        # re-view BSHD as (S, D, H, B): TMA tiles the first two modes
        mQ, mK, mV, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                          for t in (q, k, v, o)]
        D, BM, BN = self.head_dim, self.tile_m, self.tile_n
        tiled_mma_qk, tiled_mma_pv = make_tiled_mmas(self.dtype, BM, BN, D)
        sQ_layout = self._smem_layout(BM, D)
        sK_layout = self._smem_layout(BN, D, self.stages)
        sV_layout = self._smem_layout(BN, D, self.stages)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (BM, D))
        tma_k, tK = cpasync.make_tiled_tma_atom(g2s, mK, cute.select(sK_layout, mode=[0, 1]), (BN, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(g2s, mV, cute.select(sV_layout, mode=[0, 1]), (BN, D))
        bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        bytes_kv = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        grid = (cute.ceil_div(cute.size(mQ.shape[0]), BM), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(tQ, tK, tV, mO, lse, tma_q, tma_k, tma_v, scale, sQ_layout, sK_layout, sV_layout,
                    tiled_mma_qk, tiled_mma_pv, SharedStorage, bytes_q, bytes_kv).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # -- device side ------------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, scale: Float32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               bytes_q: cutlass.Constexpr, bytes_kv: cutlass.Constexpr):
        """Device side: set up shared memory and the pipelines, then split into the producer warpgroup
        (``load``) and the two consumer warpgroups (``consume``)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        # -- phase: shared memory and the three pipelines (Q once; K and V rings) ---------------------------------
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_warpgroups * 4)   # one per warp
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=bytes_q, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=bytes_kv, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=bytes_kv, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # V^T view (D, BN, stages): the B operand of O += P V, MN-major
        sVt = cute.composition(sV, cute.make_ordered_layout((self.head_dim, self.tile_n, self.stages),
                                                            order=(1, 0, 2)))

        # -- phase: the key tiles some row of this query tile sees (the mask's band, then [0, Sk)) ---------------
        n_start, n_blocks = self.key_tiles(m_block, seqlen_q, seqlen_k)

        if warp_idx < 4:
            # -- producer warpgroup: warp 0 issues every TMA load ------------------------------------------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, m_block, head,
                          head_kv, batch, n_start, n_blocks)
        else:
            # -- consumer warpgroups: the two GEMMs and the softmax ----------------------------------------------
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, mO, mLSE, pipe_q, pipe_k, pipe_v, tidx - 128,
                         m_block, head, batch, n_start, n_blocks, seqlen_q, seqlen_k, scale)

    @cute.jit
    def key_tiles(self, m_block, seqlen_q, seqlen_k):
        """``(first key tile, number of key tiles)`` for query tile ``m_block``: the band of the mask's library
        bounds (visible keys of row i: ``i + diag - left .. i + diag + right``, ``diag = Sk - Sq``) within
        ``[0, Sk)``; zero tiles when no row sees a key."""
        BM, BN = self.tile_m, self.tile_n
        diag = seqlen_k - seqlen_q
        first_row = m_block * BM
        end = cute.ceil_div(seqlen_k, BN)
        if const_expr(self.band.right is not None):
            last_key = first_row + BM + diag + self.band.right                # one past the last row's last key
            end = cutlass.min(end, cute.ceil_div(cutlass.max(last_key, 0), BN))
        start = Int32(0)
        if const_expr(self.band.left is not None):
            start = cutlass.max(first_row + diag - self.band.left, 0) // BN
        return start, cutlass.max(end - start, 0)

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, m_block, head, head_kv,
             batch, n_start, n_blocks):
        """Producer warp: the Q tile once, then K and V tile ``n_start + i`` into ring slot ``i % stages``."""
        D = self.head_dim
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, D), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, D), (None, 0))     # (BN, D, n)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, D), (None, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                         cute.group_modes(gV, 0, 2))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
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
    def gemm(self, tiled_mma, acc, tA, tB, zero_init: cutlass.Constexpr, wait: cutlass.Constexpr = True):
        """One warpgroup GEMM over the K mode of the fragments, issued async and committed; waited on unless
        ``wait`` is False (the caller then waits with ``warpgroup.wait_group(0)``)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for kb in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        if const_expr(wait):
            warpgroup.wait_group(0)

    # -- ping-pong: the two consumer warpgroups take turns at the tensor cores ---------------------------------
    # Warpgroup w waits on named barrier SCHED_BARRIER + w (256 threads: its own 128 and the other's arrival) before
    # it issues a GEMM group and arrives on the other's barrier once its S GEMM is issued, so one warpgroup's
    # softmax runs while the other's GEMMs do (FlashAttention-3). Per CTA both warpgroups visit the same key tiles,
    # so each syncs 1 + n times and arrives n + 1 times; warpgroup 0 pre-arrives on its own barrier to go first.

    @cute.jit
    def sched_init(self, wg):
        if wg == 0:
            cute.arch.barrier_arrive(barrier_id=SCHED_BARRIER, number_of_threads=256)

    @cute.jit
    def sched_wait(self, wg):
        cute.arch.barrier(barrier_id=SCHED_BARRIER + wg, number_of_threads=256)

    @cute.jit
    def sched_pass(self, wg):
        cute.arch.barrier_arrive(barrier_id=SCHED_BARRIER + 1 - wg, number_of_threads=256)

    @cute.jit
    def needs_mask(self, n, m_block, seqlen_q, seqlen_k):
        """Whether key tile ``n`` needs the per-element mask for query tile ``m_block``: always for a mask beyond
        the library bounds; else when the tile crosses ``Sk`` or an edge of the band."""
        BM, BN = self.tile_m, self.tile_n
        col0 = n * BN
        crosses = col0 + BN > seqlen_k
        if const_expr(not self.band.exact):
            crosses = True
        diag = seqlen_k - seqlen_q
        if const_expr(self.band.right is not None):
            crosses = crosses or col0 + BN - 1 > m_block * BM + diag + self.band.right
        if const_expr(self.band.left is not None):
            crosses = crosses or col0 < m_block * BM + BM - 1 + diag - self.band.left
        return crosses

    @cute.jit
    def softmax_tile(self, s_mn, tScS, row_max, row_sum, correction, m_block, seqlen_q, seqlen_k, scale, ctx, n):
        """Key tile ``n``'s scores in ``s_mn`` (raw q.k) -> log2 units through the score_mod, the mask where the
        tile needs it, then the online softmax: P in place, the row stats and O's ``correction``."""
        row0, col0 = m_block * self.tile_m, n * self.tile_n
        sm.to_log2_units(s_mn, tScS, row0, col0, scale, ctx)
        if self.needs_mask(n, m_block, seqlen_q, seqlen_k):
            sm.mask(s_mn, tScS, row0, col0, seqlen_k, ctx)
        sm.online_softmax(s_mn, row_max, row_sum, correction, sm.quad_max)

    @cute.jit
    def consume(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, mO, mLSE, pipe_q, pipe_k, pipe_v, tidx, m_block,
                head, batch, n_start, n_blocks, seqlen_q, seqlen_k, scale):
        """Consumer warpgroups: per key tile S = Q K^T, score_mod and mask, online softmax, O += P V; then the
        epilogue."""
        BM, BN, D = self.tile_m, self.tile_n, self.head_dim
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice = cute.make_layout(self.mma_warpgroups, stride=128)
        mma_qk = tiled_mma_qk.get_slice(wg_slice(wg))
        mma_pv = tiled_mma_pv.get_slice(wg_slice(wg))
        tSrQ = mma_qk.make_fragment_A(mma_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(mma_qk.partition_B(sK))                    # (..., stages)
        tOrVt = mma_pv.make_fragment_B(mma_pv.partition_B(sVt))
        acc_s = cute.make_rmem_tensor(mma_qk.partition_shape_C((BM, BN)), Float32)
        acc_o = cute.make_rmem_tensor(mma_pv.partition_shape_C((BM, D)), Float32)
        tOrP = mma_pv.make_fragment_A(mma_pv.partition_shape_A((BM, BN)))       # P in registers, wgmma A layout
        acc_o.fill(0.0)

        # per-thread (row, col) of every S element within the tile: score_mod and mask read them
        cS = tiled_mma_qk.get_slice(tidx).partition_C(cute.make_identity_tensor((BM, BN)))
        tScS = cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))
        s_mn = cute.make_tensor(acc_s.iterator, acc_mn_layout(acc_s.layout))
        o_mn = cute.make_tensor(acc_o.iterator, acc_mn_layout(acc_o.layout))
        row_max = cute.make_rmem_tensor(cute.size(s_mn, mode=[0]), Float32)
        row_sum = cute.make_rmem_tensor(cute.size(s_mn, mode=[0]), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        ctx = sm.TileContext(self.score_mod, self.mask_mod, Int32(batch), Int32(head), seqlen_q, seqlen_k)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        correction = cute.make_rmem_tensor(cute.size(row_max), Float32)
        row0 = m_block * BM
        tile = partial(self.softmax_tile, s_mn, tScS, row_max, row_sum, correction, m_block, seqlen_q, seqlen_k,
                       scale, ctx)
        p_view = cute.make_tensor(acc_s.iterator, acc_as_operand_a(acc_s.layout))
        self.sched_init(wg)
        if const_expr(not self.overlap):
            self.sched_wait(wg)
            for i in cutlass.range(n_blocks, unroll=1):
                # -- phase: S = Q K^T, its softmax, O rescaled, then O += P V in this warpgroup's turn -------------
                pipe_k.consumer_wait(k_state)
                self.gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_state.index], True, wait=False)
                self.sched_pass(wg)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(k_state)
                tile(n_start + i)
                sm.rescale(o_mn, correction)
                tOrP.store(p_view.load().to(self.dtype))
                pipe_v.consumer_wait(k_state)
                self.sched_wait(wg)
                self.gemm(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, k_state.index], False)
                pipe_v.consumer_release(k_state)
                k_state.advance()
            self.sched_pass(wg)
        else:
            if n_blocks > 0:
                # -- phase: the first tile's S = Q K^T and softmax (its turn handed on once S is issued) ---------------
                self.sched_wait(wg)
                pipe_k.consumer_wait(k_state)
                self.gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_state.index], True, wait=False)
                self.sched_pass(wg)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(k_state)
                tile(n_start)
                sm.rescale(o_mn, correction)
                tOrP.store(p_view.load().to(self.dtype))
                for i in cutlass.range(1, n_blocks, unroll=1):
                    # -- phase: S_i = Q K_i^T and O += P_{i-1} V_{i-1} issued together, in this warpgroup's turn -------
                    v_state = k_state.clone()
                    k_state.advance()
                    pipe_k.consumer_wait(k_state)
                    self.sched_wait(wg)
                    self.gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_state.index], True, wait=False)
                    pipe_v.consumer_wait(v_state)
                    self.gemm(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], False, wait=False)
                    self.sched_pass(wg)
                    # -- phase: softmax of S_i while P_{i-1} V_{i-1} runs (O untouched until it is done) -------------
                    warpgroup.wait_group(1)
                    pipe_k.consumer_release(k_state)
                    tile(n_start + i)
                    warpgroup.wait_group(0)
                    pipe_v.consumer_release(v_state)
                    # -- phase: O rescaled for the new row max; P_i to the input dtype for the next P V -------------
                    sm.rescale(o_mn, correction)
                    tOrP.store(p_view.load().to(self.dtype))
                # -- phase: the last tile's O += P V ------------------------------------------------------------------
                pipe_v.consumer_wait(k_state)
                self.sched_wait(wg)
                self.gemm(tiled_mma_pv, acc_o, tOrP, tOrVt[None, None, None, k_state.index], False)
                self.sched_pass(wg)
                pipe_v.consumer_release(k_state)
            else:
                self.sched_wait(wg)         # no key tile: one turn taken and handed on, as the other warpgroup counts
                self.sched_pass(wg)
        pipe_q.consumer_release(q_state)

        # -- phase: epilogue: O / l in the output dtype for rows < Sq; the LSE from one lane of each quad ----------
        inv = cute.make_rmem_tensor(cute.size(row_sum), Float32)
        lse = cute.make_rmem_tensor(cute.size(row_sum), Float32)
        sm.finish(row_max, row_sum, inv, lse, sm.quad_sum)
        cO = tiled_mma_pv.get_slice(tidx).partition_C(cute.make_identity_tensor((BM, D)))
        tOcO = cute.make_tensor(cO.iterator, acc_mn_layout(cO.layout))
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            row = row0 + tOcO[r, 0][0]
            if row < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    mO[row, tOcO[r, c][1], head, batch] = (o_mn[r, c] * inv[r]).to(self.dtype)
                if const_expr(self.return_lse):
                    if tidx % 4 == 0:
                        mLSE[batch, head, row] = lse[r]
