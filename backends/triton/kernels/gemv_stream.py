"""Int4 GEMV for one row of x (M = 1) on sm_90+: a TMA ring of weight tiles and a stream-K grid (Gluon).

The CUDA-core kernel (``gemv_quant.gemv_fma_kernel``) keeps its next tile of words in registers, so
the bytes each SM has in flight are bounded by the registers its warps can spare: on the H200 the
large shapes ran with ~3.5 warps per scheduler, DRAM 64% busy and the issue slots 57% busy
(``benchmarks/gemv_notes.md``, v11). Here the copy engine fetches the words into a ring of shared
memory, which costs no registers, and the warps only compute:

* a **unit** is one group (``TR = GS / 8`` word rows) of ``BN`` columns: a ``(TR, BN)`` int32 tile, its
  ``(1, BN)`` scales and zeros, three TMA copies on one mbarrier;
* the grid is one program per SM; the ``T = tiles * G`` units, column tile major, are cut into
  equal contiguous ranges (stream-K), so every SM streams the same number of bytes, and a
  program's range crosses at most two column tiles partially;
* every thread of the program is a consumer; after all threads are done with a ring slot (a CTA
  barrier) one thread refills it with the unit ``STAGES`` ahead;
* x is staged once per program into shared memory, as fp32 in the words' order and already
  multiplied by the power of two that turns a masked code into its product (below), with the sums
  of x per group and warp row for the zero points.

Codes (DQ=3 of ``gemv_quant._codes``): the four bits of code ``e``, masked in place (codes 5..7 after
one 16-bit shift of the word), read as fp32 are the subnormal ``q * 2^(pos - 149)``; x carries
``2^(149 - pos - 64)``, so each code costs one LOP3 and one FFMA, and every product is
``x q 2^-64`` (normal for ``|x q| >= 2^-62``); the sum is scaled back once per column tile.

Tile layout: ``(WR, RPT, BN)`` with ``WR`` warps along the word rows (``RPT`` rows each, in one
thread) and ``WC`` warps along the columns (4 adjacent columns per thread, one 16-byte shared load
per row); the row sum of a unit stays in the thread, the sum over warps is done once per
segment. A segment (one program's units of one column tile) that covers the whole tile stores the
output; otherwise its partial goes to slot ``2 pid + (0: the program's first segment, 1: its last)``
of the workspace, and the last of the tile's programs to arrive (arrival counter per tile, reset
by that program) adds the partials in program order and stores: deterministic, no zeroed buffer.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

#: products come out as ``x q 2^-DENORM_C`` (``gemv_quant.DENORM_C``)
DENORM_C = gl.constexpr(64)
#: code positions per word (int4)
EPW = gl.constexpr(8)

if hasattr(tma, "async_load"):       # Triton 3.9
    @gluon.jit
    def _tma_load(desc, row, col, bar, dst):
        tma.async_load(desc, [row, col], bar, dst)
else:                                # Triton 3.6
    @gluon.jit
    def _tma_load(desc, row, col, bar, dst):
        tma.async_copy_global_to_shared(desc, [row, col], bar, dst)

if hasattr(gl, "thread_barrier"):    # Triton 3.6
    @gluon.jit
    def _cta_barrier():
        gl.thread_barrier()
else:                                # Triton 3.9
    @gluon.jit
    def _cta_barrier():
        gl.barrier()


@gluon.jit
def _issue(w_desc, s_desc, z_desc, w_ring, s_ring, z_ring, ready, i, u,
           G: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HAS_Z: gl.constexpr):
    """Start the copies of unit ``u`` (the program's ``i``-th) into ring slot ``i % STAGES``."""
    st = i % STAGES
    t = u // G
    g = u - t * G
    NBYTES: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes * (2 if HAS_Z else 1)
    mbarrier.expect(ready.index(st), NBYTES)
    _tma_load(w_desc, g * TR, t * BN, ready.index(st), w_ring.index(st))
    _tma_load(s_desc, g, t * BN, ready.index(st), s_ring.index(st))
    if HAS_Z:
        _tma_load(z_desc, g, t * BN, ready.index(st), z_ring.index(st))


@gluon.jit
def _axis(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along dimension ``dim`` of a rank-4 ``layout``, expanded to rank 4."""
    if dim == 0:
        v = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 2), 3)
    elif dim == 1:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 2), 3)
    elif dim == 2:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 1), 3)
    else:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 1), 2)


@gluon.jit
def _stage_x(x_ptr, x_smem, xs_smem, G: gl.constexpr, GP: gl.constexpr, TR: gl.constexpr, WR: gl.constexpr,
             RPT: gl.constexpr, IW: gl.constexpr, NW: gl.constexpr):
    """x into ``x_smem[g EPW + e, wr, r]`` (fp32, times ``2^(149 - pos_e - 64)``: the factor of code
    position e) for word row ``j = g TR + wr RPT + r``, and ``xs_smem[g, wr, r]`` = the sum of x over that
    row's codes times ``2^-64``. Word row j's code e is column ``(j // IW) IW 8 + e IW + j % IW`` of K.
    One load and one store for all ``GP`` (G rounded up to a power of two) groups: staged in pieces,
    each piece would wait for its loads behind the barrier the previous piece's stores need."""
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, RPT], [1, EPW, 32 // EPW, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    e = _axis(EPW, 1, XL)
    gg = _axis(GP, 0, XL)
    j = gg * TR + _axis(WR, 2, XL) * RPT + _axis(RPT, 3, XL)
    k = (j // IW) * (IW * EPW) + e * IW + j % IW
    xv = gl.load(x_ptr + k, mask=gg < G, other=0.0).to(gl.float32)
    # the power of two of code position e: positions 0..4 sit at bit 4e, 5..7 at 4e - 16 (shifted)
    pos = gl.where(e < 5, e * 4, e * 4 - 16)
    fac = ((149 - DENORM_C + 127 - pos) << 23).to(gl.float32, bitcast=True)
    # the buffers seen with a layout of full rank (the same bytes: unswizzled, row-major)
    F3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    x_smem._reinterpret(gl.float32, [GP * EPW, WR, RPT], F3).store(gl.reshape(xv * fac, [GP * EPW, WR, RPT]))
    xs_smem._reinterpret(gl.float32, [GP, WR, RPT], F3).store(gl.sum(xv, axis=1) * (2.0 ** -DENORM_C))


@gluon.jit
def _unit(acc, w_slot, s_slot, z_slot, x_smem, g, xs_g, ZP: gl.constexpr, HAS_Z: gl.constexpr, WR: gl.constexpr,
          RPT: gl.constexpr, BN: gl.constexpr, L3: gl.constexpr, MODE: gl.constexpr):
    """``acc (WR, BN) += s (sum over the unit's rows of x q - z sum x)`` for one unit in a ring slot.
    ``MODE`` (measurement only): 1 = read the words and fold them into acc without arithmetic,
    2 = touch nothing (the ring, barriers and copies alone)."""
    P3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    P1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    COLS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))
    # -- words of the unit (one 16-byte load per row and thread), the high halves once per word
    if MODE == 2:
        return acc
    w = w_slot._reinterpret(gl.int32, [WR, RPT, BN], P3).load(L3)
    if MODE == 1:
        return acc + gl.sum(w, axis=1).to(gl.float32, bitcast=True)
    whi = w >> 16
    dot = gl.zeros([WR, RPT, BN], gl.float32, L3)
    # -- per code position: one LOP3 and one FFMA per code
    for e in gl.static_range(EPW):
        xe = x_smem.index(g * EPW + e).load(gl.SliceLayout(2, L3))
        if e < 5:
            q = (w & (15 << (4 * e))).to(gl.float32, bitcast=True)
        else:
            q = (whi & (15 << (4 * e - 16))).to(gl.float32, bitcast=True)
        dot += gl.expand_dims(xe, 2) * q
    # -- the unit's scale and zero point, once per column
    rs = gl.sum(dot, axis=1)
    xs = gl.sum(xs_g.load(gl.SliceLayout(2, L3)), axis=1)
    xs = gl.convert_layout(xs, gl.SliceLayout(1, gl.SliceLayout(1, L3)))
    s = s_slot._reinterpret(s_slot.dtype, [BN], P1).load(COLS).to(gl.float32)
    if HAS_Z:
        z = z_slot._reinterpret(z_slot.dtype, [BN], P1).load(COLS).to(gl.float32)
        acc += gl.expand_dims(s, 0) * (rs - gl.expand_dims(z, 0) * gl.expand_dims(xs, 1))
    else:
        acc += gl.expand_dims(s, 0) * (rs - ZP * gl.expand_dims(xs, 1))
    return acc


@gluon.jit
def _segment_end(acc, t, seg_start, u_last, u0, pid, P, T, N, out_ptr, ws_ptr, cnt_ptr,
                 G: gl.constexpr, BN: gl.constexpr, L3: gl.constexpr):
    """Finish this program's segment of column tile ``t`` (units ``seg_start .. u_last``): store the
    tile, or publish the partial and, if last to arrive, add the tile's partials and store."""
    COLS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))
    res = gl.sum(acc, axis=0) * (2.0 ** DENORM_C)
    offs = gl.arange(0, BN, layout=COLS)
    cols = t * BN + offs
    cmask = cols < N
    if (seg_start == t * G) & (u_last + 1 == (t + 1) * G):
        gl.store(out_ptr + cols, res.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        # -- publish: slot 0 for the program's first segment, 1 for its last
        slot = gl.where(seg_start == u0, 0, 1)
        gl.store(ws_ptr + (pid * 2 + slot) * BN + offs, res)
        _cta_barrier()
        arrived = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
        # programs whose ranges meet the tile: c(u) = ((u + 1) P - 1) // T owns unit u
        c_first = ((t * G + 1) * P - 1) // T
        c_last = ((t + 1) * G * P - 1) // T
        if arrived == c_last - c_first:
            tot = gl.zeros([BN], gl.float32, COLS)
            for cc in range(c_first, c_last + 1):
                first = (cc * T) // P >= t * G          # cc's range starts inside the tile
                sl = gl.where(first, 0, 1)
                tot += gl.load(ws_ptr + (cc * 2 + sl) * BN + offs, cache_modifier=".cg")
            gl.store(out_ptr + cols, tot.to(out_ptr.dtype.element_ty), mask=cmask)
            gl.atomic_xchg(cnt_ptr + t, 0)


@gluon.jit
def gemv_stream_kernel(x_ptr, w_desc, s_desc, z_desc, out_ptr, ws_ptr, cnt_ptr, N, n_tiles,
                       G: gl.constexpr, GP: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr,
                       STAGES: gl.constexpr, IW: gl.constexpr, ZP: gl.constexpr, HAS_Z: gl.constexpr,
                       MODE: gl.constexpr = 0):
    """``out (1, N) = x (1, K) @ dequant(W)^T`` for int4 words in ``(KWP, NP)`` (``gemv_quant``'s layout),
    groups of ``8 TR`` columns; ``G`` groups (K = 8 TR G, specialised; ``GP``: G rounded up to a power of
    two); one program per SM."""
    NW: gl.constexpr = WR * WC
    RPT: gl.constexpr = TR // WR
    L3: gl.constexpr = gl.BlockedLayout([1, RPT, 4], [1, 1, 32], [WR, 1, WC], [2, 1, 0])
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])   # per (row of) the leading index
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    # -- this program's units [u0, u1) of the T = tiles x groups, column tile major
    T = n_tiles * G
    u0 = (pid * T) // P
    u1 = ((pid + 1) * T) // P
    n = u1 - u0

    w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, TR, BN], w_desc.layout)
    s_ring = gl.allocate_shared_memory(s_desc.dtype, [STAGES, 1, BN], s_desc.layout)
    z_ring = gl.allocate_shared_memory(z_desc.dtype, [STAGES, 1, BN], z_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float32, [GP * EPW, WR, RPT], X3)
    xs_smem = gl.allocate_shared_memory(gl.float32, [GP, WR, RPT], X3)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)

    # -- phase 1: the first STAGES units in flight, then x staged while they arrive
    for i in gl.static_range(STAGES):
        if i < n:
            _issue(w_desc, s_desc, z_desc, w_ring, s_ring, z_ring, ready, i, u0 + i, G, TR, BN, STAGES, HAS_Z)
    _stage_x(x_ptr, x_smem, xs_smem, G, GP, TR, WR, RPT, IW, NW)
    _cta_barrier()

    # -- phase 2: the units; a slot is refilled once every thread is done with it
    acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
    seg_start = u0
    for i in range(n):
        u = u0 + i
        st = i % STAGES
        t = u // G
        g = u - t * G
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        acc = _unit(acc, w_ring.index(st), s_ring.index(st), z_ring.index(st), x_smem, g, xs_smem.index(g),
                    ZP, HAS_Z, WR, RPT, BN, L3, MODE)
        _cta_barrier()
        if i + STAGES < n:
            _issue(w_desc, s_desc, z_desc, w_ring, s_ring, z_ring, ready, i + STAGES, u + STAGES, G, TR, BN,
                   STAGES, HAS_Z)
        # -- phase 3: at the end of a column tile or of the range, the segment's result
        if (g == G - 1) | (i == n - 1):
            _segment_end(acc, t, seg_start, u, u0, pid, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)
            acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
            seg_start = u + 1

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
