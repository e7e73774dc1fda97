"""M=1 int4 GEMV with the K split inside the program: does it beat the table's split-K epilogue?

``benchmarks/experiments/gemv_anatomy.py`` (session 8) put the table kernel's split-K epilogue (partials
to a workspace, an arrival counter, the last slice adds them) at 0.6-3.8 us per call. Here one program
owns ``BN`` columns and ``S`` sub-slices of its K range at once: a 3-D tile of words,
``R`` word rows of one group per sub-slice (a ``(S, R, BN)`` tile), the warps spread over the sub-slices, each thread holding
all ``R`` rows of its columns (so the row sums and the group's scale stay in registers, as in the
table's group-resident tiles). The sub-slices meet once, at the end, in one cross-warp sum; a global
split (``SPLIT_K`` > 1) still goes through the table kernel's epilogue.

Checked against float64 on two shapes, then timed in a CUDA graph against the table GEMV (same
process, buffers rotated past 4x the L2) over ``BN``, ``R``, ``S`` and the global split.

    python benchmarks/experiments/gemv_rows3.py [--out DIR] [--tag T]
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import gemv as GB  # noqa: E402  (benchmarks/gemv.py)
import harness as H  # noqa: E402
from portakern.backends.triton import quant_gemv as Q  # noqa: E402
from portakern.backends.triton.kernels import load as load_kernels  # noqa: E402

GQ = load_kernels("gemv_quant")
_codes, _unscale, _denorm_fwd, _denorm_back = GQ._codes, GQ._unscale, GQ._denorm_fwd, GQ._denorm_back
_finish, _wait_for_producer = GQ._finish, GQ._wait_for_producer

SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (14336, 4096), (28672, 4096), (8192, 8192), (28672, 8192)]


@triton.jit
def gemv_rows3_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, lock_ptr, N, K, KWP, stride_qk, K_SPLIT_W,
                      mask_rt, GS: tl.constexpr, BN: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                      SPLIT_K: tl.constexpr, IW: tl.constexpr, PDL: tl.constexpr):
    EPW: tl.constexpr = 8
    BITS: tl.constexpr = 4
    DQ: tl.constexpr = 3
    # -- this program: BN columns, K rows [kw_begin, kw_begin + K_SPLIT_W) as S sub-slices of SL rows
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    r = tl.arange(0, R)
    SL = K_SPLIT_W // S
    row0 = pid_k * K_SPLIT_W + tl.arange(0, S) * SL                                   # (S,)
    # (S, R, BN): with S first, Triton's layout gives the sub-slices to the warps and each thread all R rows
    w_ptrs = qw_ptr + (row0[:, None, None] + r[None, :, None]) * stride_qk + n[None, None, :]
    # -- first tile with its scales and zeros (constant weights: before waiting for the producer)
    words = tl.load(w_ptrs)
    soff = ((row0 * EPW) // GS)[:, None] * stride_qk + n[None, :]                     # (S, BN)
    sc = tl.load(s_ptr + soff).to(tl.float32)
    zc = tl.load(z_ptr + soff).to(tl.float32)
    _wait_for_producer(PDL)
    acc = tl.zeros((S, BN), tl.float32)
    for it in range(0, SL, R):
        # -- next tile in flight while this one is computed
        nxt = tl.where(it + R < SL, it + R, it)
        words_n = tl.load(w_ptrs + nxt * stride_qk)
        soff_n = (((row0 + nxt) * EPW) // GS)[:, None] * stride_qk + n[None, :]
        sc_n = tl.load(s_ptr + soff_n).to(tl.float32)
        zc_n = tl.load(z_ptr + soff_n).to(tl.float32)
        # -- per code position: one LOP3 + one FFMA per code; x in runs of IW (the word interleave)
        kw0 = row0 + it
        dot = tl.zeros((S, R, BN), tl.float32)
        xs = tl.zeros((S, R), tl.float32)
        for e in tl.static_range(EPW):
            k = kw0[:, None] * EPW + (r[None, :] // IW) * (IW * EPW) + e * IW + r[None, :] % IW   # (S, R)
            xe = tl.load(x_ptr + k).to(tl.float32)
            dot += _unscale(xe, e, BITS, DQ)[:, :, None] * _codes(words, mask_rt, e, BITS, DQ)
            xs += xe
        # -- one group per sub-slice and tile: s (sum x q - z sum x), rows summed in registers
        acc += sc * (tl.sum(dot, axis=1) - zc * _denorm_fwd(tl.sum(xs, axis=1), DQ)[:, None])
        words, sc, zc = words_n, sc_n, zc_n
    # -- the sub-slices meet once (cross-warp), then the global split's epilogue if any
    res = _denorm_back(tl.sum(acc, axis=0), DQ)[None, :]
    _finish(res, tl.arange(0, 1), n, 1, N, pid_n, pid_k, 0, out_ptr, N, ws_ptr, lock_ptr, 1, BN, SPLIT_K)


def launcher(w, N, K, BN, R, S, split, warps):
    KWP, sqk = w.KWP, w.stride_qk
    if KWP % (split * S * R) or (KWP // (split * S)) % R or N % BN:
        return None
    tiles_n = N // BN
    ws = torch.empty((split, 1, N), dtype=torch.float32, device="cuda")
    lock = torch.zeros((tiles_n,), dtype=torch.int32, device="cuda")

    def run(x, w, out):
        gemv_rows3_kernel[(tiles_n, split)](x, w.qweight, w.scales, w.zeros, out, ws, lock, N, K, KWP, sqk,
                                             KWP // split, 15, GS=128, BN=BN, R=R, S=S, SPLIT_K=split, IW=w.interleave,
                                             PDL=True, num_warps=warps, num_stages=1, launch_pdl=True)
    return run


def reference(x, w, N, K):
    codes = Q.unpack_internal(w.qweight.cpu().numpy(), 4, w.interleave, N, K).astype(np.float64)
    s = w.scales.float().cpu().numpy()[:, :N].T.astype(np.float64)
    z = w.zeros.float().cpu().numpy()[:, :N].T.astype(np.float64)
    W = (codes - np.repeat(z, 128, axis=1)) * np.repeat(s, 128, axis=1)
    return x.double().cpu().numpy() @ W.T


def candidates(N):
    for BN, warps_per_slice in ((256, 2), (128, 1)):
        for R in (8, 16):
            for S in (2, 4, 8):
                for split in (1, 2, 4, 8):
                    yield BN, R, S, split, warps_per_slice * S


def _warm(cands):
    """Compile (into Triton's disk cache) by launching each candidate once on a 4096 x 4096 problem."""
    w = GB.random_prepared(4096, 4096, 4, 128, False)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    for c in cands:
        run = launcher(w, 4096, 4096, *c)
        if run is not None:
            run(x, w, out)
    torch.cuda.synchronize()
    return len(cands)


def precompile(workers):
    import concurrent.futures as cf
    import multiprocessing

    cands = list(candidates(0))
    parts = [cands[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        print(f"precompiled {sum(ex.map(_warm, parts))} candidates", flush=True)


def main():
    args = H.parse_args(__doc__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = GB.copy_bandwidth_TBps()
    res = H.header(__doc__, bw, check=[], rows=[])
    print(f"copy {bw:.3f} TB/s", flush=True)
    # -- correctness first (float64 reference from the internal layout)
    for N, K in ((4096, 4096), (6144, 14336)):
        w = GB.random_prepared(N, K, 4, 128, False)
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        ref = reference(x, w, N, K)
        for BN, R, S, split, warps in ((256, 8, 4, 2, 8), (128, 16, 8, 1, 8), (256, 16, 2, 4, 4)):
            run = launcher(w, N, K, BN, R, S, split, warps)
            out = torch.full((1, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            for _ in range(2):   # twice: the split-K counters reset themselves
                run(x, w, out)
            err = float(np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max())
            res["check"].append({"N": N, "K": K, "BN": BN, "R": R, "S": S, "split": split, "rel_err": err})
            print(f"check {N}x{K} BN {BN} R {R} S {S} split {split}: rel err {err:.2e}", flush=True)
    precompile(max(1, min(12, (os.cpu_count() or 2) - 2)))
    ok = all(c["rel_err"] < 1e-2 for c in res["check"])
    print("correct" if ok else "WRONG: not timing", flush=True)
    if ok:
        for N, K in SHAPES:
            op = GB.gemv_op(1, N, K)
            copies = GB.copies_for(GB.floor_bytes(op))
            fns, _ = GB.ours(op, None, copies)
            row = {"N": N, "K": K, "floor_us": GB.floor_bytes(op) / (bw * 1e12) * 1e6, "table_us": GB.graph_us(fns),
                   "sweep": []}
            del fns
            sets = [(torch.randn(1, K, device="cuda").to(torch.bfloat16), GB.random_prepared(N, K, 4, 128, False),
                     torch.empty(1, N, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
            for BN, R, S, split, warps in candidates(N):
                progs = (N // BN) * split
                if not (4 * sms <= progs * warps <= 40 * sms):   # 4 to 40 warps per SM
                    continue
                run = launcher(sets[0][1], N, K, BN, R, S, split, warps)
                if run is None:
                    continue
                us = GB.graph_us([(lambda s=s: run(*s)) for s in sets])
                row["sweep"].append({"BN": BN, "R": R, "S": S, "split": split, "warps": warps, "us": us})
            del sets
            torch.cuda.empty_cache()
            res["rows"].append(row)
            if not row["sweep"]:
                print(f"{N:>6}x{K:<5} no candidate fits", flush=True)
                continue
            best = row["best"] = min(row["sweep"], key=lambda t: t["us"])
            print(f"{N:>6}x{K:<5} floor {row['floor_us']:6.2f} table {row['table_us']:6.2f} rows3 {best['us']:6.2f} "
                  f"(BN {best['BN']} R {best['R']} S {best['S']} split {best['split']} w {best['warps']})", flush=True)
    H.write(res, args.out, "gemv-rows3", args.tag)


if __name__ == "__main__":
    main()
