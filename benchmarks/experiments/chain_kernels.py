"""Gluon kernels of the GEMV-chain experiments (``gemv_chain.py``, ``layer_chain.py``, ``step_chain.py``): int4
M=1 GEMVs -- and the decode step's glue and paged attention -- run as phases of ONE persistent launch.

Kernels: ``gemv_chain_kernel`` (layers x four GEMVs, nothing else), ``layer_chain_kernel`` (a layer after its
attention, glue included), ``decode_layer_kernel`` (a whole layer, the attention its first phase),
``decode_step_kernel`` (every layer, a loop over ``decode_layer_kernel``'s phases).

Each program walks its stream-K range of a phase exactly as the backend's stream kernel does
(``backends/triton/kernels/gemv_stream.py``, whose helpers are called here); when its range is done it issues
the first units' weight loads of the next phase (constant data) and only then spins until every column tile of
the previous phase is stored, so DRAM is not left idle between two GEMVs and nothing is launched.

* Completion: the program that finishes a tile (a whole-tile segment, or the last to arrive at a shared tile)
  applies the phase's epilogue and counts the tile in the phase's ``done`` counter (CTA barrier, release); a
  program starting a phase waits for the previous phase's count to reach that phase's tile count (acquire),
  then forms its x with ``.cg`` loads (L1 is not coherent: an earlier phase's values may sit there). A bounded
  spin raises ``err`` instead of hanging the GPU; once raised, no later wait spins. The last program to leave
  resets the counters.
* Every program owns at least one unit of every phase (the host caps the grid at the smallest phase's units),
  so a phase's completion implies every program has passed its wait for -- and formed its x from -- the phase
  before: buffers are reused across phases and layers without races.
* Prologues (how a phase forms x): ``PRO_PLAIN`` x as stored; ``PRO_NORM`` ``bf16(bf16(r rsqrt(mean r^2 + eps))
  w)`` of the fp32 residual ``r`` with the mean from the per-tile sums of squares ``ss`` (the decode step's
  RMSNorm); ``PRO_GLU`` ``bf16(silu(gate) up)`` of the (gate | up) output before it (its SiLU-mul).
* Epilogues (what the finisher of a tile does): ``EPI_STORE`` store it (bf16); ``EPI_RESID`` ``r += bf16(tile)``
  and the tile's sum of squares into ``ss[t]`` (the residual add; no output); ``EPI_ROPE`` store it, then
  rotate its two heads (half-split RoPE) into q, or the new token's k row, or copy v (the qkv projection's RoPE
  and KV-cache append; tiles of 256 columns are two heads of 128).
* The attention phase (``_attn_phase``): items (page, KV head) over the programs, each writing its query heads'
  unnormalised page softmax as partials; the last item of a KV head to arrive merges the head and counts it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from portakern.backends.triton import kernels

_S = kernels.load("gemv_stream")            # the stream kernel's helpers (jit flavour)
cta_barrier = kernels.load("gluon_compat").cta_barrier

PRO_PLAIN, PRO_NORM, PRO_GLU = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
EPI_STORE, EPI_RESID, EPI_ROPE = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
#: counters the pure chain can reset (4 per layer)
MAX_PHASES = gl.constexpr(512)
#: RoPE epilogue: column tiles of q (32 heads) and of k (8 heads) in the qkv output, head size
Q_TILES, K_TILES, HEAD = gl.constexpr(16), gl.constexpr(4), gl.constexpr(128)
#: Cycle counts kept after the error flag ``err[0]``: ``err[1 + kind P + p]`` the cycles program p spent waiting
#: before phases of ``kind`` (a GEMV phase's ``3 PRO + EPI``, ``ATTN_KIND`` the attention, ``PDL_KIND`` the launch's
#: first phase waiting for the previous kernel), ``err[1 + STAT_KINDS P + p]`` its cycles from start to leave; int32
#: sums that wrap (read modulo 2^32: ``gemv_chain.wait_profile``)
STAT_KINDS, ATTN_KIND, PDL_KIND = gl.constexpr(11), gl.constexpr(9), gl.constexpr(10)


@gluon.jit
def _clock():
    """The SM's cycle counter (low 32 bits: differences taken modulo 2^32)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _count_cycles(err_ptr, slot, cycles):
    """Add ``cycles`` to this program's statistics slot ``slot`` (0 .. STAT_KINDS) after the error flag."""
    gl.atomic_add(err_ptr + 1 + slot * gl.num_programs(0) + gl.program_id(0), cycles, sem="relaxed")


@gluon.jit
def _wait_phase(done_ptr, need, err_ptr, SPIN_LIMIT: gl.constexpr, KIND: gl.constexpr):
    """Spin until ``done_ptr`` counts ``need`` stored tiles of the previous phase (acquire); after ``SPIN_LIMIT``
    polls give up and raise the error flag (a wrong result rather than a hung GPU); once the flag is up, no
    later wait spins at all. The cycles spent here count towards statistics slot ``KIND``."""
    t0 = _clock()
    seen = gl.atomic_add(done_ptr, 0, sem="acquire")
    polls = gl.where(gl.atomic_add(err_ptr, 0, sem="relaxed") != 0, SPIN_LIMIT, 0)
    while (seen < need) & (polls < SPIN_LIMIT):
        seen = gl.atomic_add(done_ptr, 0, sem="acquire")
        polls += 1
    if seen < need:
        gl.atomic_xchg(err_ptr, 1)
    _count_cycles(err_ptr, KIND, _clock() - t0)


@gluon.jit
def _wait_producer(err_ptr, PDL: gl.constexpr):
    """The launch's first phase: wait for the previous kernel (PDL), the cycles counted as ``PDL_KIND``."""
    t0 = _clock()
    _S._wait_for_producer(PDL)
    _count_cycles(err_ptr, PDL_KIND, _clock() - t0)


@gluon.jit
def _stage_pro(x_ptr, r_ptr, ss_ptr, nw_ptr, x_smem, xs_smem, u0, n, G: gl.constexpr, XS: gl.constexpr,
               BY_UNIT: gl.constexpr, TR: gl.constexpr, WR: gl.constexpr, RPT: gl.constexpr, IW: gl.constexpr,
               NW: gl.constexpr, PRO: gl.constexpr, NSS: gl.constexpr, EPS: gl.constexpr):
    """Stage the phase's x for this program's groups (``_S._x_columns`` / ``_S._x_store``), formed as ``PRO`` says;
    K = 128 G. ``PRO_NORM`` sums the ``NSS`` per-tile squares in tile order (deterministic)."""
    k, used = _S._x_columns(u0, n, G, XS, BY_UNIT, TR, WR, RPT, IW, NW)
    if PRO == 1:
        SL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        ss = gl.sum(gl.load(ss_ptr + gl.arange(0, NSS, layout=SL), cache_modifier=".cg"), axis=0)
        inv = gl.rsqrt(ss / (G * 128) + EPS)
        r = gl.load(r_ptr + k, mask=used, other=0.0, cache_modifier=".cg")
        w = gl.load(nw_ptr + k, mask=used, other=0.0).to(gl.float32)
        xv = ((r * inv).to(gl.bfloat16).to(gl.float32) * w).to(gl.bfloat16).to(gl.float32)
    elif PRO == 2:
        gate = gl.load(x_ptr + k, mask=used, other=0.0, cache_modifier=".cg").to(gl.float32)
        up = gl.load(x_ptr + G * 128 + k, mask=used, other=0.0, cache_modifier=".cg").to(gl.float32)
        xv = (gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16).to(gl.float32)
    else:
        xv = gl.load(x_ptr + k, mask=used, other=0.0, cache_modifier=".cg").to(gl.float32)
    _S._x_store(xv, x_smem, xs_smem, XS, WR, RPT, NW)


@gluon.jit
def _rope_tile(out_ptr, t, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, NW: gl.constexpr):
    """Tile ``t`` of the stored qkv output (two heads): q and k heads rotated (half split, fp32, as the step's
    torch RoPE) into ``q_ptr`` / ``k_ptr``, v heads copied to ``v_ptr``."""
    RL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    idx = gl.arange(0, HEAD, layout=RL)             # (head of the tile, rotation index)
    i = idx % (HEAD // 2)
    src = out_ptr + t * (2 * HEAD) + (idx // (HEAD // 2)) * HEAD + i
    lo = gl.load(src, cache_modifier=".cg").to(gl.float32)
    hi = gl.load(src + HEAD // 2, cache_modifier=".cg").to(gl.float32)
    c = gl.load(cos_ptr + i)
    s = gl.load(sin_ptr + i)
    a = lo * c - hi * s
    b = hi * c + lo * s
    off = (idx // (HEAD // 2)) * HEAD + i
    if t < Q_TILES:
        dst = q_ptr + t * (2 * HEAD) + off
    elif t < Q_TILES + K_TILES:
        dst = k_ptr + (t - Q_TILES) * (2 * HEAD) + off
    else:
        dst = v_ptr + (t - Q_TILES - K_TILES) * (2 * HEAD) + off
        a = lo
        b = hi
    gl.store(dst, a.to(dst.dtype.element_ty))
    gl.store(dst + HEAD // 2, b.to(dst.dtype.element_ty))


@gluon.jit
def _finish_tile(res, t, N, out_ptr, r_ptr, ss_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, done_ptr,
                 BN: gl.constexpr, L3: gl.constexpr, EPI: gl.constexpr, NW: gl.constexpr):
    """Tile ``t``'s sum ``res`` (``(BN,)``, fp32) through the phase's epilogue, then counted as done."""
    if EPI == 1:
        # a read-modify-write of the residual: in a layout without copies (in L3's slice the warps hold copies
        # of the tile, and a copy whose read came late could see its column already updated, then add again
        # into the sum of squares), each column read, added and written back by one thread
        RL: gl.constexpr = gl.BlockedLayout([BN // (32 * NW)], [32], [NW], [0])
        res = gl.convert_layout(res, RL)
        cols = t * BN + gl.arange(0, BN, layout=RL)
        m = cols < N
        rn = gl.load(r_ptr + cols, mask=m, other=0.0, cache_modifier=".cg") + res.to(gl.bfloat16).to(gl.float32)
        gl.store(r_ptr + cols, rn, mask=m)
        gl.store(ss_ptr + t, gl.sum(gl.where(m, rn * rn, 0.0), axis=0))
    else:
        _S._store_tile(res, t, N, out_ptr, BN, L3)
        if EPI == 2:
            cta_barrier()                               # the tile's stores, read back by other threads
            _rope_tile(out_ptr, t, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, NW)
    cta_barrier()                                       # every thread's stores before the count
    gl.atomic_add(done_ptr, 1, sem="release")


@gluon.jit
def _phase(idx, x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, r_ptr, ss_ptr, nw_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
           ws_ptr, cnt_ptr, done_ptr, prev_need, err_ptr, N, n_tiles, stride_qk, pid, P,
           G: gl.constexpr, XS: gl.constexpr, BY_UNIT: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr,
           WR: gl.constexpr, WC: gl.constexpr, AHEAD: gl.constexpr, IW: gl.constexpr, ZP: gl.constexpr,
           HAS_Z: gl.constexpr, L2_AHEAD: gl.constexpr, PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr,
           PRO: gl.constexpr, EPI: gl.constexpr, NSS: gl.constexpr, EPS: gl.constexpr):
    """One GEMV of a chain (phase ``idx`` of the launch; its counter is ``done_ptr``, the previous phase's
    ``done_ptr - 1`` with ``prev_need`` tiles): the stream kernel's program ``pid``, its wait for the previous
    kernel replaced by the wait for the previous phase (phase 0 waits for the previous kernel: PDL), x formed
    by ``PRO`` and finished tiles through ``EPI``."""
    NW: gl.constexpr = WR * WC
    RPT: gl.constexpr = TR // WR
    L3: gl.constexpr = gl.BlockedLayout([1, RPT, 4], [1, 1, 32], [WR, 1, WC], [2, 1, 0])
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    T = n_tiles * G
    u0 = (pid * T) // P
    n = ((pid + 1) * T) // P - u0
    x_smem = gl.allocate_shared_memory(gl.float32, [XS * 8, WR, RPT], X3)
    xs_smem = gl.allocate_shared_memory(gl.float32, [XS, WR, RPT], X3)

    # -- the first units' words in flight (constant), then the wait for the phase (or kernel) before
    w0, s0, z0 = _S._load_unit(qw_ptr, s_ptr, z_ptr, u0, 0 < n, stride_qk, G, TR, BN, WR, RPT, HAS_Z, L3)
    if AHEAD > 1:
        w1, s1, z1 = _S._load_unit(qw_ptr, s_ptr, z_ptr, u0 + 1, 1 < n, stride_qk, G, TR, BN, WR, RPT, HAS_Z, L3)
    if L2_AHEAD > 0:
        _S._prefetch_l2(qw_ptr, u0 + AHEAD, n - AHEAD, stride_qk, G, TR, BN, L2_AHEAD, NW)
    if idx == 0:
        _wait_producer(err_ptr, PDL)
    else:
        _wait_phase(done_ptr - 1, prev_need, err_ptr, SPIN_LIMIT, PRO * 3 + EPI)
    _stage_pro(x_ptr, r_ptr, ss_ptr, nw_ptr, x_smem, xs_smem, u0, n, G, XS, BY_UNIT, TR, WR, RPT, IW, NW, PRO, NSS,
               EPS)
    cta_barrier()

    # -- the units (the stream kernel's loop), finished tiles through the epilogue
    acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
    head = gl.zeros([BN], gl.float32, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    t_head = -1
    seg_start = u0
    for i in range(n):
        u = u0 + i
        t = u // G
        g = u - t * G
        wn, sn, zn = _S._load_unit(qw_ptr, s_ptr, z_ptr, u + AHEAD, i + AHEAD < n, stride_qk, G, TR, BN, WR, RPT,
                                   HAS_Z, L3)
        w, s, z = w0, s0, z0
        if AHEAD > 1:
            w0, s0, z0 = w1, s1, z1
            w1, s1, z1 = wn, sn, zn
        else:
            w0, s0, z0 = wn, sn, zn
        xslot = i if BY_UNIT else g
        acc = _S._scale_unit(acc, _S._row_sums(w, x_smem, xslot, L3), s, z, xs_smem.index(xslot), ZP, HAS_Z, L3)
        if (g == G - 1) | (i == n - 1):
            res = _S._tile_sum(acc, L3)
            if (seg_start == t * G) & (u + 1 == (t + 1) * G):
                _finish_tile(res, t, N, out_ptr, r_ptr, ss_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, done_ptr, BN,
                             L3, EPI, NW)
            elif seg_start == u0:
                head = res
                t_head = t
            else:
                _S._publish(res, ws_ptr, 2 * pid + 1, BN, L3)
                if t_head >= 0:
                    _S._publish(head, ws_ptr, 2 * pid, BN, L3)
                cta_barrier()
                if t_head >= 0:
                    last, tot = _S._arrive_sum(t_head, P, T, ws_ptr, cnt_ptr, G, BN, L3)
                    if last:
                        _finish_tile(tot, t_head, N, out_ptr, r_ptr, ss_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
                                     done_ptr, BN, L3, EPI, NW)
                last, tot = _S._arrive_sum(t, P, T, ws_ptr, cnt_ptr, G, BN, L3)
                if last:
                    _finish_tile(tot, t, N, out_ptr, r_ptr, ss_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, done_ptr,
                                 BN, L3, EPI, NW)
                t_head = -1
            acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
            seg_start = u + 1
    if t_head >= 0:
        _S._publish(head, ws_ptr, 2 * pid, BN, L3)
        cta_barrier()
        last, tot = _S._arrive_sum(t_head, P, T, ws_ptr, cnt_ptr, G, BN, L3)
        if last:
            _finish_tile(tot, t_head, N, out_ptr, r_ptr, ss_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, done_ptr, BN,
                         L3, EPI, NW)


@gluon.jit
def _leave(done_ptr, exit_ptr, err_ptr, n_phases, P, t_start, NW: gl.constexpr):
    """The last program out resets the launch's ``n_phases`` phase counters and the exit counter; every program
    adds its cycles since ``t_start`` (its first clock read) to its statistics."""
    _count_cycles(err_ptr, STAT_KINDS, _clock() - t_start)
    cta_barrier()
    left = gl.atomic_add(exit_ptr, 1, sem="acq_rel")
    if left == P - 1:
        offs = gl.arange(0, MAX_PHASES, layout=gl.BlockedLayout([1], [32], [NW], [0]))
        gl.store(done_ptr + offs, gl.zeros_like(offs), mask=offs < n_phases)
        gl.atomic_xchg(exit_ptr, 0)


@gluon.jit
def gemv_chain_kernel(qw0, s0, z0, o0, qw1, s1, z1, o1, qw2, s2, z2, o2, qw3, s3, z3, o3,
                      ws_ptr, cnt_ptr, done_ptr, exit_ptr, err_ptr, layers,
                      N0, T0, SQ0, LW0, LS0, N1, T1, SQ1, LW1, LS1, N2, T2, SQ2, LW2, LS2, N3, T3, SQ3, LW3, LS3,
                      G0: gl.constexpr, XS0: gl.constexpr, BY0: gl.constexpr,
                      G1: gl.constexpr, XS1: gl.constexpr, BY1: gl.constexpr,
                      G2: gl.constexpr, XS2: gl.constexpr, BY2: gl.constexpr,
                      G3: gl.constexpr, XS3: gl.constexpr, BY3: gl.constexpr,
                      TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, AHEAD: gl.constexpr,
                      IW: gl.constexpr, ZP: gl.constexpr, HAS_Z: gl.constexpr, L2_AHEAD: gl.constexpr,
                      PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr):
    """The GEMVs alone: ``layers`` x (o, gate/up, down, qkv), phase j of layer l reading x as stored by phase
    j - 1 (``o3`` for j = 0: the chain starts from whatever the qkv buffer holds) and its weight at ``qwj + l LWj``
    (scales and zeros at ``+ l LSj``); ``Nj``, ``Tj`` (column tiles) and ``SQj`` (row stride of the words)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    t_start = _clock()          # kept in a register: nothing is written before the PDL wait
    for l in range(layers):
        lw = l.to(gl.int64)
        b = 4 * l
        _phase(b, o3, qw0 + lw * LW0, s0 + lw * LS0, z0 + lw * LS0, o0, ws_ptr, ws_ptr, o0, o0, o0, o0, ws_ptr, ws_ptr,
               ws_ptr, cnt_ptr, done_ptr + b, T3, err_ptr, N0, T0, SQ0, pid, P, G0, XS0, BY0, TR, BN, WR, WC, AHEAD,
               IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_PLAIN, EPI_STORE, 1, 0.0)
        _phase(b + 1, o0, qw1 + lw * LW1, s1 + lw * LS1, z1 + lw * LS1, o1, ws_ptr, ws_ptr, o1, o1, o1, o1, ws_ptr,
               ws_ptr, ws_ptr, cnt_ptr, done_ptr + b + 1, T0, err_ptr, N1, T1, SQ1, pid, P, G1, XS1, BY1, TR, BN, WR,
               WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_PLAIN, EPI_STORE, 1, 0.0)
        _phase(b + 2, o1, qw2 + lw * LW2, s2 + lw * LS2, z2 + lw * LS2, o2, ws_ptr, ws_ptr, o2, o2, o2, o2, ws_ptr,
               ws_ptr, ws_ptr, cnt_ptr, done_ptr + b + 2, T1, err_ptr, N2, T2, SQ2, pid, P, G2, XS2, BY2, TR, BN, WR,
               WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_PLAIN, EPI_STORE, 1, 0.0)
        _phase(b + 3, o2, qw3 + lw * LW3, s3 + lw * LS3, z3 + lw * LS3, o3, ws_ptr, ws_ptr, o3, o3, o3, o3, ws_ptr,
               ws_ptr, ws_ptr, cnt_ptr, done_ptr + b + 3, T2, err_ptr, N3, T3, SQ3, pid, P, G3, XS3, BY3, TR, BN, WR,
               WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_PLAIN, EPI_STORE, 1, 0.0)
    _leave(done_ptr, exit_ptr, err_ptr, 4 * layers, P, t_start, WR * WC)


@gluon.jit
def _layer_gemvs(BASE: gl.constexpr, first_need, a_ptr, qw0, s0, z0, qw1, s1, z1, gu_ptr, qw2, s2, z2, qw3, s3, z3,
                 o3, r_ptr, ss_ptr, nw1_ptr, nw3_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr, cnt_ptr, done_ptr,
                 err_ptr, N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3, pid, P,
                 G0: gl.constexpr, XS0: gl.constexpr, BY0: gl.constexpr, G1: gl.constexpr, XS1: gl.constexpr,
                 BY1: gl.constexpr, G2: gl.constexpr, XS2: gl.constexpr, BY2: gl.constexpr, G3: gl.constexpr,
                 XS3: gl.constexpr, BY3: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr,
                 WC: gl.constexpr, AHEAD: gl.constexpr, IW: gl.constexpr, ZP: gl.constexpr, HAS_Z: gl.constexpr,
                 L2_AHEAD: gl.constexpr, PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr, EPI3: gl.constexpr,
                 NSS: gl.constexpr, EPS: gl.constexpr):
    """A decode layer's four GEMV phases as the launch's phases ``BASE`` .. ``BASE + 3`` (the first waits for
    ``first_need`` counts of phase ``BASE - 1``, or for the previous kernel when ``BASE`` is 0): o on ``a``
    (+ residual add), gate/up on RMSNorm(r) into ``gu``, down on SiLU-mul(gu) (+ residual add), and on RMSNorm(r)
    the next layer's qkv with RoPE and the KV append or the lm head (``EPI3``) into ``o3``."""
    _phase(BASE, a_ptr, qw0, s0, z0, o3, r_ptr, ss_ptr, nw1_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr,
           cnt_ptr, done_ptr + BASE, first_need, err_ptr, N0, T0, SQ0, pid, P, G0, XS0, BY0, TR, BN, WR, WC, AHEAD, IW,
           ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_PLAIN, EPI_RESID, NSS, EPS)
    _phase(BASE + 1, a_ptr, qw1, s1, z1, gu_ptr, r_ptr, ss_ptr, nw1_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr,
           cnt_ptr, done_ptr + BASE + 1, T0, err_ptr, N1, T1, SQ1, pid, P, G1, XS1, BY1, TR, BN, WR, WC, AHEAD, IW, ZP,
           HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_NORM, EPI_STORE, NSS, EPS)
    _phase(BASE + 2, gu_ptr, qw2, s2, z2, o3, r_ptr, ss_ptr, nw1_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr,
           cnt_ptr, done_ptr + BASE + 2, T1, err_ptr, N2, T2, SQ2, pid, P, G2, XS2, BY2, TR, BN, WR, WC, AHEAD, IW, ZP,
           HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_GLU, EPI_RESID, NSS, EPS)
    _phase(BASE + 3, a_ptr, qw3, s3, z3, o3, r_ptr, ss_ptr, nw3_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr,
           cnt_ptr, done_ptr + BASE + 3, T2, err_ptr, N3, T3, SQ3, pid, P, G3, XS3, BY3, TR, BN, WR, WC, AHEAD, IW, ZP,
           HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, PRO_NORM, EPI3, NSS, EPS)


@gluon.jit
def layer_chain_kernel(a_ptr, qw0, s0, z0, qw1, s1, z1, gu_ptr, qw2, s2, z2, qw3, s3, z3, o3,
                       r_ptr, ss_ptr, nw1_ptr, nw3_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
                       ws_ptr, cnt_ptr, done_ptr, exit_ptr, err_ptr,
                       N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3,
                       G0: gl.constexpr, XS0: gl.constexpr, BY0: gl.constexpr,
                       G1: gl.constexpr, XS1: gl.constexpr, BY1: gl.constexpr,
                       G2: gl.constexpr, XS2: gl.constexpr, BY2: gl.constexpr,
                       G3: gl.constexpr, XS3: gl.constexpr, BY3: gl.constexpr,
                       TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, AHEAD: gl.constexpr,
                       IW: gl.constexpr, ZP: gl.constexpr, HAS_Z: gl.constexpr, L2_AHEAD: gl.constexpr,
                       PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr, EPI3: gl.constexpr, NSS: gl.constexpr,
                       EPS: gl.constexpr):
    """A decode layer after its attention, glue included: o (x = the attention output ``a``; residual add into
    ``r``), gate/up (x = RMSNorm(r) with ``nw1``; output ``gu``), down (x = SiLU-mul of ``gu``; residual add), and
    phase 3 (x = RMSNorm(r) with ``nw3``): the next layer's qkv with RoPE and the KV append (``EPI3`` =
    ``EPI_ROPE``: q into ``q_ptr``, k / v rows into ``k_ptr`` / ``v_ptr``, the raw qkv into ``o3``) or the lm head
    (``EPI_STORE`` into ``o3``). ``ss`` holds the residual's ``NSS`` per-tile sums of squares."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    t_start = _clock()          # kept in a register: nothing is written before the PDL wait
    _layer_gemvs(0, 0, a_ptr, qw0, s0, z0, qw1, s1, z1, gu_ptr, qw2, s2, z2, qw3, s3, z3, o3, r_ptr, ss_ptr, nw1_ptr,
                 nw3_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr, cnt_ptr, done_ptr, err_ptr,
                 N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3, pid, P, G0, XS0, BY0, G1, XS1, BY1, G2, XS2, BY2,
                 G3, XS3, BY3, TR, BN, WR, WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, EPI3, NSS, EPS)
    _leave(done_ptr, exit_ptr, err_ptr, 4, P, t_start, WR * WC)


# -- the paged decode attention as a phase (decode_layer_kernel) ---------------------------------------------------

@gluon.jit
def _attn_item(q_ptr, kv_ptr, bt_ptr, part_ptr, w, seqlen, kv_plane, HKV: gl.constexpr, QG: gl.constexpr,
               PAGE: gl.constexpr, D: gl.constexpr, NPMAX: gl.constexpr, NW: gl.constexpr, SM_SCALE: gl.constexpr):
    """Item ``w`` = (page ``p`` of the sequence, KV head ``hk``): for each of the ``QG`` query heads of ``hk``, the
    softmax of its scores over the page's keys (past ``seqlen`` masked), unnormalised: ``acc = sum_j e_j v_j``,
    ``m`` (the largest score) and ``l = sum_j e_j``, ``e_j = exp(s_j - m)``, written as row ``(hq, p)`` of
    ``part`` (``D`` + 2 floats: acc, m, l). The cache is ``(2, pages, PAGE, HKV, D)`` (``kv_plane`` elements per
    plane), its pages named by ``bt_ptr``; q is ``(HKV QG, D)``, rotated."""
    KL: gl.constexpr = gl.BlockedLayout([PAGE // (2 * NW), D // 16], [2, 16], [NW, 1], [1, 0])   # (PAGE, D)
    hk = w % HKV
    p = w // HKV
    page = gl.load(bt_ptr + p)
    key = gl.arange(0, PAGE, layout=gl.SliceLayout(1, KL))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, KL))
    valid = (p * PAGE + key) < seqlen
    offs = ((page.to(gl.int64) * PAGE + key) * (HKV * D) + hk * D)[:, None] + d[None, :]
    k = gl.load(kv_ptr + offs, mask=valid[:, None], other=0.0, cache_modifier=".cg").to(gl.float32)
    v = gl.load(kv_ptr + kv_plane + offs, mask=valid[:, None], other=0.0, cache_modifier=".cg").to(gl.float32)
    for j in gl.static_range(QG):
        hq = hk * QG + j
        q = gl.load(q_ptr + hq * D + d, cache_modifier=".cg").to(gl.float32)
        s = gl.where(valid, gl.sum(k * q[None, :], axis=1) * SM_SCALE, float("-inf"))      # (PAGE,)
        m = gl.max(s, axis=0)
        e = gl.exp(s - m)
        row = part_ptr + (hq * NPMAX + p) * (D + 2)
        gl.store(row + d, gl.sum(v * e[:, None], axis=0))
        gl.store(row + D, m)
        gl.store(row + D + 1, gl.sum(e, axis=0))


@gluon.jit
def _attn_merge(part_ptr, a_ptr, hk, NP, QG: gl.constexpr, D: gl.constexpr, NPMAX: gl.constexpr, NW: gl.constexpr):
    """The attention output of KV head ``hk``'s query heads from their ``NP`` page partials: weights
    ``exp(m_p - M)`` (M the largest m), ``a = sum_p w_p acc_p / sum_p w_p l_p``, stored as bf16 at ``hq D + d``."""
    M2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, NW], [1, 0])                          # (QG, NPMAX)
    C3: gl.constexpr = gl.BlockedLayout([QG, 4, D // 32], [1, 1, 32], [1, NW, 1], [2, 1, 0])       # (QG, 4 NW, D)
    CH: gl.constexpr = 4 * NW
    # -- M per query head over every page (one load of the m column)
    hq2 = hk * QG + gl.arange(0, QG, layout=gl.SliceLayout(1, M2))
    p2 = gl.arange(0, NPMAX, layout=gl.SliceLayout(0, M2))
    mcol = gl.load(part_ptr + (hq2[:, None] * NPMAX + p2[None, :]) * (D + 2) + D, mask=p2[None, :] < NP,
                   other=float("-inf"), cache_modifier=".cg")
    big = gl.convert_layout(gl.max(mcol, axis=1), gl.SliceLayout(1, gl.SliceLayout(2, C3)))
    # -- the weighted sums, CH pages at a time
    hq3 = hk * QG + gl.arange(0, QG, layout=gl.SliceLayout(1, gl.SliceLayout(2, C3)))
    pc = gl.arange(0, CH, layout=gl.SliceLayout(0, gl.SliceLayout(2, C3)))
    d3 = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, C3)))
    num = gl.zeros([QG, D], gl.float32, gl.SliceLayout(1, C3))
    den = gl.zeros([QG], gl.float32, gl.SliceLayout(1, gl.SliceLayout(2, C3)))
    for c0 in range(0, NP, CH):
        pp = c0 + pc
        rows = (hq3[:, None] * NPMAX + pp[None, :]) * (D + 2)                     # (QG, CH)
        ok = pp[None, :] < NP
        m = gl.load(part_ptr + rows + D, mask=ok, other=float("-inf"), cache_modifier=".cg")
        wgt = gl.where(ok, gl.exp(m - big[:, None]), 0.0)
        den += gl.sum(wgt * gl.load(part_ptr + rows + D + 1, mask=ok, other=0.0, cache_modifier=".cg"), axis=1)
        acc = gl.load(part_ptr + rows[:, :, None] + d3[None, None, :], mask=ok[:, :, None], other=0.0,
                      cache_modifier=".cg")
        num += gl.sum(acc * wgt[:, :, None], axis=1)
    den = gl.convert_layout(den, gl.SliceLayout(1, gl.SliceLayout(1, C3)))
    out = num / den[:, None]
    hqo = hk * QG + gl.arange(0, QG, layout=gl.SliceLayout(1, gl.SliceLayout(1, C3)))
    gl.store(a_ptr + hqo[:, None] * D + d3[None, :], out.to(a_ptr.dtype.element_ty))


@gluon.jit
def _attn_phase(first, q_ptr, kv_ptr, bt_ptr, part_ptr, a_ptr, cnt_ptr, done_ptr, prev_need, err_ptr, seqlen, kv_plane,
                pid, P, PDL: gl.constexpr, HKV: gl.constexpr, QG: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
                NPMAX: gl.constexpr, NW: gl.constexpr, SM_SCALE: gl.constexpr, SPIN_LIMIT: gl.constexpr):
    """Paged decode attention of one token as a phase: once q and the new k / v row are written (``first``: by the
    previous kernel, PDL; else by the phase before, ``prev_need`` counts at ``done_ptr - 1``), the ``HKV`` x pages
    items spread over the programs; the last item of a KV head to arrive merges that head's partials into ``a``
    and counts the head in ``done_ptr`` (the next phase waits for ``HKV``)."""
    if first:
        _wait_producer(err_ptr, PDL)
    else:
        _wait_phase(done_ptr - 1, prev_need, err_ptr, SPIN_LIMIT, ATTN_KIND)
    n_pages = (seqlen + PAGE - 1) // PAGE
    for w in range(pid, HKV * n_pages, P):
        _attn_item(q_ptr, kv_ptr, bt_ptr, part_ptr, w, seqlen, kv_plane, HKV, QG, PAGE, D, NPMAX, NW, SM_SCALE)
        cta_barrier()                                   # the partial's stores before the arrival
        hk = w % HKV
        arrived = gl.atomic_add(cnt_ptr + hk, 1, sem="acq_rel")
        if arrived == n_pages - 1:
            _attn_merge(part_ptr, a_ptr, hk, n_pages, QG, D, NPMAX, NW)
            gl.atomic_xchg(cnt_ptr + hk, 0, sem="relaxed")
            cta_barrier()
            gl.atomic_add(done_ptr, 1, sem="release")


@gluon.jit
def decode_layer_kernel(q_ptr, kv_ptr, bt_ptr, part_ptr, a_ptr, qw0, s0, z0, qw1, s1, z1, gu_ptr, qw2, s2, z2,
                        qw3, s3, z3, o3, r_ptr, ss_ptr, nw1_ptr, nw3_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
                        ws_ptr, cnt_ptr, done_ptr, exit_ptr, err_ptr, seqlen, kv_plane,
                        N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3,
                        G0: gl.constexpr, XS0: gl.constexpr, BY0: gl.constexpr,
                        G1: gl.constexpr, XS1: gl.constexpr, BY1: gl.constexpr,
                        G2: gl.constexpr, XS2: gl.constexpr, BY2: gl.constexpr,
                        G3: gl.constexpr, XS3: gl.constexpr, BY3: gl.constexpr,
                        TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, AHEAD: gl.constexpr,
                        IW: gl.constexpr, ZP: gl.constexpr, HAS_Z: gl.constexpr, L2_AHEAD: gl.constexpr,
                        PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr, EPI3: gl.constexpr, NSS: gl.constexpr,
                        EPS: gl.constexpr, HKV: gl.constexpr, QG: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
                        NPMAX: gl.constexpr, SM_SCALE: gl.constexpr):
    """A whole decode layer as one launch: the paged attention of ``q`` over the layer's cache (phase 0, output
    ``a``), then ``layer_chain_kernel``'s four phases (o, gate/up, down, next qkv or lm head) as phases 1-4; q for
    the next layer is rotated back into ``q_ptr`` by phase 4's epilogue (the attention has read it by then)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    t_start = _clock()          # kept in a register: nothing is written before the PDL wait
    NW: gl.constexpr = WR * WC
    _attn_phase(True, q_ptr, kv_ptr, bt_ptr, part_ptr, a_ptr, cnt_ptr, done_ptr, 0, err_ptr, seqlen, kv_plane, pid, P,
                PDL, HKV, QG, PAGE, D, NPMAX, NW, SM_SCALE, SPIN_LIMIT)
    _layer_gemvs(1, HKV, a_ptr, qw0, s0, z0, qw1, s1, z1, gu_ptr, qw2, s2, z2, qw3, s3, z3, o3, r_ptr, ss_ptr,
                 nw1_ptr, nw3_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, ws_ptr, cnt_ptr, done_ptr, err_ptr,
                 N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3, pid, P, G0, XS0, BY0, G1, XS1, BY1, G2, XS2, BY2,
                 G3, XS3, BY3, TR, BN, WR, WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT, EPI3, NSS, EPS)
    _leave(done_ptr, exit_ptr, err_ptr, 5, P, t_start, NW)


@gluon.jit
def decode_step_kernel(q_ptr, kv_ptr, bt_ptr, part_ptr, a_ptr, qwO, sO, zO, qwG, sG, zG, gu_ptr, qwD, sD, zD,
                       qwQ, sQ, zQ, qkv_ptr, qwL, sL, zL, logits_ptr, r_ptr, ss_ptr, nw_ptr, cos_ptr, sin_ptr,
                       ws_ptr, cnt_ptr, done_ptr, exit_ptr, err_ptr, layers, seqlen, kv_plane, kv_layer, slot_off, hid,
                       LWO, LSO, LWG, LSG, LWD, LSD, LWQ, LSQ,
                       N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3, N4, T4, SQ4,
                       G0: gl.constexpr, XS0: gl.constexpr, BY0: gl.constexpr,
                       G1: gl.constexpr, XS1: gl.constexpr, BY1: gl.constexpr,
                       G2: gl.constexpr, XS2: gl.constexpr, BY2: gl.constexpr,
                       G3: gl.constexpr, XS3: gl.constexpr, BY3: gl.constexpr,
                       G4: gl.constexpr, XS4: gl.constexpr, BY4: gl.constexpr,
                       TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, AHEAD: gl.constexpr,
                       IW: gl.constexpr, ZP: gl.constexpr, HAS_Z: gl.constexpr, L2_AHEAD: gl.constexpr,
                       PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr, NSS: gl.constexpr, EPS: gl.constexpr,
                       HKV: gl.constexpr, QG: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr, NPMAX: gl.constexpr,
                       SM_SCALE: gl.constexpr):
    """Every layer of the decode step in ONE launch: per layer l, ``decode_layer_kernel``'s five phases (attention
    over cache l, o, gate/up, down, and layer l + 1's qkv with RoPE and the KV append -- the lm head after the
    last layer). Weights, norms and caches are stacked: linear X of layer l at ``qwX + l LWX`` (scales and zeros
    at ``+ l LSX``), norm j at ``nw_ptr + j hid``, cache l at ``kv_ptr + l kv_layer`` (the new token's k row at
    ``+ slot_off``, v one plane further). Shapes: 0 o, 1 gate/up, 2 down, 3 qkv, 4 lm head. Phase counters: five a
    layer; layer l's attention waits for layer l - 1's qkv (``T3`` tiles)."""
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    t_start = _clock()          # kept in a register: nothing is written before the PDL wait
    NW: gl.constexpr = WR * WC
    for l in range(layers):
        lw = l.to(gl.int64)
        dl = done_ptr + 5 * l
        _attn_phase(l == 0, q_ptr, kv_ptr + lw * kv_layer, bt_ptr, part_ptr, a_ptr, cnt_ptr, dl, T3, err_ptr, seqlen,
                    kv_plane, pid, P, PDL, HKV, QG, PAGE, D, NPMAX, NW, SM_SCALE, SPIN_LIMIT)
        nw1 = nw_ptr + (2 * l + 1) * hid
        nw3 = nw_ptr + (2 * l + 2) * hid
        if l < layers - 1:
            kn = kv_ptr + (lw + 1) * kv_layer + slot_off
            _layer_gemvs(1, HKV, a_ptr, qwO + lw * LWO, sO + lw * LSO, zO + lw * LSO, qwG + lw * LWG, sG + lw * LSG,
                         zG + lw * LSG, gu_ptr, qwD + lw * LWD, sD + lw * LSD, zD + lw * LSD, qwQ + (lw + 1) * LWQ,
                         sQ + (lw + 1) * LSQ, zQ + (lw + 1) * LSQ, qkv_ptr, r_ptr, ss_ptr, nw1, nw3, q_ptr, kn,
                         kn + kv_plane, cos_ptr, sin_ptr, ws_ptr, cnt_ptr, dl, err_ptr,
                         N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N3, T3, SQ3, pid, P, G0, XS0, BY0, G1, XS1, BY1, G2,
                         XS2, BY2, G3, XS3, BY3, TR, BN, WR, WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT,
                         EPI_ROPE, NSS, EPS)
        else:
            _layer_gemvs(1, HKV, a_ptr, qwO + lw * LWO, sO + lw * LSO, zO + lw * LSO, qwG + lw * LWG, sG + lw * LSG,
                         zG + lw * LSG, gu_ptr, qwD + lw * LWD, sD + lw * LSD, zD + lw * LSD, qwL, sL, zL, logits_ptr,
                         r_ptr, ss_ptr, nw1, nw3, q_ptr, q_ptr, q_ptr, cos_ptr, sin_ptr, ws_ptr, cnt_ptr, dl, err_ptr,
                         N0, T0, SQ0, N1, T1, SQ1, N2, T2, SQ2, N4, T4, SQ4, pid, P, G0, XS0, BY0, G1, XS1, BY1, G2,
                         XS2, BY2, G4, XS4, BY4, TR, BN, WR, WC, AHEAD, IW, ZP, HAS_Z, L2_AHEAD, PDL, SPIN_LIMIT,
                         EPI_STORE, NSS, EPS)
    _leave(done_ptr, exit_ptr, err_ptr, 5 * layers, P, t_start, NW)
