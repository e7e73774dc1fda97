"""Int4 GEMV (M = 1..16) on the tensor cores, the words laid out as the MMA's A fragments (Gluon).

The prepared "fragment layout" (``portakern.ir.gemv_layout.pack_fragments``) puts one lane's share of four
``mma.m16n8k16`` A fragments in one 16-byte vector, so the words go from global memory straight to
the registers the MMA reads (Marlin's idea, our own layout and code); the CUDA-core kernel spends
~3.4 instructions per code and the Triton "mma" kernel stages words and x through shared memory.

* unit = 16 output rows x 64 columns of K = 128 int32 words (512 bytes, one warp's load): word
  ``4 lane + reg`` (lane = 4 g + t, reg = 2 cb + rb) is row ``8 rb + g``, word column ``4 cb + t`` of
  the tf32-shaped A tile, i.e. the register ``DotOperandLayout(0, mma, k_width=1)`` gives that lane;
* a word's nibbles ``p`` and ``p + 4`` are the bf16 pair at MMA k positions ``2c, 2c + 1`` of k16 step
  ``p`` (c its word column): one LOP3 makes ``(128 + q_lo, 128 + q_hi)`` as bf16x2, one packed add
  removes ``128 + zero`` (exact small integers);
* MMA k position ``kk`` of step ``p`` is column ``16 t + 4 p + 2 (kk // 8) + kk % 2`` of the unit's 64
  (``t = (kk % 8) // 2``), so a lane's x for the four steps is 16 contiguous columns;
* a chunk is two units along K (128 columns); the words are stored chunk-major, ``(KC, NU, 256)``:
  the programs at one chunk read one contiguous stretch.

A program owns ``16 W NT`` rows and one of ``SPLIT_K`` slices of chunks; each iteration issues the
loads of chunk ``c + 1`` (words, two x tiles, the group's scales and zeros) before the eight MMAs
of chunk ``c``; the fp32 group result is scaled once per chunk (groups are multiples of 128).
Split-K partials go to an fp32 workspace and the last slice to arrive adds them (as
``gemv_common._finish``). bf16 activations; rows past M read row M - 1 and are never stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import load

cta_barrier = load("gluon_compat").cta_barrier
#: PDL: wait for the previous kernel (only the constant weight is read before), then let the next launch
_wait_for_producer = load("gluon_compat").wait_for_producer

UNIT_WORDS = gl.constexpr(128)
#: polls of the split-K counter by the merging slice (``MERGE = 1``) before it gives up and stores NaN: ~1 s
MERGE_SPIN_LIMIT = gl.constexpr(1 << 20)


@gluon.jit
def _pair(v, zc2):
    """The A operand's bf16 pairs ``(q_lo - z, q_hi - z)`` from nibbles 0 and 4 of ``v`` (``zc2`` =
    bf16x2 -(128 + z)): one LOP3 puts the codes in the mantissas of 128.0, one packed add removes
    128 + z (exact: small integers). Returned as two bf16 halves of the one 32-bit result."""
    t = gl.inline_asm_elementwise(
        "{ .reg .b32 t, one; mov.b32 one, 0x3F803F80; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; "
        "fma.rn.bf16x2 $0, t, one, $2; }",
        "=r,r,r", [v, zc2], dtype=gl.int32, is_pure=True, pack=1)
    lo = t.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (t >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return lo, hi


@gluon.jit
def _x_steps(xv, BM: gl.constexpr, b_l: gl.constexpr):
    """The B operands ``(16, BM)`` of a block's four k16 steps from its ``(BM, 64)`` x tile: lane
    ``(g, t)`` holds row g (and g + 8) and columns ``16 t .. 16 t + 15``, which are exactly its k
    positions {2t, 2t+1, 2t+8, 2t+9} of steps 0..3 (``_kcol``), so no data moves."""
    xv = xv.reshape((BM, 4, 4, 2, 2))                                # (m, t, p, hi8, h)
    xv = xv.permute((2, 3, 1, 4, 0)).reshape((2, 2, 16, BM))        # (p_hi, p_lo, kk = 8 hi8 + 2 t + h, m)
    xv = xv.permute((2, 3, 0, 1))                                   # (kk, m, p_hi, p_lo)
    xe, xo = gl.split(xv)                                           # p_lo = 0, 1
    x0, x2 = gl.split(xe)
    x1, x3 = gl.split(xo)
    return (gl.convert_layout(x0, b_l, assert_trivial=True), gl.convert_layout(x1, b_l, assert_trivial=True),
            gl.convert_layout(x2, b_l, assert_trivial=True), gl.convert_layout(x3, b_l, assert_trivial=True))


@gluon.jit
def _chunk_weights(w_ptrs, s_ptrs, z_ptrs, c, c_hi, stride_s, stride_c, GS: gl.constexpr, HAS_Z: gl.constexpr):
    """The constant part of chunk ``c`` (128 columns of K: two 64-column units): its words ``(J, 256)``
    and its group's scales and zeros. ``c`` past ``c_hi - 1`` reads chunk ``c_hi - 1`` again (the
    prefetch past the end: cache hits, never used). K is a multiple of the group size, itself a multiple
    of 128 (``portakern.ir.gemv_layout.frag_eligible``): no column is masked."""
    c = gl.minimum(c, c_hi - 1)
    words = gl.load(w_ptrs + c.to(gl.int64) * stride_c)
    g = (c * 128) // GS
    s = gl.load(s_ptrs + g * stride_s)
    if HAS_Z:
        z = gl.load(z_ptrs + g * stride_s)
    else:
        z = s
    return words, s, z


@gluon.jit
def _chunk_x(x_ptrs, c, c_hi):
    """Chunk ``c``'s two ``(BM, 64)`` x tiles (the previous kernel's output under PDL), clamped as
    ``_chunk_weights``."""
    kx = gl.minimum(c, c_hi - 1) * 128
    return gl.load(x_ptrs + kx), gl.load(x_ptrs + kx + 64)


@gluon.jit
def _chunk_loads(w_ptrs, x_ptrs, s_ptrs, z_ptrs, c, c_hi, stride_s, stride_c, GS: gl.constexpr, HAS_Z: gl.constexpr):
    """Everything chunk ``c`` needs, issued together: its words, its two x tiles, its group's scales
    and zeros."""
    words, s, z = _chunk_weights(w_ptrs, s_ptrs, z_ptrs, c, c_hi, stride_s, stride_c, GS, HAS_Z)
    x0, x1 = _chunk_x(x_ptrs, c, c_hi)
    return words, x0, x1, s, z


@gluon.jit
def _chunk_mma(acc, words, x0, x1, s, z, J: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
               HAS_Z: gl.constexpr, ZP: gl.constexpr, mma: gl.constexpr, w_l: gl.constexpr, a_l: gl.constexpr,
               b_l: gl.constexpr):
    """acc += s * (the chunk's eight k16 MMAs on codes - zero)."""
    # -- zeros as bf16x2 -(128 + z) (sign bits of both halves set)
    if HAS_Z:
        zf = z.to(gl.float32)
    else:
        zf = gl.full((BN,), ZP, gl.float32, layout=gl.SliceLayout(1, w_l))
    zb = (zf + 128.0).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    zc2 = ((zb | (zb << 16)) ^ -2147450880)[:, None]
    # -- (J, 256) as loaded -> two (BN, 8) tf32-shaped A tiles: row 16 j + 8 rb + g, column 4 cb + t
    wt = words.reshape((J, 2, 8, 4, 2, 2)).permute((0, 5, 2, 4, 3, 1)).reshape((BN, 8, 2))
    wb0, wb1 = gl.split(wt)
    accg = gl.zeros((BN, BM), gl.float32, layout=mma)
    for bi in gl.static_range(2):
        if bi == 0:
            wb = gl.convert_layout(wb0, w_l, assert_trivial=True)
            xs = _x_steps(x0, BM, b_l)
        else:
            wb = gl.convert_layout(wb1, w_l, assert_trivial=True)
            xs = _x_steps(x1, BM, b_l)
        for p in gl.static_range(4):
            lo, hi = _pair(wb >> (4 * p), zc2)
            a = gl.convert_layout(gl.join(lo, hi).reshape((BN, 16)), a_l, assert_trivial=True)
            accg = mma_v2(a, xs[p], accg)
    return acc + s.to(gl.float32)[:, None] * accg


@gluon.jit
def _anatomy_chunks(acc, w0, s0, z0, w_ptrs, x_ptrs, s_ptrs, z_ptrs, c_lo, c_hi, stride_s, stride_c, J: gl.constexpr,
                    BN: gl.constexpr, BM: gl.constexpr, GS: gl.constexpr, HAS_Z: gl.constexpr, ZP: gl.constexpr,
                    MODE: gl.constexpr, mma: gl.constexpr, w_l: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr,
                    ld_l: gl.constexpr, x_l: gl.constexpr):
    """The chunk loop of ``gemv_frag_kernel`` with the parts ``MODE`` names removed (measurement only): without
    the arithmetic (bit 1) every loaded value is XORed or added into a per-thread accumulator, folded into the
    result once at the end; without the x loads (bit 4) x is a constant tile."""
    accw = gl.zeros((J, 2 * UNIT_WORDS), gl.int32, layout=ld_l)
    accx = gl.zeros((BM,), gl.float32, layout=gl.SliceLayout(1, x_l))
    accs = gl.zeros((BN,), gl.float32, layout=gl.SliceLayout(1, mma))
    ones = gl.full((BM, 64), 1.0, gl.bfloat16, layout=x_l)
    if MODE >= 4:
        xa0, xb0 = ones, ones
    else:
        xa0, xb0 = _chunk_x(x_ptrs, c_lo, c_hi)
    for c in range(c_lo, c_hi):
        wn, sn, zn = _chunk_weights(w_ptrs, s_ptrs, z_ptrs, c + 1, c_hi, stride_s, stride_c, GS, HAS_Z)
        if MODE >= 4:
            xan, xbn = ones, ones
        else:
            xan, xbn = _chunk_x(x_ptrs, c + 1, c_hi)
        if MODE % 2 == 1:
            accw = accw ^ w0
            accx = accx + gl.sum(xa0.to(gl.float32) + xb0.to(gl.float32), axis=1)
            accs = accs + s0.to(gl.float32) + gl.convert_layout(z0, gl.SliceLayout(1, mma)).to(gl.float32)
        else:
            acc = _chunk_mma(acc, w0, xa0, xb0, s0, z0, J, BN, BM, HAS_Z, ZP, mma, w_l, a_l, b_l)
        w0, xa0, xb0, s0, z0 = wn, xan, xbn, sn, zn
    if MODE % 2 == 1:
        folded = gl.sum(gl.sum(accw, axis=1), axis=0).to(gl.float32) + gl.sum(accx, axis=0)
        acc = acc + accs[:, None] + folded
    return acc


@gluon.jit
def _merge_in_last_slice(acc, ws_ptr, lock, out_ptr, pid_k, mo, ns, omask, N, stride_om, BM: gl.constexpr,
                         SPLIT_K: gl.constexpr):
    """Split-K merge by the grid's last slice (``MERGE = 1``). Slices ``0 .. SPLIT_K - 2`` publish their partial and
    count themselves (release; the count is not read back, so they leave at once). The last slice, launched after all
    of them, polls the count (acquire), adds the published partials in slice order and its own last (the bits of
    ``MERGE = 0``), stores the output and takes ``SPLIT_K - 1`` off the count. A count that never completes (it cannot while every
    earlier program runs to its end) stores NaN after ``MERGE_SPIN_LIMIT`` polls instead of hanging the GPU."""
    if pid_k < SPLIT_K - 1:
        gl.store(ws_ptr + (pid_k * BM + mo[None, :]) * N + ns[:, None], acc, mask=omask)
        cta_barrier()
        gl.atomic_add(lock, 1, sem="release")
    else:
        seen = gl.atomic_add(lock, 0, sem="acquire")
        polls = 0
        while (seen < SPLIT_K - 1) & (polls < MERGE_SPIN_LIMIT):
            seen = gl.atomic_add(lock, 0, sem="acquire")
            polls += 1
        tot = gl.zeros_like(acc)
        for sk in gl.static_range(SPLIT_K - 1):
            tot += gl.load(ws_ptr + (sk * BM + mo[None, :]) * N + ns[:, None], mask=omask, other=0.0,
                           cache_modifier=".cg")
        tot += acc
        tot = gl.where(seen < SPLIT_K - 1, float("nan"), tot)
        gl.store(out_ptr + mo[None, :] * stride_om + ns[:, None], tot.to(out_ptr.dtype.element_ty), mask=omask)
        # the count back to zero by subtraction, not an exchange: after a timed-out poll the late slices' adds
        # still arrive and bring it back to zero by the grid's end (an exchange would leave them in it)
        gl.atomic_add(lock, -(SPLIT_K - 1), sem="release")


@gluon.jit
def gemv_frag_kernel(x_ptr, fw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, lock_ptr,
                     M, N, K, KC, stride_s, stride_xm, stride_om, KC_SPLIT, stride_u, stride_c,
                     BM: gl.constexpr, W: gl.constexpr, NT: gl.constexpr, GS: gl.constexpr,
                     HAS_Z: gl.constexpr, ZP: gl.constexpr, SPLIT_K: gl.constexpr, PDL: gl.constexpr,
                     MODE: gl.constexpr, MERGE: gl.constexpr):
    """``out (M, N) = x (M, K) @ dequant(W)^T`` with W's int4 words in the fragment layout: a program
    owns ``16 W NT`` rows of W (``NT`` units per warp) and one of ``SPLIT_K`` slices of ``KC_SPLIT``
    128-column chunks; ``BM`` (8 or 16) columns of the MMA result are rows of x. Unit ``u`` of chunk
    ``c`` starts at word ``u * stride_u + c * stride_c``. ``PDL``: launched as a programmatic dependent
    (sm_90+): the first chunk's words, scales and zeros (constant) are requested before
    ``griddepcontrol.wait``, x and every store after it. ``MODE`` (measurement only, ``tests/test_gemv_frag_modes.py``;
    0 in every real launch) removes parts, giving wrong results: bit 1 the arithmetic (the loaded values are only
    XORed / added up), bit 2 the split-K merge (every slice stores its partial as the output), bit 4 the x loads.
    ``MERGE`` (split K): 0, the last slice to arrive adds the partials (every slice publishes its partial, then
    counts itself with an acquire-release atomic and reads the count back); 1, the grid's last slice adds them (it is
    dispatched after every other slice of the grid: the others publish and count themselves without waiting for the
    count, the last one keeps its own partial in registers and polls the count). Both sum in slice order: equal bits."""
    J: gl.constexpr = W * NT           # 16-row units per program
    BN: gl.constexpr = 16 * J
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
    x_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [1, W], [1, 0])
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)

    # -- pointers at chunk 0: words (J, 256), 16 contiguous bytes per lane and unit; x (BM, 64), 32
    #    contiguous bytes per lane, the same in every warp (rows past M read row M - 1); scales in
    #    the MMA result's row layout, zeros in the A tile's
    j = gl.arange(0, J, layout=gl.SliceLayout(1, ld_l))
    wi = gl.arange(0, 2 * UNIT_WORDS, layout=gl.SliceLayout(0, ld_l))
    w_ptrs = fw_ptr + (pid_n * J + j).to(gl.int64)[:, None] * stride_u + wi[None, :]
    xm = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
    xk = gl.arange(0, 64, layout=gl.SliceLayout(0, x_l))
    x_ptrs = x_ptr + gl.minimum(xm, M - 1)[:, None] * stride_xm + xk[None, :]
    ns = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    s_ptrs = s_ptr + ns
    z_ptrs = z_ptr + pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))

    # -- the chunks of this slice, the next one's loads in flight while one is multiplied
    c_lo = pid_k * KC_SPLIT
    c_hi = gl.minimum(c_lo + KC_SPLIT, KC)
    acc = gl.zeros((BN, BM), gl.float32, layout=mma)
    w0, s0, z0 = _chunk_weights(w_ptrs, s_ptrs, z_ptrs, c_lo, c_hi, stride_s, stride_c, GS, HAS_Z)
    _wait_for_producer(PDL)     # the previous kernel may still be writing x (PDL): only constants above
    if MODE == 0:
        xa0, xb0 = _chunk_x(x_ptrs, c_lo, c_hi)
        for c in range(c_lo, c_hi):
            wn, xan, xbn, sn, zn = _chunk_loads(w_ptrs, x_ptrs, s_ptrs, z_ptrs, c + 1, c_hi, stride_s, stride_c, GS,
                                                HAS_Z)
            acc = _chunk_mma(acc, w0, xa0, xb0, s0, z0, J, BN, BM, HAS_Z, ZP, mma, w_l, a_l, b_l)
            w0, xa0, xb0, s0, z0 = wn, xan, xbn, sn, zn
    else:
        acc = _anatomy_chunks(acc, w0, s0, z0, w_ptrs, x_ptrs, s_ptrs, z_ptrs, c_lo, c_hi, stride_s, stride_c, J, BN,
                              BM, GS, HAS_Z, ZP, MODE, mma, w_l, a_l, b_l, ld_l, x_l)

    # -- out[m, n] = acc[n, m]: directly, or through the split-K workspace (the last slice adds)
    mo = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    omask = (mo[None, :] < M) & (ns[:, None] < N)
    if (SPLIT_K == 1) | (MODE % 4 >= 2):
        gl.store(out_ptr + mo[None, :] * stride_om + ns[:, None], acc.to(out_ptr.dtype.element_ty), mask=omask)
    elif MERGE == 1:
        _merge_in_last_slice(acc, ws_ptr, lock_ptr + pid_n, out_ptr, pid_k, mo, ns, omask, N, stride_om, BM, SPLIT_K)
    else:
        gl.store(ws_ptr + (pid_k * BM + mo[None, :]) * N + ns[:, None], acc, mask=omask)
        cta_barrier()
        lock = lock_ptr + pid_n
        arrived = gl.atomic_add(lock, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # other SMs wrote the partials: read them from L2 (.cg), then reset the counter
            tot = gl.zeros((BN, BM), gl.float32, layout=mma)
            for sk in gl.static_range(SPLIT_K):
                tot += gl.load(ws_ptr + (sk * BM + mo[None, :]) * N + ns[:, None], mask=omask, other=0.0,
                               cache_modifier=".cg")
            gl.store(out_ptr + mo[None, :] * stride_om + ns[:, None], tot.to(out_ptr.dtype.element_ty), mask=omask)
            gl.atomic_xchg(lock, 0)
