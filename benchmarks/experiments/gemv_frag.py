"""Int4 GEMV (M = 1..16) on the tensor cores with the words laid out as the MMA's A fragments (Gluon).

Session 4-6's CUDA-core kernel spends ~3.4 instructions per code (issue-bound at 77-80% of the
floor on the large shapes, 1.3-1.9x a plain read of the same bytes); the "mma" kernel stages words
and x through shared memory. Here a prepare step lays the codes out so that one 16-byte load per
lane IS that lane's share of four ``mma.m16n8k16`` A fragments (Marlin's idea, our own layout):

* unit = 16 output rows x 64 K = 128 int32 words = 512 bytes, one per warp per iteration; word
  ``lane * 4 + reg`` of a unit (lane = 4 g + t, reg = 2 cb + rb) holds row ``r = 8 rb + g`` and
  word column ``c = 4 cb + t`` of the tf32-shaped A tile, i.e. the A-fragment register that
  ``DotOperandLayout(0, mma, k_width=1)`` gives that lane;
* the word's nibble ``p`` (bits 4p..) and ``p + 4`` (bits 16 + 4p..) are the bf16 pair at MMA
  k positions ``2c, 2c + 1`` of k16 step ``p``: one LOP3 makes ``(128 + q_lo, 128 + q_hi)`` in
  bf16x2 and one packed FMA subtracts ``128 + zero``, exactly;
* MMA k position ``kk`` of step ``p`` is K column ``16 t + 4 p + 2 (kk // 8) + kk % 2`` of the
  unit's 64 (``t = (kk % 8) // 2``), so a lane's x values for a step are 4 contiguous columns;
* units are stored ``[N / 16][K / 64]``: a warp walking K reads one contiguous 512-byte run.

Scales and zeros stay ``(G, NP)`` tables; the group's fp32 MMA result is scaled once per group.
Split-K as in ``gemv_quant._finish`` (fp32 partials, the last slice to arrive adds them).

    python benchmarks/experiments/gemv_frag.py --sass           # compile for sm_90a, static count
    python benchmarks/experiments/gemv_frag.py --check --time   # on a GPU
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

UNIT_WORDS = gl.constexpr(128)

if hasattr(gl, "thread_barrier"):    # Triton 3.6
    @gluon.jit
    def _cta_barrier():
        gl.thread_barrier()
else:                                # Triton 3.9 renamed it
    @gluon.jit
    def _cta_barrier():
        gl.barrier()


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
def _chunk_loads(w_ptrs, x_ptrs, s_ptrs, z_ptrs, c, c_hi, xk, K, stride_s, stride_c, GS: gl.constexpr,
                 HAS_Z: gl.constexpr, EVEN_K: gl.constexpr):
    """Everything chunk ``c`` (128 columns of K: two 64-column blocks) needs, issued together: its
    words ``(J, 256)``, its two x tiles, its group's scales and zeros. ``c`` past ``c_hi - 1`` reads
    chunk ``c_hi - 1`` again (the prefetch past the end: cache hits, never used)."""
    c = gl.minimum(c, c_hi - 1)
    words = gl.load(w_ptrs + c.to(gl.int64) * stride_c)
    kx = c * 128
    if EVEN_K:
        x0 = gl.load(x_ptrs + kx)
        x1 = gl.load(x_ptrs + kx + 64)
    else:
        x0 = gl.load(x_ptrs + kx, mask=(kx + xk < K)[None, :], other=0.0)
        x1 = gl.load(x_ptrs + kx + 64, mask=(kx + 64 + xk < K)[None, :], other=0.0)
    g = kx // GS
    s = gl.load(s_ptrs + g * stride_s)
    if HAS_Z:
        z = gl.load(z_ptrs + g * stride_s)
    else:
        z = s
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
def gemv_frag_kernel(x_ptr, fw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, lock_ptr,
                     M, N, K, KC, stride_s, stride_xm, stride_om, KC_SPLIT, stride_u, stride_c,
                     BM: gl.constexpr, W: gl.constexpr, NT: gl.constexpr, GS: gl.constexpr,
                     HAS_Z: gl.constexpr, ZP: gl.constexpr, SPLIT_K: gl.constexpr, EVEN_K: gl.constexpr,
                     AHEAD: gl.constexpr):
    """``out (M, N) = x (M, K) @ dequant(W)^T`` for int4 words in the fragment layout; a program owns
    ``16 W NT`` rows of W and one of ``SPLIT_K`` slices of ``KC`` 128-column chunks. ``AHEAD`` (1 or
    2): chunks whose loads are in flight while one is multiplied (register prefetch)."""
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

    # -- pointers at chunk 0: words (J, 256) with 16 contiguous bytes per lane and block; x (BM, 64),
    #    32 contiguous bytes per lane, the same in every warp (rows past M read row M - 1, never
    #    stored); scales and zeros of the rows in the MMA result's layout
    j = gl.arange(0, J, layout=gl.SliceLayout(1, ld_l))
    wi = gl.arange(0, 2 * UNIT_WORDS, layout=gl.SliceLayout(0, ld_l))
    w_ptrs = fw_ptr + (pid_n * J + j).to(gl.int64)[:, None] * stride_u + wi[None, :]
    xm = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
    xk = gl.arange(0, 64, layout=gl.SliceLayout(0, x_l))
    x_ptrs = x_ptr + gl.minimum(xm, M - 1)[:, None] * stride_xm + xk[None, :]
    ns = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    s_ptrs = s_ptr + ns
    z_ptrs = z_ptr + pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))

    c_lo = pid_k * KC_SPLIT
    c_hi = gl.minimum(c_lo + KC_SPLIT, KC)
    acc = gl.zeros((BN, BM), gl.float32, layout=mma)
    # -- the register pipeline: AHEAD chunks in flight
    w0, xa0, xb0, s0, z0 = _chunk_loads(w_ptrs, x_ptrs, s_ptrs, z_ptrs, c_lo, c_hi, xk, K, stride_s, stride_c, GS, HAS_Z, EVEN_K)
    if AHEAD == 2:
        w1, xa1, xb1, s1, z1 = _chunk_loads(w_ptrs, x_ptrs, s_ptrs, z_ptrs, c_lo + 1, c_hi, xk, K, stride_s, stride_c, GS, HAS_Z, EVEN_K)
    for c in range(c_lo, c_hi):
        wn, xan, xbn, sn, zn = _chunk_loads(w_ptrs, x_ptrs, s_ptrs, z_ptrs, c + AHEAD, c_hi, xk, K, stride_s, stride_c, GS, HAS_Z,
                                            EVEN_K)
        acc = _chunk_mma(acc, w0, xa0, xb0, s0, z0, J, BN, BM, HAS_Z, ZP, mma, w_l, a_l, b_l)
        if AHEAD == 2:
            w0, xa0, xb0, s0, z0 = w1, xa1, xb1, s1, z1
            w1, xa1, xb1, s1, z1 = wn, xan, xbn, sn, zn
        else:
            w0, xa0, xb0, s0, z0 = wn, xan, xbn, sn, zn
    # -- out[m, n] = acc[n, m]: directly, or through the split-K workspace
    mo = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    omask = (mo[None, :] < M) & (ns[:, None] < N)
    if SPLIT_K == 1:
        gl.store(out_ptr + mo[None, :] * stride_om + ns[:, None], acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        gl.store(ws_ptr + (pid_k * BM + mo[None, :]) * N + ns[:, None], acc, mask=omask)
        _cta_barrier()
        lock = lock_ptr + pid_n
        arrived = gl.atomic_add(lock, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tot = gl.zeros((BN, BM), gl.float32, layout=mma)
            for sk in gl.static_range(SPLIT_K):
                tot += gl.load(ws_ptr + (sk * BM + mo[None, :]) * N + ns[:, None], mask=omask, other=0.0,
                               cache_modifier=".cg")
            gl.store(out_ptr + mo[None, :] * stride_om + ns[:, None], tot.to(out_ptr.dtype.element_ty), mask=omask)
            gl.atomic_xchg(lock, 0)


# -- the layout --------------------------------------------------------------------------------------

def _kcol(kk, p):
    return 16 * ((kk % 8) // 2) + 4 * p + 2 * (kk // 8) + kk % 2


def pack_fragments(codes: np.ndarray, bn_align: int = 128) -> np.ndarray:
    """int4 codes ``(N, K)`` (0..15) -> int32 words ``(NP / 16, KB, 128)`` in the fragment layout
    (N padded to ``bn_align`` rows, K to 128 columns, padding codes 0)."""
    N, K = codes.shape
    NP = -(-N // bn_align) * bn_align
    KB = 2 * -(-K // 128)   # whole 128-column chunks
    c = np.zeros((NP, KB * 64), dtype=np.uint32)
    c[:N, :K] = codes
    c = c.reshape(NP // 16, 16, KB, 64)                       # (u, r, kb, col)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    words = np.zeros((NP // 16, KB, 32, 4), dtype=np.uint32)
    for reg in range(4):
        cb, rb = reg // 2, reg % 2
        r = 8 * rb + g                                         # (32,)
        col = 4 * cb + t                                       # word column: MMA k positions 2col, 2col + 1
        w = np.zeros((NP // 16, KB, 32), dtype=np.uint32)
        for p in range(4):
            # c[:, r, :, k] with r, k (32,) index arrays -> (32, U, KB) -> (U, KB, 32)
            w |= c[:, r, :, _kcol(2 * col, p)].transpose(1, 2, 0) << np.uint32(4 * p)
            w |= c[:, r, :, _kcol(2 * col + 1, p)].transpose(1, 2, 0) << np.uint32(16 + 4 * p)
        words[:, :, :, reg] = w
    return words.reshape(NP // 16, KB, 128).view(np.int32)


# -- tools -------------------------------------------------------------------------------------------

SIG = {"x_ptr": "*bf16", "fw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
       "ws_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KC": "i32", "stride_s": "i32",
       "stride_xm": "i32", "stride_om": "i32", "KC_SPLIT": "i32", "stride_u": "i32", "stride_c": "i32", "BM": "constexpr", "W": "constexpr",
       "NT": "constexpr", "GS": "constexpr", "HAS_Z": "constexpr", "ZP": "constexpr", "SPLIT_K": "constexpr", "EVEN_K": "constexpr",
       "AHEAD": "constexpr"}


def sass_count(bm=8, w=4, nt=1, split=4, ahead=1) -> None:
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    aligned = ("x_ptr", "fw_ptr", "s_ptr", "z_ptr", "out_ptr", "ws_ptr", "lock_ptr", "N", "K", "stride_s", "stride_xm",
               "stride_om", "stride_u", "stride_c")
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(SIG) if a in aligned}
    consts = {"BM": bm, "W": w, "NT": nt, "GS": 128, "HAS_Z": True, "ZP": 8, "SPLIT_K": split, "EVEN_K": True,
              "AHEAD": ahead}
    ck = triton.compile(GluonASTSource(gemv_frag_kernel, SIG, consts, attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=w))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gemv_sass_count as C

    sass, _ = C.disassemble(ck.asm["cubin"])
    loop = C.sass_loop(sass)
    codes = 64 * nt   # codes per thread per loop iteration (one group of 128: BN x 128 / (32 W))
    print(f"BM {bm} W {w} NT {nt} AHEAD {ahead}: registers {C.registers(ck.asm['cubin'])}, loop {loop['instructions']} "
          f"instructions, {loop['instructions'] / codes:.2f} per code per thread")
    print(loop["by_opcode"])


def launch(x, fw, s, z, out, ws, lock, M, N, K, split, w=4, nt=1, ahead=1, chunk_major=False):
    """``fw``: (NU, KC, 256) words (unit-major) or (KC, NU, 256) (``chunk_major``)."""
    NU, KC = (fw.shape[1], fw.shape[0]) if chunk_major else (fw.shape[0], fw.shape[1])
    stride_u, stride_c = (256, NU * 256) if chunk_major else (KC * 256, 256)
    bm = 8 if M <= 8 else 16
    kc_split = -(-KC // split)
    grid = (NU // (w * nt), split)
    gemv_frag_kernel[grid](x, fw, s, z, out, ws, lock, M, N, K, KC, s.stride(0), x.stride(0), out.stride(0), kc_split,
                           stride_u, stride_c, BM=bm, W=w, NT=nt, GS=128, HAS_Z=True, ZP=8, SPLIT_K=split,
                           EVEN_K=K % 128 == 0, AHEAD=ahead, num_warps=w)


def check(N=4096, K=4096, Ms=(1, 5, 16), seed=0) -> list:
    """Random codes, the fragment layout, every M against float64 numpy; returns error rows."""
    import torch

    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint32)
    G = K // 128
    NP = -(-N // 128) * 128
    s = np.zeros((G, NP), np.float32)
    z = np.zeros((G, NP), np.float32)
    s[:, :N] = rng.random((G, N)) * 0.02 + 0.001
    z[:, :N] = rng.integers(0, 16, size=(G, N))
    st, zt = torch.from_numpy(s).to(torch.bfloat16), torch.from_numpy(z).to(torch.bfloat16)
    kg = np.arange(K) // 128
    wdq = (codes - zt.float().numpy()[kg, :N].T) * st.float().numpy()[kg, :N].T
    fw_u = torch.from_numpy(pack_fragments(codes)).cuda()
    fw_u = fw_u.reshape(fw_u.shape[0], -1, 256)          # (NU, KC, 256): unit-major
    fw_c = fw_u.transpose(0, 1).contiguous()              # (KC, NU, 256): chunk-major
    rows = []
    for M in Ms:
        for split in (1, 4):
            for w, nt, ahead, cm in ((4, 1, 1, False), (4, 2, 2, False), (4, 2, 1, True), (8, 1, 1, True)):
                fw = fw_c if cm else fw_u
                if fw_u.shape[0] % (w * nt):
                    continue
                x = rng.standard_normal((M, K)).astype(np.float32)
                xs = torch.from_numpy(x).to(torch.bfloat16)
                ref = xs.double().numpy() @ wdq.T
                out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
                ws = torch.empty((split, 16, N), dtype=torch.float32, device="cuda")
                lock = torch.zeros(fw_u.shape[0], dtype=torch.int32, device="cuda")
                launch(xs.cuda(), fw, st.cuda(), zt.cuda(), out, ws, lock, M, N, K, split, w, nt, ahead, cm)
                got = out.double().cpu().numpy()
                err = float(np.abs(got - ref).max() / np.abs(ref).max()) if np.isfinite(got).all() else float("inf")
                rows.append({"M": M, "split": split, "W": w, "NT": nt, "AHEAD": ahead, "chunk_major": cm,
                             "rel_err": err})
                print(f"check N={N} K={K} M={M} split={split} W={w} NT={nt} AHEAD={ahead} chunk-major={cm}: "
                      f"max rel err {err:.2e}", flush=True)
    return rows


def time_it(shapes, Ms=(1, 16), splits=(1, 2, 4, 8, 16),
            tiles=((4, 1, 1, False), (4, 2, 1, False), (8, 1, 1, False), (4, 1, 1, True), (4, 2, 1, True),
                   (8, 1, 1, True), (4, 4, 1, True), (2, 2, 1, True))) -> list:
    """Per-call time in a CUDA graph, weights rotated over > 4x L2 (as benchmarks/gemv.py)."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import gemv as GB

    rows = []
    for N, K in shapes:
        KB, G = 2 * -(-K // 128), K // 128
        NP = -(-N // 128) * 128
        nbytes = N * K // 2 + 4 * N * G
        copies = GB.copies_for(nbytes)
        sets = [(torch.randint(-2**31, 2**31 - 1, (NP // 16 * KB // 2, 256), dtype=torch.int32, device="cuda"),
                 (torch.rand(G, NP, device="cuda") * 0.01).to(torch.bfloat16),
                 torch.randint(0, 16, (G, NP), device="cuda").to(torch.bfloat16)) for _ in range(copies)]
        for M in Ms:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            best = None
            for split in splits:
                for w, nt, ahead, cm in tiles:
                    if (NP // 16) % (w * nt) or G % split:
                        continue
                    shape = (KB // 2, NP // 16, 256) if cm else (NP // 16, KB // 2, 256)
                    ws = torch.empty((split, 16, N), dtype=torch.float32, device="cuda")
                    lock = torch.zeros(NP // 16, dtype=torch.int32, device="cuda")
                    fns = [(lambda st=st, ws=ws, lock=lock, split=split, w=w, nt=nt, ahead=ahead, cm=cm, shape=shape:
                            launch(x, st[0].view(shape), st[1], st[2], out, ws, lock, M, N, K, split, w, nt, ahead, cm))
                           for st in sets]
                    try:
                        us = GB.graph_us(fns)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {N}x{K} M={M} split={split} W={w} NT={nt} AHEAD={ahead} cm={cm}: {type(e).__name__} "
                              f"{str(e)[:120]}")
                        continue
                    r = {"N": N, "K": K, "M": M, "split": split, "W": w, "NT": nt, "AHEAD": ahead, "chunk_major": cm,
                         "us": us,
                         "TBps": (nbytes + 2 * M * (K + N)) / (us * 1e-6) / 1e12}
                    rows.append(r)
                    if best is None or us < best["us"]:
                        best = r
            print(f"{N}x{K} M={M}: best {best['us']:.2f} us ({best['TBps']:.2f} TB/s) split {best['split']} "
                  f"W {best['W']} NT {best['NT']} AHEAD {best['AHEAD']} chunk-major {best['chunk_major']}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", action="store_true", help="static count of the loop for sm_90a (no GPU)")
    ap.add_argument("--check", action="store_true", help="run on the GPU against float64 numpy")
    ap.add_argument("--time", action="store_true", help="time on the GPU (CUDA graph)")
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "6144x4096", "14336x4096", "4096x14336", "28672x4096",
                                                    "8192x8192", "28672x8192", "16384x16384", "128256x4096"],
                    help="NxK shapes for --time")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.sass or not (args.check or args.time):
        sass_count()
    res = {}
    if args.check:
        res["check"] = check()
    if args.time:
        res["time"] = time_it([tuple(int(v) for v in sh.split("x")) for sh in args.shapes])
    if res:
        import datetime
        import json

        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"gemv-frag-{datetime.date.today().isoformat()}{args.tag}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(path)
