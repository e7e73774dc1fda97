"""Triton bodies of the weight-only quantized GEMV: ``out (M, N) = x (M, K) @ dequant(W)^T``.

The host side (``portakern.gemv_weight.prepare_gemv_weight``) repacks every packing into one internal layout, defined
by ``portakern.ir.gemv_layout`` (the byte layout in full there):

* ``qw``  int32 ``(KWP, NP)``, K-major: word ``(j, n)`` holds ``EPW = 32 // BITS`` unsigned codes of
  column n, code ``e`` in bits ``BITS*e .. BITS*e + BITS-1``. Word rows are interleaved in blocks of
  ``IW`` rows (int4: ``IW`` a power of two, at most 8, dividing the words per group; 1 for int8 and
  per-element groups, see ``gemv_layout.interleave_words``): code ``e`` of row ``j`` is ``W[n, k]`` with ``k = (j // IW) * IW * EPW + e * IW + j % IW``
  (``_k_index``), so the x values that meet code position ``e`` of ``IW`` consecutive rows are
  contiguous (one vector load). A block of ``IW * EPW`` columns of K lies in one group. Rows past
  ``K / EPW`` are zero (KWP is a multiple of 64); ``NP`` (the row stride) is N rounded up to 128,
  so tiles of up to 128 columns load without masks (wider tiles mask, ``NMASK``).
* ``s``, ``z``  ``(G, NP)``: scale and integer zero point of group ``g`` for column ``n`` (the
  format's scale dtype). Symmetric formats have no ``z`` and use the constant ``ZP``.
* ``perm`` int32 ``(K,)`` (act-order GPTQ): internal column ``k`` multiplies ``x[:, perm[k]]``.
* ``kg`` int32 ``(K,)`` (irregular ``g_idx``): the group of internal column ``k``.

A program owns ``BN`` output columns and one of ``SPLIT_K`` slices of K. Each iteration loads a
``(BKW, BN)`` tile of words (16-byte vectors along N, so a warp reads whole 512-byte rows) and,
for each of the ``EPW`` code positions, multiplies the codes by the matching column of x. All large
tensors stay in the tile's register layout; only x (shared by every column) is re-laid.

Split-K partials go to an fp32 workspace; the last slice to finish a tile (one arrival counter
per tile, which that slice resets) adds them and writes the output once, so a launch needs no
zeroed buffer and no second kernel.
"""

import triton
import triton.language as tl


#: DQ=3: products x * q come out scaled by 2^-DENORM_C (see ``_codes``); the result is scaled back once.
DENORM_C = tl.constexpr(64)
#: polls of the split-K count by the merging slice (``_finish`` with ``MERGE = 1``) before it stores NaN: ~1 s
MERGE_SPIN_LIMIT = tl.constexpr(1 << 20)


@triton.jit
def _codes(words, mask_rt, E: tl.constexpr, BITS: tl.constexpr, DQ: tl.constexpr):
    """The code at position ``E`` of every word as an exact fp32 value (DQ=2: times 2^pos, DQ=3:
    times 2^(pos - 149)).

    DQ=0: shift, mask, integer-to-float convert (I2F, a quarter-rate unit); scale 1.
    DQ=1: shift, mask and OR into the mantissa of 2^23 (one LOP3), subtract 2^23; scale 1.
    DQ=2: as 1, but codes that already sit at or below bit 22 are not shifted, so the result is
          the code times 2^pos (exact); the caller folds 2^-pos into x (``_unscale``).
          ``mask_rt`` is the code mask as a run-time value: LOP3 takes one immediate, and with
          both the mask and 2^23 constant ptxas re-materialises a register per LOP3.
    DQ=3: as 2 without the OR and the FADD: the masked bits read as fp32 are a subnormal,
          ``q * 2^(pos - 149)`` exactly, so a code costs one LOP3 and its FFMA. The caller folds
          ``2^(149 - pos - DENORM_C)`` into x (``_unscale``), so every product is ``x q 2^-DENORM_C``,
          a normal number for ``|x q| >= 2^-62``; x must stay below ``2^(DENORM_C - 21)`` = 2^43 (the
          scaled x is finite). Needs subnormals kept by the FFMA (Triton emits no ``.ftz`` for
          fp32 arithmetic) and a caller that scales the sum back (``_denorm_back``). CUDA-core
          kernel with per-word-row groups only; elsewhere the kernels use DQ=2 in its place.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    if DQ == 0:
        return ((words >> (E * BITS)) & MASK).to(tl.float32)
    elif DQ == 1:
        b = ((words >> (E * BITS)) & MASK) | 0x4B000000   # 0x4B000000 = 2^23 as fp32
        return b.to(tl.float32, bitcast=True) - 8388608.0
    elif DQ == 2:
        SH: tl.constexpr = 0 if E * BITS + BITS <= 23 else 16
        b = ((words >> SH) & (mask_rt << (E * BITS - SH))) | 0x4B000000
        return b.to(tl.float32, bitcast=True) - 8388608.0
    else:
        SH: tl.constexpr = 0 if E * BITS + BITS <= 23 else 16
        b = (words >> SH) & (mask_rt << (E * BITS - SH))   # exponent field 0: a subnormal
        return b.to(tl.float32, bitcast=True)


@triton.jit
def _unscale(v, E: tl.constexpr, BITS: tl.constexpr, DQ: tl.constexpr):
    """``v`` times the power of two that undoes what ``_codes`` leaves on position ``E`` (exact):
    ``2^-pos`` (DQ=2), ``2^(149 - pos - DENORM_C)`` (DQ=3), 1 otherwise."""
    if DQ == 2:
        SH: tl.constexpr = 0 if E * BITS + BITS <= 23 else 16
        if E * BITS - SH != 0:
            return v * (1.0 / (1 << (E * BITS - SH)))
        else:
            return v
    elif DQ == 3:
        SH: tl.constexpr = 0 if E * BITS + BITS <= 23 else 16
        P2: tl.constexpr = 149 - (E * BITS - SH) - DENORM_C   # E*BITS - SH in 0..16: 2^69 .. 2^85
        return v * (2.0 ** P2)
    else:
        return v


@triton.jit
def _denorm_back(v, DQ: tl.constexpr):
    """DQ=3: ``v * 2^DENORM_C`` (sums of ``x q 2^-DENORM_C`` back to scale 1); else ``v``."""
    if DQ == 3:
        return v * (2.0 ** DENORM_C)
    else:
        return v


@triton.jit
def _denorm_fwd(v, DQ: tl.constexpr):
    """DQ=3: ``v * 2^-DENORM_C`` (a sum of x to the scale of the products); else ``v``."""
    if DQ == 3:
        return v * (2.0 ** -DENORM_C)
    else:
        return v


@triton.jit
def _program_tile(M, BM: tl.constexpr, BN: tl.constexpr):
    """This program's (column tile, K slice, row tile) ids, its ``BN`` columns, ``BM`` rows of x and
    the rows it reads (rows past M read row M-1; never stored)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    rows = pid_m * BM + tl.arange(0, BM)
    x_rows = tl.minimum(rows, M - 1)
    return pid_n, pid_k, pid_m, n, rows, x_rows


@triton.jit
def _wait_for_producer(PDL: tl.constexpr):
    """PDL: wait until the previous kernel in the stream has completed and its writes are visible
    (``griddepcontrol.wait``), then let the next one launch (``griddepcontrol.launch_dependents``).

    Everything a kernel reads before this must be constant across launches (the prepared weight);
    x, the output and the split-K workspace and counters are touched only after it. The early
    trigger is safe: a dependent kernel waits for this one's completion before reading its output,
    and it only gets SM resources as this grid's programs exit.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _finish(res, rows, n, M, N, pid_n, pid_k, pid_m, out_ptr, stride_om, ws_ptr, lock_ptr,
            BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, MERGE: tl.constexpr = 0):
    """Write the ``(BM, BN)`` fp32 tile ``res``: directly, or through the split-K workspace. ``MERGE`` 0: the
    last slice to arrive adds the partials (each slice counts itself and reads the count back); 1 (compiled
    kernels only: it polls): the grid's last slice (``pid_k = SPLIT_K - 1``, dispatched after every other slice)
    adds them, the others leave without reading the count back. Both add in slice order: the same bits."""
    omask = (rows[:, None] < M) & (n[None, :] < N)
    out_ptrs = out_ptr + rows[:, None] * stride_om + n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=omask)
    elif MERGE == 1:
        Mp = tl.num_programs(2) * BM
        lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
        if pid_k < SPLIT_K - 1:
            # -- publish this slice's partial sums and count it (release; the count is not read back)
            tl.store(ws_ptr + (pid_k * Mp + rows[:, None]) * N + n[None, :], res, mask=omask)
            tl.debug_barrier()
            tl.atomic_add(lock, 1, sem="release")
        else:
            # -- the last slice: poll the count (acquire; NaN after MERGE_SPIN_LIMIT polls, never a hang), add
            #    the published partials in slice order, its own last, and take its S - 1 arrivals off the count
            seen = tl.atomic_add(lock, 0, sem="acquire")
            polls = 0
            while (seen < SPLIT_K - 1) & (polls < MERGE_SPIN_LIMIT):
                seen = tl.atomic_add(lock, 0, sem="acquire")
                polls += 1
            tot = tl.zeros((BM, BN), tl.float32)
            for s in tl.static_range(SPLIT_K - 1):
                part = ws_ptr + (s * Mp + rows[:, None]) * N + n[None, :]
                tot += tl.load(part, mask=omask, other=0.0, cache_modifier=".cg")
            tot += res
            tot = tl.where(seen < SPLIT_K - 1, float("nan"), tot)
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=omask)
            # back to zero by subtraction: after a timed-out poll the late slices' adds still land and cancel out
            tl.atomic_add(lock, -(SPLIT_K - 1), sem="release")
    else:
        # -- publish this slice's partial sums, then count arrivals for the tile
        Mp = tl.num_programs(2) * BM
        ws = ws_ptr + (pid_k * Mp + rows[:, None]) * N + n[None, :]
        tl.store(ws, res, mask=omask)
        tl.debug_barrier()
        lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # -- last slice in: add every partial (L1 bypassed: other SMs wrote them) and reset
            tot = tl.zeros((BM, BN), tl.float32)
            for s in tl.static_range(SPLIT_K):
                part = ws_ptr + (s * Mp + rows[:, None]) * N + n[None, :]
                tot += tl.load(part, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(lock, 0)


@triton.jit
def _scale_zero(s_ptr, z_ptr, off, HAS_Z: tl.constexpr, ZP: tl.constexpr):
    """Scales and zero points (fp32) at offsets ``off`` of the ``(G, NP)`` tables."""
    s = tl.load(s_ptr + off).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + off).to(tl.float32)
    else:
        z = ZP
    return s, z


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, kw, n, K, stride_qk, EPW: tl.constexpr, GS: tl.constexpr,
                      HAS_Z: tl.constexpr, ZP: tl.constexpr):
    """Scales and zeros of word rows ``kw`` (one group per row), ``(BKW, BN)`` fp32."""
    g = tl.minimum(kw * EPW, K - 1) // GS       # padding rows use the last group
    return _scale_zero(s_ptr, z_ptr, g[:, None] * stride_qk + n[None, :], HAS_Z, ZP)


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
def _k_index(kw0, kwr, e: tl.constexpr, EPW: tl.constexpr, IW: tl.constexpr, BKW: tl.constexpr):
    """Column of K of code position ``e`` in word rows ``kw0 + kwr`` (``kw0`` a multiple of ``BKW``)
    under the ``IW``-row interleave. With ``BKW >= IW`` it is written as ``kw0 * EPW`` plus a
    pattern of ``kwr`` alone, so the compiler sees runs of ``IW`` contiguous columns."""
    if IW == 1:
        return (kw0 + kwr) * EPW + e
    elif BKW >= IW:
        return kw0 * EPW + (kwr // IW) * (IW * EPW) + e * IW + kwr % IW
    else:   # the tile is part of one block (BKW divides IW)
        return (kw0 // IW) * (IW * EPW) + kw0 % IW + e * IW + kwr


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
              GROUP_ROWS: tl.constexpr, IW: tl.constexpr, GLU: tl.constexpr):
    """Add one ``(BKW, BN)`` tile of words (with its scales ``s`` and zeros ``z``) times x to ``acc``.

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
            acc += s * (tl.sum(dot, axis=0) - z * xs)
        elif BM == 1:
            xs = _denorm_fwd(tl.sum(xsum, axis=0), DQE)
            acc += s * (tl.sum(dot, axis=0) - z * xs)
        else:
            xs = _denorm_fwd(tl.sum(xsum, axis=1), DQE)
            acc += s[None, :] * (tl.sum(dot, axis=1) - z * xs[:, None])
    elif not PER_ELEM_GROUP:
        # -- per word row: s (sum x q - z sum x); DQ=3: sum x to the 2^-DENORM_C scale of dot
        xsum = _denorm_fwd(xsum, DQE)
        if BM == 1:
            acc += s * (dot - z * xsum[:, None])
        else:
            acc += s[None, :, :] * (dot - z * xsum[:, :, None])
    return acc


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
                    IW: tl.constexpr, GLU: tl.constexpr = 0, MERGE: tl.constexpr = 0):
    """CUDA-core GEMV for small M: per code one LOP3 and one exact FMA, then one FMA per row of x.

    The zero point is applied per word row: ``sum x (q - z) s = s (sum x q - z sum x)``.
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
                            HAS_KG, BM, BKW, BN, DQE, EVEN_K, GROUP_ROWS, IW, GLU == 1)
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
                            HAS_KG, BM, BKW, BN, DQE, EVEN_K, GROUP_ROWS, IW, GLU == 1)
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
                    COMPUTE_F32: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr, IW: tl.constexpr):
    """Tensor-core GEMV for M up to 16: ``acc (BM, BN) += x[:, k_e] (BM, BKW) @ w_e (BKW, BN)``
    for each code position e, with ``w_e = (q - z) * s`` dequantized in the compute dtype.

    ``SWAP_AB``: compute ``acc^T (BN, BM) += w_e^T (BN, BKW) @ x[:, k_e]^T (BKW, BM)`` instead, so
    the dequantized weights are the MMA's A operand, which may stay in registers (only the packed
    words change layout), and the small x tile is the operand staged in shared memory.
    ``COMPUTE_F32``: multiply in fp32 (fp32 activations, or bf16 under the interpreter).
    DQ=3 (a CUDA-core variant) runs as DQ=2 here.
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
