"""Triton helpers shared by the quantized GEMV kernels (``gemv_quant.py``: CUDA cores and the tensor-core "dot"
kernel; ``gemv_mma.py``: the group-scaled tensor-core kernel): dequantization of the codes of a word, a program's
tile ids, the programmatic-dependent-launch wait, the split-K merge, scale and zero lookups, and the column of K
of a code under the row interleave.

The weight layout they read is ``portakern.ir.gemv_layout``'s (summarised in ``gemv_quant.py``). Split-K
partials go to an fp32 workspace; the last slice to finish a tile (one arrival counter per tile, which that
slice resets) adds them and writes the output once, so a launch needs no zeroed buffer and no second kernel
(``_finish``).
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
