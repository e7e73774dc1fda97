"""Int4 GEMV for one row of x (M = 1): a stream-K grid, x staged once per program, lean arithmetic (Gluon).

The CUDA-core kernel of the tables (``gemv_quant.gemv_fma_kernel``) launches many small split-K
programs, re-reads and re-scales x for every tile and spends ~3.4 instructions per code
(``gemv-sass-count-sm90a.json``, ``docs/design/quant-gemv-triton.md``). This kernel:

* runs ``P`` programs (one or two per SM) over the ``T = tiles * G`` **units** (one group, ``TR = GS / 8``
  word rows, of ``BN`` columns), column tile major, each program an equal contiguous range
  (stream-K): every SM streams the same bytes, and a program's range crosses at most two column
  tiles partially;
* stages x of the program's groups in shared memory, as fp32 in the words' order and already multiplied
  by the power of two that turns a masked code into its product (below), with the sums of x per
  word row for the zero points;
* keeps the next ``AHEAD`` units' words, scales and zeros in flight in registers; no shared memory is
  written in the loop, so the warps of a program never wait for each other (a ring of shared memory
  filled by ``cp.async`` measured the same on the H200, and needs a CTA barrier per unit);
* costs per code one LOP3 and one FFMA (DQ=3 of ``gemv_common._codes``): the four bits of code ``e``,
  masked in place (codes 5..7 after one 16-bit shift of the word), read as fp32 are the subnormal
  ``q * 2^(pos - 149)``; x carries ``2^(149 - pos - 64)``, so every product is ``x q 2^-64`` (normal for
  ``|x q| >= 2^-62``), scaled back once per segment. As for that variant, ``|x|`` must stay below 2^43
  (the scaled x finite).

Tile layout: ``(WR, RPT, BN)``, ``WR`` warps along the word rows (``RPT`` rows each, in one thread) and
``WC`` warps along the columns (4 adjacent columns per thread: one 16-byte load per row). A unit's
row sum stays in the thread; the sum over the warp rows is done once per segment.

Segments (one program's units of one column tile): one that covers its tile stores the output; the
others publish their partial sums at the end of the program's range (slot ``2 pid`` for the range's
first segment, ``2 pid + 1`` for its last) and count arrivals per tile; the last program to arrive
adds the tile's partials in program order and stores (deterministic; the counter is reset by that
program, so no launch needs a zeroed buffer).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from . import load

cta_barrier = load("gluon_compat").cta_barrier
#: PDL: wait for the previous kernel (only the constant weight is read before), then let the next launch
_wait_for_producer = load("gluon_compat").wait_for_producer

#: products come out as ``x q 2^-DENORM_C`` (``gemv_common.DENORM_C``)
DENORM_C = gl.constexpr(64)
#: code positions per word (int4)
EPW = gl.constexpr(8)
#: partials the last program of a tile loads at once
FIXUP_LOADS = gl.constexpr(8)

if hasattr(gl.shared_memory_descriptor, "reinterpret"):   # Triton 3.9
    @gluon.jit
    def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return smem.reinterpret(dtype, shape, layout)
else:                                                        # Triton 3.6
    @gluon.jit
    def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _unit_offsets(u, stride_qk, G: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr,
                  RPT: gl.constexpr, L3: gl.constexpr):
    """Unit ``u``'s word offsets ``(WR, RPT, BN)`` and column mask, and its scale/zero offsets ``(WR, BN)``
    (the group's row, once per warp row) and their mask (columns past the padded row are not read)."""
    ROWS: gl.constexpr = gl.SliceLayout(1, L3)
    t = u // G
    g = u - t * G
    wr = gl.arange(0, WR, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    r = gl.arange(0, RPT, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    row = g * TR + gl.expand_dims(gl.expand_dims(wr * RPT, 1) + gl.expand_dims(r, 0), 2)
    col = t * BN + gl.expand_dims(gl.expand_dims(c, 0), 1)
    c2 = t * BN + gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(0, ROWS)), 0)
    wr2 = gl.expand_dims(gl.arange(0, WR, layout=gl.SliceLayout(1, ROWS)), 1)
    return row * stride_qk + col, col < stride_qk, g * stride_qk + c2 + 0 * wr2, (c2 < stride_qk) & (wr2 >= 0)


@gluon.jit
def _load_unit(qw_ptr, s_ptr, z_ptr, u, ok, stride_qk, G: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr,
               WR: gl.constexpr, RPT: gl.constexpr, HAS_Z: gl.constexpr, L3: gl.constexpr):
    """Unit ``u``'s words, scales and zeros into registers (nothing read where ``ok`` is false)."""
    wo, wm, so, sm = _unit_offsets(u, stride_qk, G, TR, BN, WR, RPT, L3)
    w = gl.load(qw_ptr + wo, mask=wm & ok, other=0)
    s = gl.load(s_ptr + so, mask=sm & ok, other=0.0)
    if HAS_Z:
        z = gl.load(z_ptr + so, mask=sm & ok, other=0.0)
    else:
        z = s
    return w, s, z


@gluon.constexpr_function
def _padded_lines(lines, warps):
    """``lines`` rounded up to a power of two and to at least one per thread (no thread holds a copy)."""
    return max(1 << (int(lines) - 1).bit_length(), 32 * int(warps))


@gluon.jit
def _prefetch_l2(qw_ptr, u_first, n_left, stride_qk, G: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr,
                 L2_AHEAD: gl.constexpr, NW: gl.constexpr):
    """Ask the L2 for the words of units ``u_first .. u_first + L2_AHEAD - 1`` (the first ``n_left`` of them
    exist): one ``prefetch.global.L2`` per 128-byte line of a unit's ``TR`` rows of ``BN`` columns, the lines
    spread over the program's threads. A hint: no register waits for it, nothing is read into the program."""
    LPR: gl.constexpr = BN // 32                        # 128-byte lines per word row of a unit
    LINES: gl.constexpr = L2_AHEAD * TR * LPR
    P2: gl.constexpr = _padded_lines(LINES, NW)
    idx = gl.arange(0, P2, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    j = idx // (TR * LPR)
    line = idx % (TR * LPR)
    u = u_first + j
    t = u // G
    col = t * BN + (line % LPR) * 32
    row = (u - t * G) * TR + line // LPR
    ok = (idx < LINES) & (j < n_left) & (col < stride_qk)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [qw_ptr + row * stride_qk + col, ok.to(gl.int32)], dtype=gl.int32,
                              is_pure=False, pack=1)


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
def _x_columns(u0, n, G: gl.constexpr, XS: gl.constexpr, BY_UNIT: gl.constexpr, TR: gl.constexpr,
               WR: gl.constexpr, RPT: gl.constexpr, IW: gl.constexpr, NW: gl.constexpr):
    """The columns of K that ``_stage_x`` stages, ``(XS, EPW, WR, RPT)`` in its load layout, and which slots are
    used: slot ``s``, code position ``e``, word row ``j = g TR + wr RPT + r`` of the slot's group g. ``BY_UNIT``:
    slot i holds the group of the program's i-th unit (``XS`` >= its units, which are at most G, so no group
    twice); else slot g holds group g (``XS`` >= G). Word row j's code e is column ``(j // IW) IW 8 + e IW + j % IW``."""
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, RPT], [1, EPW, 32 // EPW, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    e = _axis(EPW, 1, XL)
    slot = _axis(XS, 0, XL)
    if BY_UNIT:
        gg = (u0 + slot) % G
        used = slot < n
    else:
        gg = slot
        used = slot < G
    j = gg * TR + _axis(WR, 2, XL) * RPT + _axis(RPT, 3, XL)
    return (j // IW) * (IW * EPW) + e * IW + j % IW, used


@gluon.jit
def _x_store(xv, x_smem, xs_smem, XS: gl.constexpr, WR: gl.constexpr, RPT: gl.constexpr, NW: gl.constexpr):
    """Stage ``xv`` (fp32 x at ``_x_columns``' columns, 0 where unused): ``x_smem[slot EPW + e, wr, r]`` = x times
    ``2^(149 - pos_e - 64)`` (the factor of code position e), ``xs_smem[slot, wr, r]`` = the sum of x over that
    row's codes times ``2^-64``. One store for all slots: staged in pieces, each piece would wait for its loads
    behind the barrier the previous piece's stores need."""
    XL: gl.constexpr = gl.BlockedLayout([1, 1, 1, RPT], [1, EPW, 32 // EPW, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    e = _axis(EPW, 1, XL)
    # the power of two of code position e: positions 0..4 sit at bit 4e, 5..7 at 4e - 16 (shifted)
    pos = gl.where(e < 5, e * 4, e * 4 - 16)
    fac = ((149 - DENORM_C + 127 - pos) << 23).to(gl.float32, bitcast=True)
    # the buffers seen with a layout of full rank (the same bytes: unswizzled, row-major)
    F3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
    _view(x_smem, gl.float32, [XS * EPW, WR, RPT], F3).store(gl.reshape(xv * fac, [XS * EPW, WR, RPT]))
    _view(xs_smem, gl.float32, [XS, WR, RPT], F3).store(gl.sum(xv, axis=1) * (2.0 ** -DENORM_C))


@gluon.jit
def _stage_x(x_ptr, x_smem, xs_smem, u0, n, G: gl.constexpr, XS: gl.constexpr, BY_UNIT: gl.constexpr,
             TR: gl.constexpr, WR: gl.constexpr, RPT: gl.constexpr, IW: gl.constexpr, NW: gl.constexpr,
             CACHE: gl.constexpr):
    """x of the groups this program reads (``_x_columns``), loaded with cache modifier ``CACHE`` ("": default;
    ".cg" where x was written during this launch: L1 is not coherent) and staged (``_x_store``)."""
    k, used = _x_columns(u0, n, G, XS, BY_UNIT, TR, WR, RPT, IW, NW)
    xv = gl.load(x_ptr + k, mask=used, other=0.0, cache_modifier=CACHE).to(gl.float32)
    _x_store(xv, x_smem, xs_smem, XS, WR, RPT, NW)


@gluon.jit
def _row_sums(w, x_smem, xslot, L3: gl.constexpr):
    """``(WR, BN)``: per column, the sum over this thread's word rows of ``x q 2^-64`` for one unit's words
    ``w`` (x in slot ``xslot``): one LOP3 and one FFMA per code, x of a code position one broadcast load."""
    whi = w >> 16
    dot = gl.zeros(w.shape, gl.float32, L3)
    for e in gl.static_range(EPW):
        xe = x_smem.index(xslot * EPW + e).load(gl.SliceLayout(2, L3))
        if e < 5:
            q = (w & (15 << (4 * e))).to(gl.float32, bitcast=True)
        else:
            q = (whi & (15 << (4 * e - 16))).to(gl.float32, bitcast=True)
        dot += gl.expand_dims(xe, 2) * q
    return gl.sum(dot, axis=1)


@gluon.jit
def _scale_unit(acc, rs, s, z, xs_g, ZP: gl.constexpr, HAS_Z: gl.constexpr, L3: gl.constexpr):
    """``acc += s (rs - z sum x)`` with the unit's row sums ``rs``."""
    xs = gl.sum(xs_g.load(gl.SliceLayout(2, L3)), axis=1)
    xs = gl.expand_dims(gl.convert_layout(xs, gl.SliceLayout(1, gl.SliceLayout(1, L3))), 1)
    if HAS_Z:
        return acc + s.to(gl.float32) * (rs - z.to(gl.float32) * xs)
    else:
        return acc + s.to(gl.float32) * (rs - ZP * xs)


@gluon.jit
def _tile_sum(acc, L3: gl.constexpr):
    """A segment's ``(BN,)`` result: the sum over the warp rows, scaled back from ``2^-64``."""
    return gl.sum(acc, axis=0) * (2.0 ** DENORM_C)


@gluon.jit
def _store_tile(res, t, N, out_ptr, BN: gl.constexpr, L3: gl.constexpr):
    """Column tile ``t`` of the output (columns past N not written)."""
    cols = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    gl.store(out_ptr + cols, res.to(out_ptr.dtype.element_ty), mask=cols < N)


@gluon.jit
def _publish(res, ws_ptr, slot, BN: gl.constexpr, L3: gl.constexpr):
    """A partial ``(BN,)`` into workspace slot ``slot``."""
    gl.store(ws_ptr + slot * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), res)


@gluon.jit
def _arrive_sum(t, P, T, ws_ptr, cnt_ptr, G: gl.constexpr, BN: gl.constexpr, L3: gl.constexpr):
    """Count this program's (published) partial of tile ``t``; the last of the tile's programs adds the
    partials in program order and resets the counter. Returns ``(last, tile)``: whether this program is
    that one, and then the tile's ``(BN,)`` sum (zeros otherwise)."""
    arrived = gl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
    # programs whose ranges meet the tile: c(u) = ((u + 1) P - 1) // T owns unit u
    c_first = ((t * G + 1) * P - 1) // T
    c_last = ((t + 1) * G * P - 1) // T
    last = arrived == c_last - c_first
    offs = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    tot = gl.zeros([BN], gl.float32, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    if last:
        for c0 in range(c_first, c_last + 1, FIXUP_LOADS):
            for k in gl.static_range(FIXUP_LOADS):   # independent loads: one latency per FIXUP_LOADS partials
                cc = c0 + k
                sl = gl.where((cc * T) // P >= t * G, 0, 1)   # 0: cc's range starts inside the tile
                tot += gl.load(ws_ptr + (cc * 2 + sl) * BN + offs, mask=(offs >= 0) & (cc <= c_last), other=0.0,
                               cache_modifier=".cg")
        gl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed")
    return last, tot


@gluon.jit
def _arrive(t, P, T, N, out_ptr, ws_ptr, cnt_ptr, G: gl.constexpr, BN: gl.constexpr, L3: gl.constexpr):
    """``_arrive_sum``, and the last of the tile's programs stores the tile. Returns whether this program did."""
    last, tot = _arrive_sum(t, P, T, ws_ptr, cnt_ptr, G, BN, L3)
    if last:
        _store_tile(tot, t, N, out_ptr, BN, L3)
    return last


@gluon.jit
def gemv_stream_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, N, n_tiles, stride_qk,
                       G: gl.constexpr, XS: gl.constexpr, BY_UNIT: gl.constexpr, TR: gl.constexpr,
                       BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, AHEAD: gl.constexpr, IW: gl.constexpr,
                       ZP: gl.constexpr, HAS_Z: gl.constexpr, PDL: gl.constexpr, L2_AHEAD: gl.constexpr,
                       MODE: gl.constexpr):
    """``out (1, N) = x (1, K) @ dequant(W)^T`` for int4 words in ``(KWP, NP)`` (``gemv_quant``'s layout,
    ``stride_qk`` = NP), groups of ``8 TR`` columns; ``G`` groups (K = 8 TR G, specialised); ``XS`` slots of
    staged x (``_stage_x``). ``AHEAD``: units loaded ahead (1 or 2). ``L2_AHEAD``: units after those whose
    words the L2 is asked to fetch before the wait for the previous kernel (0: none). ``MODE`` (measurement only,
    the kernel's anatomy in ``docs/design/quant-gemv-triton.md``; 0 in use): 1 = words folded into the result
    without arithmetic, 3 = x not staged, 4 = every segment stored as if it covered its tile (no
    partials); 1, 3 and 4 give wrong results."""
    NW: gl.constexpr = WR * WC
    RPT: gl.constexpr = TR // WR
    L3: gl.constexpr = gl.BlockedLayout([1, RPT, 4], [1, 1, 32], [WR, 1, WC], [2, 1, 0])
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])   # per leading index
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    # -- this program's units [u0, u1) of the T = tiles x groups, column tile major
    T = n_tiles * G
    u0 = (pid * T) // P
    n = ((pid + 1) * T) // P - u0
    x_smem = gl.allocate_shared_memory(gl.float32, [XS * EPW, WR, RPT], X3)
    xs_smem = gl.allocate_shared_memory(gl.float32, [XS, WR, RPT], X3)

    # -- phase 1: the first units in flight (the weight is constant: before waiting for the
    #    previous kernel), then x staged while they arrive
    w0, s0, z0 = _load_unit(qw_ptr, s_ptr, z_ptr, u0, 0 < n, stride_qk, G, TR, BN, WR, RPT, HAS_Z, L3)
    if AHEAD > 1:
        w1, s1, z1 = _load_unit(qw_ptr, s_ptr, z_ptr, u0 + 1, 1 < n, stride_qk, G, TR, BN, WR, RPT, HAS_Z, L3)
    if L2_AHEAD > 0:     # the next units' words towards the L2 while the previous kernel finishes
        _prefetch_l2(qw_ptr, u0 + AHEAD, n - AHEAD, stride_qk, G, TR, BN, L2_AHEAD, NW)
    _wait_for_producer(PDL)
    if MODE != 3:
        _stage_x(x_ptr, x_smem, xs_smem, u0, n, G, XS, BY_UNIT, TR, WR, RPT, IW, NW, "")
    cta_barrier()

    # -- phase 2: the units, the next ones' loads in flight
    acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
    head = gl.zeros([BN], gl.float32, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    t_head = -1          # the range's first segment, when partial: published at the end
    seg_start = u0
    for i in range(n):
        u = u0 + i
        t = u // G
        g = u - t * G
        # -- the loads of unit i + AHEAD go out before unit i is multiplied
        wn, sn, zn = _load_unit(qw_ptr, s_ptr, z_ptr, u + AHEAD, i + AHEAD < n, stride_qk, G, TR, BN, WR, RPT,
                                HAS_Z, L3)
        w, s, z = w0, s0, z0
        if AHEAD > 1:
            w0, s0, z0 = w1, s1, z1
            w1, s1, z1 = wn, sn, zn
        else:
            w0, s0, z0 = wn, sn, zn
        if MODE != 1:
            xslot = i if BY_UNIT else g
            acc = _scale_unit(acc, _row_sums(w, x_smem, xslot, L3), s, z, xs_smem.index(xslot), ZP, HAS_Z, L3)
        else:
            acc += gl.sum(w, axis=1).to(gl.float32, bitcast=True)
        # -- phase 3: a segment ends at its tile's end or the range's
        if (g == G - 1) | (i == n - 1):
            res = _tile_sum(acc, L3)
            whole = (seg_start == t * G) & (u + 1 == (t + 1) * G)
            if MODE == 4:
                whole = u >= 0                                              # measurement: no partials
            if whole:
                _store_tile(res, t, N, out_ptr, BN, L3)                     # the whole tile: no partials
            elif seg_start == u0:
                head = res                                                  # published at the end
                t_head = t
            else:
                _publish(res, ws_ptr, 2 * pid + 1, BN, L3)
                if t_head >= 0:
                    _publish(head, ws_ptr, 2 * pid, BN, L3)
                cta_barrier()
                if t_head >= 0:
                    _arrive(t_head, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)
                _arrive(t, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)
                t_head = -1
            acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
            seg_start = u + 1
    # -- a range of one partial segment: its partial is the head
    if t_head >= 0:
        _publish(head, ws_ptr, 2 * pid, BN, L3)
        cta_barrier()
        _arrive(t_head, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)

