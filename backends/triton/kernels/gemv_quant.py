"""Triton bodies of the weight-only quantized GEMV: ``out (M, N) = x (M, K) @ dequant(W)^T``.

The host side (``portakern.gemv_weight.prepare_gemv_weight``) repacks every packing into one internal layout, defined
by ``portakern.ir.gemv_layout`` (the byte layout in full there):

* ``qw``  int32 ``(KWP, NP)``, K-major: word ``(j, n)`` holds ``EPW = 32 // BITS`` unsigned codes of
  column n, code ``e`` in bits ``BITS*e .. BITS*e + BITS-1``. Word rows are interleaved in blocks of
  ``IW`` rows (int4: ``IW`` a power of two, at most 8, dividing the words per group; 1 for int8 and
  per-element groups, see ``gemv_layout.interleave_words``): code ``e`` of row ``j`` is ``W[n, k]``
  with ``k = (j // IW) * IW * EPW + e * IW + j % IW`` (``gemv_common._k_index``), so the x values that
  meet code position ``e`` of ``IW`` consecutive rows are contiguous (one vector load). A block of
  ``IW * EPW`` columns of K lies in one group. Rows past ``K / EPW`` are zero (KWP is a multiple of
  64); ``NP`` (the row stride) is N rounded up to 128, so tiles of up to 128 columns load without
  masks (wider tiles mask, ``NMASK``).
* ``s``, ``z``  ``(G, NP)``: scale and integer zero point of group ``g`` for column ``n`` (the
  format's scale dtype). Symmetric formats have no ``z`` and use the constant ``ZP``.
* ``perm`` int32 ``(K,)`` (act-order GPTQ): internal column ``k`` multiplies ``x[:, perm[k]]``.
* ``kg`` int32 ``(K,)`` (irregular ``g_idx``): the group of internal column ``k``.

A program owns ``BN`` output columns and one of ``SPLIT_K`` slices of K. Each iteration loads a
``(BKW, BN)`` tile of words (16-byte vectors along N, so a warp reads whole 512-byte rows) and,
for each of the ``EPW`` code positions, multiplies the codes by the matching column of x. All large
tensors stay in the tile's register layout; only x (shared by every column) is re-laid.

Split-K partials go to an fp32 workspace merged by one of the slices (``gemv_common._finish``), so a launch
needs no zeroed buffer and no second kernel. The helpers these kernels share with ``gemv_mma.py`` (dequantization,
tile ids, the split-K merge, scale lookups) are ``gemv_common.py``'s.
"""

import triton
import triton.language as tl

from . import load

_c = load("gemv_common")
DENORM_C = _c.DENORM_C
_codes = _c._codes
_unscale = _c._unscale
_denorm_back = _c._denorm_back
_denorm_fwd = _c._denorm_fwd
_program_tile = _c._program_tile
_wait_for_producer = _c._wait_for_producer
_finish = _c._finish
_scale_zero = _c._scale_zero
_group_scale_zero = _c._group_scale_zero
_k_index = _c._k_index


@triton.jit
def _word_tile(w_ptrs, s_ptr, z_ptr, kw0, kwr, n, K, stride_qk, EPW: tl.constexpr, GS: tl.constexpr,
               HAS_Z: tl.constexpr, ZP: tl.constexpr, PER_ELEM_GROUP: tl.constexpr, WORDS: tl.constexpr = True,
               GROUP_ROWS: tl.constexpr = False, NMASK: tl.constexpr = False):
    """The ``(BKW, BN)`` words at word row ``kw0`` with their scales and zeros: ``(BKW, BN)`` per word
    row, ``(BN,)`` when the tile lies in one group (``GROUP_ROWS``), none for per-element groups (looked
    up per code instead). ``WORDS=False``: only the scales and zeros (words: 0). ``NMASK``: columns
    at or past the padded row length (``stride_qk``) are not read (words 0)."""
    if WORDS:
        if NMASK:
            words = tl.load(w_ptrs + kw0 * stride_qk, mask=(n < stride_qk)[None, :], other=0)
        else:
            words = tl.load(w_ptrs + kw0 * stride_qk)
    else:
        words = 0
    if PER_ELEM_GROUP:
        s = 0.0
        z = 0.0
    elif GROUP_ROWS:
        g = tl.minimum(kw0 * EPW, K - 1) // GS   # padding rows use the last group (their codes are 0)
        nn = tl.minimum(n, stride_qk - 1) if NMASK else n
        s, z = _scale_zero(s_ptr, z_ptr, g * stride_qk + nn, HAS_Z, ZP)
    else:
        s, z = _group_scale_zero(s_ptr, z_ptr, kw0 + kwr, n, K, stride_qk, EPW, GS, HAS_Z, ZP)
    return words, s, z


@triton.jit
def _x_column(x_ptr, row, stride_xm, perm_ptr, k, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr,
              GLU: tl.constexpr):
    """``x[row, k]`` (row: scalar or column vector), through ``perm`` for act-order weights; 0 past K.
    ``GLU == 1`` (the ``silu_mul`` prologue, formed here): ``x`` holds gate and up side by side (``2K``
    columns) and the value is ``silu(gate[row, k]) * up[row, k]`` in float32."""
    if HAS_PERM:
        kx = tl.load(perm_ptr + k, mask=k < K, other=0)
    else:
        kx = k
    if EVEN_K:
        xe = tl.load(x_ptr + row * stride_xm + kx).to(tl.float32)
    else:
        xe = tl.load(x_ptr + row * stride_xm + kx, mask=k < K, other=0.0).to(tl.float32)
    if GLU == 1:
        # -- the up half, K columns further; the input is silu(gate) * up
        if EVEN_K:
            up = tl.load(x_ptr + row * stride_xm + K + kx).to(tl.float32)
        else:
            up = tl.load(x_ptr + row * stride_xm + K + kx, mask=k < K, other=0.0).to(tl.float32)
        xe = xe * tl.sigmoid(xe) * up
    return xe


@triton.jit
def _fma_tile(acc, words, s, z, kw0, kwr, n, x_ptr, pid_m, x_rows, stride_xm, perm_ptr, kg_ptr, s_ptr, z_ptr,
              K, stride_qk, mask_rt, BITS: tl.constexpr, GS: tl.constexpr, ZP: tl.constexpr, HAS_Z: tl.constexpr,
              HAS_PERM: tl.constexpr, PER_ELEM_GROUP: tl.constexpr, HAS_KG: tl.constexpr, BM: tl.constexpr,
              BKW: tl.constexpr, BN: tl.constexpr, DQE: tl.constexpr, EVEN_K: tl.constexpr,
              GROUP_ROWS: tl.constexpr, IW: tl.constexpr, GLU: tl.constexpr, MINS: tl.constexpr = False):
    """Add one ``(BKW, BN)`` tile of words (with its scales ``s`` and zeros ``z``) times x to ``acc``.
    ``MINS``: ``z`` holds each group's float minimum instead of a zero point (``_group_term``).

    ``GROUP_ROWS``: the tile's rows lie in one group; ``s``, ``z`` are ``(BN,)`` and ``acc`` is ``(BN,)``
    (``(BM, BN)``): the products are summed over the rows first (within each thread, whose layout
    holds every row of its columns), then scaled once per column.
    """
    EPW: tl.constexpr = 32 // BITS
    # the tile's columns of K are one contiguous span: sum x there with a vector spread over the threads
    XSPAN: tl.constexpr = GROUP_ROWS and BM == 1 and not HAS_PERM and BKW >= IW
    kw0 = tl.multiple_of(kw0, BKW)
    if BM == 1:
        dot = tl.zeros((BKW, BN), tl.float32)
        xsum = tl.zeros((BKW,), tl.float32)
    else:
        dot = tl.zeros((BM, BKW, BN), tl.float32)
        xsum = tl.zeros((BM, BKW), tl.float32)
    for e in tl.static_range(EPW):
        # -- the columns k of x that meet code position e (``_k_index``), and the codes
        k = _k_index(kw0, kwr, e, EPW, IW, BKW)
        q = _codes(words, mask_rt, e, BITS, DQE)
        if BM == 1:
            xe = _x_column(x_ptr, pid_m, stride_xm, perm_ptr, k, K, HAS_PERM, EVEN_K, GLU)
        else:
            xe = _x_column(x_ptr, x_rows[:, None], stride_xm, perm_ptr, k[None, :], K, HAS_PERM, EVEN_K, GLU)
        xq = _unscale(xe, e, BITS, DQE)   # x carries the 2^-pos of the codes (one FMUL per x)
        if PER_ELEM_GROUP:
            if HAS_KG:
                ge = tl.load(kg_ptr + k, mask=k < K, other=0)
            else:
                ge = tl.minimum(k, K - 1) // GS
            se, ze = _scale_zero(s_ptr, z_ptr, ge[:, None] * stride_qk + n[None, :], HAS_Z, ZP)
            we = (_unscale(q, e, BITS, DQE) - ze) * se
            xq = xe
            if BM == 1:
                acc += xq[:, None] * we
            else:
                acc += xq[:, :, None] * we[None, :, :]
        else:
            if BM == 1:
                dot += xq[:, None] * q
            else:
                dot += xq[:, :, None] * q[None, :, :]
            if not XSPAN:
                xsum += xe
    if GROUP_ROWS:
        # -- one group: s (sum over rows of x q - z sum x), per column
        if XSPAN:
            ks = kw0 * EPW + tl.arange(0, BKW * EPW)
            xs = _denorm_fwd(tl.sum(_x_column(x_ptr, pid_m, stride_xm, perm_ptr, ks, K, HAS_PERM, EVEN_K, GLU),
                                    axis=0), DQE)
            acc += _group_term(tl.sum(dot, axis=0), xs, s, z, MINS)
        elif BM == 1:
            xs = _denorm_fwd(tl.sum(xsum, axis=0), DQE)
            acc += _group_term(tl.sum(dot, axis=0), xs, s, z, MINS)
        else:
            xs = _denorm_fwd(tl.sum(xsum, axis=1), DQE)
            acc += _group_term(tl.sum(dot, axis=1), xs[:, None], s[None, :], z, MINS)
    elif not PER_ELEM_GROUP:
        # -- per word row: s (sum x q - z sum x); DQ=3: sum x to the 2^-DENORM_C scale of dot
        xsum = _denorm_fwd(xsum, DQE)
        if BM == 1:
            acc += _group_term(dot, xsum[:, None], s, z, MINS)
        else:
            acc += _group_term(dot, xsum[:, :, None], s[None, :, :], z, MINS)
    return acc


@triton.jit
def _group_term(dot, xs, s, z, MINS: tl.constexpr):
    """One group's share of the output from ``dot`` = sum x q and ``xs`` = sum x over its columns:
    ``s (dot - z xs)`` with a zero point ``z``, or ``s dot - z xs`` when ``z`` is the group's float minimum
    (``MINS``: GGUF Q4_K / Q5_K, ``w = s q - min``)."""
    if MINS:
        return s * dot - z * xs
    else:
        return s * (dot - z * xs)


@triton.jit
def _glu_stage(x_ptr, stride_xm, glu_ptr, glu_len, pid_n, pid_k, pid_m, kw_begin, K, EPW: tl.constexpr,
               CHUNK: tl.constexpr):
    """(``BM == 1``) ``silu(gate) * up`` over this program's K slice, formed once into its row of the fp32
    scratch ``glu_ptr`` (``glu_len`` values per program, columns past K zero); returns the pointer through
    which the tiles then read column k of the input at offset k (row stride 0)."""
    prog = (pid_m * tl.num_programs(1) + pid_k) * tl.num_programs(0) + pid_n
    row = glu_ptr + prog.to(tl.int64) * glu_len
    k_lo = kw_begin * EPW
    for c0 in range(0, glu_len, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        k = k_lo + offs
        ok = (offs < glu_len) & (k < K)
        gate = tl.load(x_ptr + pid_m * stride_xm + k, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + pid_m * stride_xm + K + k, mask=ok, other=0.0).to(tl.float32)
        tl.store(row + offs, gate * tl.sigmoid(gate) * up, mask=offs < glu_len)
    # -- every thread's part of the slice written before any tile reads it
    tl.debug_barrier()
    return row - k_lo


@triton.jit
def gemv_fma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, kg_ptr, out_ptr, ws_ptr, lock_ptr,
                    M, N, K, KWP, stride_qk, stride_xm, stride_om, K_SPLIT_W, mask_rt, glu_ptr, glu_len,
                    BITS: tl.constexpr, GS: tl.constexpr, ZP: tl.constexpr,
                    HAS_Z: tl.constexpr, HAS_PERM: tl.constexpr, PER_ELEM_GROUP: tl.constexpr,
                    HAS_KG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                    SPLIT_K: tl.constexpr, DQ: tl.constexpr, EVEN_K: tl.constexpr, PIPE: tl.constexpr,
                    PREFETCH: tl.constexpr, PDL: tl.constexpr, GROUP_ROWS: tl.constexpr, NMASK: tl.constexpr,
                    IW: tl.constexpr, GLU: tl.constexpr = 0, MERGE: tl.constexpr = 0, MINS: tl.constexpr = False):
    """CUDA-core GEMV for small M: per code one LOP3 and one exact FMA, then one FMA per row of x.

    The zero point is applied per word row: ``sum x (q - z) s = s (sum x q - z sum x)``.
    ``MINS`` (GGUF Q4_K / Q5_K, with ``HAS_Z`` and ``ZP = 0``): ``z_ptr`` holds each group's float minimum, not a
    zero point, and the row's share is ``s sum x q - min sum x`` (``_group_term``).
    ``PER_ELEM_GROUP``: the group of each code is looked up per element (``k // GS`` or ``kg``),
    for group sizes that are not whole words or irregular act-order groups (slow path).
    ``PIPE``: 1 = the next tile of words, scales and zeros is prefetched into registers while this
    one is computed; > 1 = Triton's software pipeliner keeps ``PIPE - 1`` tiles in flight through
    shared memory (asynchronous copies), which costs no registers per byte in flight.
    ``PREFETCH`` (with PIPE = 1): how many tiles of words ahead the register prefetch loads (1 or 2;
    scales and zeros are always one tile ahead).
    ``PDL``: launched as a programmatic dependent of the previous kernel in the stream (sm_90+); see
    ``_wait_for_producer``. With PIPE = 1 the first tiles of words, scales and zeros (constant
    weights) are requested before the wait, so they are in flight while the previous kernel drains.
    ``GROUP_ROWS``: every tile's ``BKW`` word rows lie in one group (``BKW`` divides ``GS / EPW``) and
    ``BN`` is a multiple of 128 per warp, so Triton's load layout gives each thread all rows of its
    columns: the products are summed over the rows in registers and scaled once per tile and column
    (not once per word), with one ``(BN,)`` vector of scales and zeros per tile.
    ``NMASK``: ``BN`` does not divide the padded row length (``stride_qk``): mask the columns past it.
    ``GLU``: the ``silu_mul`` prologue -- ``x`` is ``(M, 2K)`` (gate, up) and the input is ``silu(gate) * up``:
    1 formed where each tile reads its columns of x (``_x_column``; every thread holding a row's x evaluates it);
    2 formed once per program over its K slice into its row of the scratch ``glu_ptr`` (``_glu_stage``, after
    the wait; BM = 1 and no act-order permutation), which the tiles then read as x.
    ``MERGE``: the split-K merge of ``_finish`` (0: the last slice to arrive; 1: the grid's last slice; compiled
    kernels only).
    """
    EPW: tl.constexpr = 32 // BITS
    DQE: tl.constexpr = 2 if (DQ == 3 and PER_ELEM_GROUP) else DQ   # DQ=3 needs per-row groups
    pid_n, pid_k, pid_m, n, rows, x_rows = _program_tile(M, BM, BN)   # columns up to NP exist: no load mask
    kwr = tl.arange(0, BKW)
    w_ptrs = qw_ptr + kwr[:, None] * stride_qk + n[None, :]
    kw_begin = pid_k * K_SPLIT_W
    kw_end = tl.minimum(kw_begin + K_SPLIT_W, KWP)
    if GROUP_ROWS:
        if BM == 1:
            acc = tl.zeros((BN,), tl.float32)
        else:
            acc = tl.zeros((BM, BN), tl.float32)
    elif BM == 1:
        acc = tl.zeros((BKW, BN), tl.float32)
    else:
        acc = tl.zeros((BM, BKW, BN), tl.float32)
    if PIPE > 1:
        # -- tiles streamed by the software pipeliner
        _wait_for_producer(PDL)
        if GLU == 2:
            x_ptr = _glu_stage(x_ptr, stride_xm, glu_ptr, glu_len, pid_n, pid_k, pid_m, kw_begin, K, EPW, 256)
            stride_xm = 0
        for kw0 in tl.range(kw_begin, kw_end, BKW, num_stages=PIPE):
            words, s, z = _word_tile(w_ptrs, s_ptr, z_ptr, kw0, kwr, n, K, stride_qk, EPW, GS, HAS_Z, ZP,
                                     PER_ELEM_GROUP, True, GROUP_ROWS, NMASK)
            acc = _fma_tile(acc, words, s, z, kw0, kwr, n, x_ptr, pid_m, x_rows, stride_xm, perm_ptr, kg_ptr,
                            s_ptr, z_ptr, K, stride_qk, mask_rt, BITS, GS, ZP, HAS_Z, HAS_PERM, PER_ELEM_GROUP,
                            HAS_KG, BM, BKW, BN, DQE, EVEN_K, GROUP_ROWS, IW, GLU == 1, MINS)
    else:
        # -- the first tile of words, its scales and zeros; rows past K are zero padding
        kw_first = tl.minimum(kw_begin, KWP - BKW)
        words, s, z = _word_tile(w_ptrs, s_ptr, z_ptr, kw_first, kwr, n, K, stride_qk, EPW, GS, HAS_Z, ZP,
                                 PER_ELEM_GROUP, True, GROUP_ROWS, NMASK)
        if PREFETCH == 2:   # words two tiles ahead (scales and zeros stay one ahead: fewer registers)
            words_ahead = tl.load(w_ptrs + tl.where(kw_first + BKW < kw_end, kw_first + BKW, kw_first) * stride_qk)
        # -- only now x, the output and the workspace: they may belong to the previous kernel
        _wait_for_producer(PDL)
        if GLU == 2:
            x_ptr = _glu_stage(x_ptr, stride_xm, glu_ptr, glu_len, pid_n, pid_k, pid_m, kw_begin, K, EPW, 256)
            stride_xm = 0
        for kw0 in range(kw_begin, kw_end, BKW):
            # -- prefetch the next tile while this one is computed (the last re-reads itself: a cache hit)
            kw_next = tl.where(kw0 + BKW < kw_end, kw0 + BKW, kw0)
            words_next, s_next, z_next = _word_tile(w_ptrs, s_ptr, z_ptr, kw_next, kwr, n, K, stride_qk, EPW, GS,
                                                    HAS_Z, ZP, PER_ELEM_GROUP, PREFETCH == 1, GROUP_ROWS, NMASK)
            if PREFETCH == 2:
                words_far = tl.load(w_ptrs + tl.where(kw0 + 2 * BKW < kw_end, kw0 + 2 * BKW, kw0) * stride_qk)
            acc = _fma_tile(acc, words, s, z, kw0, kwr, n, x_ptr, pid_m, x_rows, stride_xm, perm_ptr, kg_ptr,
                            s_ptr, z_ptr, K, stride_qk, mask_rt, BITS, GS, ZP, HAS_Z, HAS_PERM, PER_ELEM_GROUP,
                            HAS_KG, BM, BKW, BN, DQE, EVEN_K, GROUP_ROWS, IW, GLU == 1, MINS)
            if PREFETCH == 2:
                words = words_ahead
                words_ahead = words_far
            else:
                words = words_next
            if not PER_ELEM_GROUP:
                s = s_next
                if HAS_Z:
                    z = z_next
    # -- the one cross-thread reduction, over the word rows of the tile (GROUP_ROWS: done per tile)
    if GROUP_ROWS:
        if BM == 1:
            res = acc[None, :]
        else:
            res = acc
    elif BM == 1:
        res = tl.sum(acc, axis=0)[None, :]
    else:
        res = tl.sum(acc, axis=1)
    res = _denorm_back(res, DQE)
    _finish(res, rows, n, M, N, pid_n, pid_k, pid_m, out_ptr, stride_om, ws_ptr, lock_ptr, BM, BN, SPLIT_K, MERGE)


@triton.jit
def gemv_dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, ws_ptr, lock_ptr,
                    M, N, K, KWP, stride_qk, stride_xm, stride_om, K_SPLIT_W, mask_rt,
                    BITS: tl.constexpr, GS: tl.constexpr, ZP: tl.constexpr,
                    HAS_Z: tl.constexpr, HAS_PERM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BKW: tl.constexpr, SPLIT_K: tl.constexpr, DQ: tl.constexpr, EVEN_K: tl.constexpr,
                    COMPUTE_F32: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr, IW: tl.constexpr,
                    MINS: tl.constexpr = False):
    """Tensor-core GEMV for M up to 16: ``acc (BM, BN) += x[:, k_e] (BM, BKW) @ w_e (BKW, BN)``
    for each code position e, with ``w_e = (q - z) * s`` dequantized in the compute dtype.

    ``SWAP_AB``: compute ``acc^T (BN, BM) += w_e^T (BN, BKW) @ x[:, k_e]^T (BKW, BM)`` instead, so
    the dequantized weights are the MMA's A operand, which may stay in registers (only the packed
    words change layout), and the small x tile is the operand staged in shared memory.
    ``COMPUTE_F32``: multiply in fp32 (fp32 activations, or bf16 under the interpreter).
    DQ=3 (a CUDA-core variant) runs as DQ=2 here.
    ``MINS`` (GGUF Q4_K / Q5_K, with ``HAS_Z``): ``z_ptr`` holds each group's float minimum: ``w_e = q s - min``.
    ``PDL``: launched as a programmatic dependent (``_wait_for_producer`` before the first load).
    """
    EPW: tl.constexpr = 32 // BITS
    DQE: tl.constexpr = 2 if DQ == 3 else DQ
    pid_n, pid_k, pid_m, n, rows, x_rows = _program_tile(M, BM, BN)
    kwr = tl.arange(0, BKW)
    if SWAP_AB:
        w_ptrs = qw_ptr + kwr[None, :] * stride_qk + n[:, None]    # (BN, BKW) tiles
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        w_ptrs = qw_ptr + kwr[:, None] * stride_qk + n[None, :]    # (BKW, BN) tiles
        acc = tl.zeros((BM, BN), tl.float32)
    kw_begin = pid_k * K_SPLIT_W
    if COMPUTE_F32:
        cdt = tl.float32
    else:
        cdt = x_ptr.dtype.element_ty
    _wait_for_producer(PDL)
    for kw0 in range(kw_begin, tl.minimum(kw_begin + K_SPLIT_W, KWP), BKW):
        # -- one tile of words with its scales and zeros (padding rows use the last group)
        words = tl.load(w_ptrs + kw0 * stride_qk)
        kw = kw0 + kwr
        g = tl.minimum(kw * EPW, K - 1) // GS
        if SWAP_AB:
            s, z = _scale_zero(s_ptr, z_ptr, g[None, :] * stride_qk + n[:, None], HAS_Z, ZP)
        else:
            s, z = _scale_zero(s_ptr, z_ptr, g[:, None] * stride_qk + n[None, :], HAS_Z, ZP)
        if MINS:
            zs = z   # the float minimum: w = q s - min
        else:
            zs = z * s
        # -- one MMA per code position e: the columns k of x that meet it (``_k_index``)
        for e in tl.static_range(EPW):
            k = _k_index(kw0, kwr, e, EPW, IW, BKW)
            we = tl.fma(_codes(words, mask_rt, e, BITS, DQE), _unscale(s, e, BITS, DQE), -zs).to(cdt)  # (q - z) * s
            if SWAP_AB:
                xe = _x_column(x_ptr, x_rows[None, :], stride_xm, perm_ptr, k[:, None], K, HAS_PERM, EVEN_K, False).to(cdt)
                if COMPUTE_F32:
                    acc = tl.dot(we, xe, acc, input_precision="ieee")
                else:
                    acc = tl.dot(we, xe, acc)
            else:
                xe = _x_column(x_ptr, x_rows[:, None], stride_xm, perm_ptr, k[None, :], K, HAS_PERM, EVEN_K, False).to(cdt)
                if COMPUTE_F32:
                    acc = tl.dot(xe, we, acc, input_precision="ieee")
                else:
                    acc = tl.dot(xe, we, acc)
    # -- write (BM, BN)
    if SWAP_AB:
        res = tl.trans(acc)
    else:
        res = acc
    _finish(res, rows, n, M, N, pid_n, pid_k, pid_m, out_ptr, stride_om, ws_ptr, lock_ptr, BM, BN, SPLIT_K)
