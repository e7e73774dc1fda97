"""Triton body of the int4 tensor-core GEMV with group-scaled MMAs (``GemvConfig`` kind "mma").

Same internal layout, split-K workspace and program tiling as the other GEMV kernels
(``kernels/gemv_quant.py``; the helpers of ``kernels/gemv_common.py`` in the same Triton flavour).
"""

import triton
import triton.language as tl

from . import load

_q = load("gemv_common")
_finish = _q._finish
_k_index = _q._k_index
_program_tile = _q._program_tile
_wait_for_producer = _q._wait_for_producer


#: ``gemv_mma_kernel``: the 16-bit pattern of ``MAGIC + q`` is ``MAGIC_BITS | q`` for a 4-bit code q
#: (fp16: 1024 = 0x6400, 10 mantissa bits; bf16: 128 = 0x4300, 7 mantissa bits)
_MAGIC_F16 = tl.constexpr(1024.0)
_MAGIC_BF16 = tl.constexpr(128.0)


@triton.jit
def _code_pair(words, zc2, P: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    """Codes ``P`` and ``P + 4`` of every word (bits ``4P`` and ``16 + 4P``) minus their zero point,
    as two exact 16-bit floats ``(lo, hi)`` (fp16 if ``F16``, else bf16).

    ``zc2``: ``MAGIC + z`` in both halves of an int32 (the float's bits). One LOP3 puts each code in
    the mantissa of ``MAGIC`` (``(w >> 4P) & 0x000F000F | MAGIC_BITS``, both halves at once), one
    packed subtract (``fma.rn`` with 1.0, the bf16x2 form sm_80 has) leaves ``q - z``; the two halves
    are the MMA operand's register pair as they are. ``ASM=False`` (the interpreter, which runs no
    PTX) computes the same values with Triton ops, in fp32.
    """
    v = words >> (4 * P)
    if ASM:
        if F16:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, one; mov.b32 one, 0x3C003C00; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; "
                "fma.rn.f16x2 t, t, one, $3; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [v, zc2 ^ -2147450880], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, one; mov.b32 one, 0x3F803F80; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; "
                "fma.rn.bf16x2 t, t, one, $3; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [v, zc2 ^ -2147450880], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        zc = (zc2 & 0xFFFF).to(tl.int16).to(tl.float16 if F16 else tl.bfloat16, bitcast=True).to(tl.float32)
        lo = (v & 0xF).to(tl.float32) - (zc - (_MAGIC_F16 if F16 else _MAGIC_BF16))
        hi = ((v >> 16) & 0xF).to(tl.float32) - (zc - (_MAGIC_F16 if F16 else _MAGIC_BF16))
    return lo, hi


@triton.jit
def _group_dot_tile(words, zc2, x_ptr, x_rows, stride_xm, k, K, BN: tl.constexpr, BM: tl.constexpr,
                    BKW: tl.constexpr, IW: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
                    EVEN_K: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """``sum_p w_p @ x_p`` over one group (``gemv_mma_kernel``): x over the tile's columns ``k`` (8 BKW,
    contiguous) in one load, split into the four ``x_p`` in registers, four MMAs of K = 2 BKW."""
    # -- x (BM, 8 BKW) -> x_p (2 BKW, BM): dot column 2 kw + h of pair p is k = blk*64 + h*32 + p*8 + r
    if EVEN_K:
        xg = tl.load(x_ptr + x_rows[:, None] * stride_xm + k[None, :])
    else:
        xg = tl.load(x_ptr + x_rows[:, None] * stride_xm + k[None, :], mask=k[None, :] < K, other=0.0)
    if COMPUTE_F32:
        xg = xg.to(tl.float32)
    xg = xg.reshape(BM, BKW // IW, 2, 2, 2, IW).permute(1, 5, 2, 0, 3, 4)   # (blk, r, h, m, p >> 1, p & 1)
    x_even, x_odd = tl.split(xg)
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    # -- one MMA per code pair, its two halves adjacent columns
    accg = tl.zeros((BN, BM), tl.float32)
    for p in tl.static_range(4):
        lo, hi = _code_pair(words, zc2, p, F16, ASM)
        wp = tl.join(lo, hi).reshape(BN, 2 * BKW)
        if p == 0:
            xp = x0.reshape(2 * BKW, BM)
        elif p == 1:
            xp = x1.reshape(2 * BKW, BM)
        elif p == 2:
            xp = x2.reshape(2 * BKW, BM)
        else:
            xp = x3.reshape(2 * BKW, BM)
        if COMPUTE_F32:
            accg = tl.dot(wp.to(tl.float32), xp, accg, input_precision="ieee")
        else:
            accg = tl.dot(wp.to(x_ptr.dtype.element_ty), xp, accg)
    return accg


@triton.jit
def _group_dot_runs(words, zc2, x_ptr, x_rows, stride_xm, kw0, kwr, K, BN: tl.constexpr, BM: tl.constexpr,
                    BKW: tl.constexpr, IW: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr,
                    EVEN_K: tl.constexpr, COMPUTE_F32: tl.constexpr):
    """``sum_e w_e @ x_e`` over one group (``gemv_mma_kernel`` with ``X_RUNS``): eight MMAs of K = BKW,
    one per code position e, x[:, k_e] loaded as it lies (``_k_index``: runs of IW columns)."""
    accg = tl.zeros((BN, BM), tl.float32)
    for p in tl.static_range(4):
        lo, hi = _code_pair(words, zc2, p, F16, ASM)
        for h in tl.static_range(2):
            k = _k_index(kw0, kwr, p + 4 * h, 8, IW, BKW)
            if EVEN_K:
                xe = tl.load(x_ptr + x_rows[None, :] * stride_xm + k[:, None])
            else:
                xe = tl.load(x_ptr + x_rows[None, :] * stride_xm + k[:, None], mask=k[:, None] < K, other=0.0)
            we = lo if h == 0 else hi
            if COMPUTE_F32:
                accg = tl.dot(we.to(tl.float32), xe.to(tl.float32), accg, input_precision="ieee")
            else:
                accg = tl.dot(we.to(x_ptr.dtype.element_ty), xe, accg)
    return accg


@triton.jit
def gemv_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, lock_ptr,
                    M, N, K, KWP, stride_qk, stride_xm, stride_om, K_SPLIT_W,
                    GS: tl.constexpr, ZP: tl.constexpr, HAS_Z: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BKW: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, IW: tl.constexpr,
                    ASM: tl.constexpr, COMPUTE_F32: tl.constexpr, PDL: tl.constexpr, X_RUNS: tl.constexpr):
    """Tensor-core int4 GEMV for M up to 16 with the scales applied after the MMA.

    Each K tile (``BKW`` word rows, ``8 BKW`` columns of K) lies in one group, so
    ``acc (BN, BM) += s[n] * sum_p w_p (BN, 2 BKW) @ x_p (2 BKW, BM)`` where ``w_p`` holds the
    integers ``q - z`` of code positions ``p`` and ``p + 4`` (``_code_pair``; exact in fp16 / bf16)
    and ``x_p`` the columns of x they meet. Dot column ``2 kw + h`` of ``w_p`` is code ``p + 4 h`` of
    word row ``kw``, i.e. the two halves of one register, so the dequantized tile needs no
    re-layout; under the ``IW = 8`` interleave those columns are
    ``k = kw0 * 8 + (kw // 8) * 64 + h * 32 + p * 8 + kw % 8``, which ``x_p`` takes from one
    contiguous ``(BM, 8 BKW)`` load (pipelined by Triton with the words) by reshape and permute.

    ``X_RUNS``: eight MMAs of K = ``BKW`` instead, one per code position e, with x read as it lies
    (``_k_index``: runs of ``IW`` contiguous columns, 16-byte copies straight to the MMA's shared
    operand) and the halves of ``_code_pair`` as separate operands (one PRMT per two codes re-pairs
    them). H200 (M=16): faster at 4096 x 14336 (24.3 vs 32.0 us) and 4096^2 (11.2 vs 13.3), slower at
    28672 x 8192 (83.8 vs 77.9).
    Needs int4 whole-word regular groups, ``IW == 8``, no act-order permutation; fp16 / bf16 x
    (``COMPUTE_F32``: fp32 x or the interpreter's bf16, multiplied in fp32).
    ``PDL``: launched as a programmatic dependent (``_wait_for_producer`` before the first load).
    """
    F16: tl.constexpr = x_ptr.dtype.element_ty == tl.float16
    MAGIC: tl.constexpr = _MAGIC_F16 if F16 else _MAGIC_BF16
    pid_n, pid_k, pid_m, n, rows, x_rows = _program_tile(M, BM, BN)
    w_ptrs = qw_ptr + tl.arange(0, BKW)[None, :] * stride_qk + n[:, None]    # (BN, BKW)
    kx = tl.arange(0, 8 * BKW)
    kwr = tl.arange(0, BKW)
    acc = tl.zeros((BN, BM), tl.float32)
    kw_begin = pid_k * K_SPLIT_W
    _wait_for_producer(PDL)
    for kw0 in range(kw_begin, tl.minimum(kw_begin + K_SPLIT_W, KWP), BKW):
        # -- the tile's words, its group's scales and MAGIC + zero (both halves of an int32)
        words = tl.load(w_ptrs + kw0 * stride_qk)
        g_off = (tl.minimum(kw0 * 8, K - 1) // GS) * stride_qk + n   # padding rows use the last group
        s = tl.load(s_ptr + g_off).to(tl.float32)
        if HAS_Z:
            zc = tl.load(z_ptr + g_off).to(tl.float32) + MAGIC
        else:
            zc = tl.full((BN,), ZP + MAGIC, tl.float32)
        zb = zc.to(tl.float16 if F16 else tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        zc2 = (zb | (zb << 16))[:, None]
        # -- the group's sum of (q - z) * x, then its scale
        if X_RUNS:
            accg = _group_dot_runs(words, zc2, x_ptr, x_rows, stride_xm, kw0, kwr, K, BN, BM, BKW, IW, F16, ASM,
                                   EVEN_K, COMPUTE_F32)
        else:
            accg = _group_dot_tile(words, zc2, x_ptr, x_rows, stride_xm, kw0 * 8 + kx, K, BN, BM, BKW, IW, F16, ASM,
                                   EVEN_K, COMPUTE_F32)
        acc += s[:, None] * accg
    # -- write (BM, BN)
    _finish(tl.trans(acc), rows, n, M, N, pid_n, pid_k, pid_m, out_ptr, stride_om, ws_ptr, lock_ptr, BM, BN, SPLIT_K)
