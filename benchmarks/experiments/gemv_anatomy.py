"""Where does the M=1 int4 GEMV lose against a plain read of its bytes? One run, one process, CUDA graph.

For each shape, with the table's configuration of the CUDA-core kernel (group-resident tiles, split K):

* ``gemv``          the table GEMV, buffers rotated past 4x the L2 (what ``benchmarks/gemv.py`` times)
* ``gemv_hot``      the same on one buffer set (weights of <= ~40 MB stay in the 60 MB L2): the cost of
                    the kernel's own chain (loads from L2, compute, split-K) without DRAM
* ``tiles_finish``  a kernel with the GEMV's grid, tiles, register prefetch, scales and zeros and its
                    split-K epilogue (``_finish``), the arithmetic replaced by an XOR of the words
* ``tiles``         the same without the split-K epilogue (one value per program)
* ``tiled_*``       the same two on a layout where each program's K slice is one contiguous stretch
                    (words ``(tiles_n, KWP, BN)``), as the read kernel streams it
* ``read``          the read-floor kernel (``read_floor.py``) over the same bytes, best of 8 shapes

Differences name the parts: gemv - tiles_finish = arithmetic; tiles_finish - tiles = split-K
epilogue; tiles - tiled = access pattern; tiled - read = grid and tile shape.

The session-8 run (``results/gemv-anatomy-h200.json``, commit f6e917a) also timed the real
GEMV on such a column-tiled copy (``tiled_gemv``: 8-32 columns per program, 128-256 word rows per
tile, split 1 / 2; the kernel option ``GemvConfig.tiled`` of 0b4ab96, reverted after the run: it
lost on 6 of 7 shapes, see ``benchmarks/gemv_notes.md`` v10).

    python benchmarks/experiments/gemv_anatomy.py [--out DIR] [--tag T]
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import gemv as GB  # noqa: E402  (benchmarks/gemv.py)
import harness as H  # noqa: E402
import read_floor as RF  # noqa: E402
from portakern.backends.triton import quant_gemv as Q  # noqa: E402
from portakern.backends.triton.kernels import load as load_kernels  # noqa: E402

GQ = load_kernels("gemv_quant")
_finish = GQ._finish
_wait_for_producer = GQ._wait_for_producer

SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (14336, 4096), (28672, 4096), (8192, 8192), (28672, 8192)]


@triton.jit
def tile_read_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, lock_ptr, N, K, KWP, stride_qk, K_SPLIT_W,
                     BN: tl.constexpr, BKW: tl.constexpr, SPLIT_K: tl.constexpr, GS: tl.constexpr,
                     TILED: tl.constexpr, FINISH: tl.constexpr, PDL: tl.constexpr):
    # -- the GEMV's program: BN columns, one K slice, (BKW, BN) word tiles one ahead in registers
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    kwr = tl.arange(0, BKW)
    if TILED:   # this program's column tile is one stretch (KWP, BN)
        w_ptrs = qw_ptr + pid_n.to(tl.int64) * KWP * BN + kwr[:, None] * BN + tl.arange(0, BN)[None, :]
        wstride = BN
    else:
        w_ptrs = qw_ptr + kwr[:, None] * stride_qk + n[None, :]
        wstride = stride_qk
    kw_begin = pid_k * K_SPLIT_W
    kw_end = tl.minimum(kw_begin + K_SPLIT_W, KWP)
    kw_first = tl.minimum(kw_begin, KWP - BKW)   # slices past the padded rows re-read the last tile
    words = tl.load(w_ptrs + kw_first * wstride)
    g = kw_first * 8 // GS
    s = tl.load(s_ptr + g * stride_qk + n).to(tl.float32)
    z = tl.load(z_ptr + g * stride_qk + n).to(tl.float32)
    _wait_for_producer(PDL)
    acc_w = tl.zeros((BN,), tl.int32)
    acc_f = tl.zeros((BN,), tl.float32)
    for kw0 in range(kw_begin, kw_end, BKW):
        # -- next tile in flight while this one is folded in
        kw_next = tl.where(kw0 + BKW < kw_end, kw0 + BKW, kw0)
        g = kw_next * 8 // GS
        words_next = tl.load(w_ptrs + kw_next * wstride)
        s_next = tl.load(s_ptr + g * stride_qk + n).to(tl.float32)
        z_next = tl.load(z_ptr + g * stride_qk + n).to(tl.float32)
        acc_w ^= tl.xor_sum(words, axis=0)
        acc_f += s * z
        words, s, z = words_next, s_next, z_next
    res = (acc_w.to(tl.float32) + acc_f)[None, :]
    # -- the GEMV's split-K epilogue, or one value per program
    if FINISH:
        rows = tl.arange(0, 1)
        _finish(res, rows, n, 1, N, pid_n, pid_k, 0, out_ptr, N, ws_ptr, lock_ptr, 1, BN, SPLIT_K)
    else:
        tl.store(out_ptr + pid_k * N + pid_n + tl.arange(0, 1), tl.sum(res, axis=1))


def tile_read_fns(w_sets, cfg, N, K, tiled, finish):
    KWP, sqk = w_sets[0].KWP, w_sets[0].stride_qk
    tiles_n = -(-N // cfg.block_n)
    ksw = Q._slice_words(KWP, cfg)
    out = torch.empty((cfg.split_k, N), dtype=torch.float32, device="cuda")
    ws = torch.empty((cfg.split_k, 1, N), dtype=torch.float32, device="cuda")
    lock = torch.zeros((tiles_n,), dtype=torch.int32, device="cuda")
    opts = dict(num_warps=cfg.num_warps, num_stages=1, launch_pdl=cfg.pdl)
    return [(lambda w=w: tile_read_kernel[(tiles_n, cfg.split_k)](
        w.qweight, w.scales, w.zeros, out, ws, lock, N, K, KWP, sqk, ksw, BN=cfg.block_n, BKW=cfg.block_kw,
        SPLIT_K=cfg.split_k, GS=128, TILED=tiled, FINISH=finish, PDL=cfg.pdl, **opts)) for w in w_sets]


def best_read_us(nbytes, sms, copies):
    """The read floor's fastest plain read of ``nbytes`` among the shapes that won in session 7 (8 warps,
    4-8 programs per SM, up to 2048 words per iteration, pdl)."""
    bufs = [torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    return RF.fastest_read(bufs, sink, nbytes, sms, pdls=(True,),
                           keep=lambda v: v["warps"] == 8 and v["per_sm"] >= 4 and v["block"] <= 2048)[0]


def main():
    args = H.parse_args(__doc__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = GB.copy_bandwidth_TBps()
    res = H.header(__doc__, bw, rows=[])
    print(f"copy {bw:.3f} TB/s", flush=True)
    cols = ["gemv", "gemv_hot", "tiles_finish", "tiles", "tiled_finish", "tiled", "read"]
    print(f"{'shape':>12} {'floor':>6} " + " ".join(f"{c:>12}" for c in cols), flush=True)
    for N, K in SHAPES:
        op = GB.gemv_op(1, N, K)
        nbytes = RF.weight_bytes(N, K)
        copies = GB.copies_for(GB.floor_bytes(op))
        row = {"N": N, "K": K, "bytes": nbytes, "floor_us": nbytes / (bw * 1e12) * 1e6}
        fns, kern = GB.ours(op, None, copies)
        row["gemv"] = GB.graph_us(fns)
        cfg = next(iter(kern.launchers.values())).cfg
        row["cfg"] = cfg.to_json()
        row["gemv_hot"] = GB.graph_us(fns[:1])
        w_sets = [GB.random_prepared(N, K, 4, 128, False) for _ in range(copies)]
        del fns
        for tiled in (False, True):
            for finish in (True, False):
                name = ("tiled" if tiled else "tiles") + ("_finish" if finish else "")
                row[name] = GB.graph_us(tile_read_fns(w_sets, cfg, N, K, tiled, finish))
        del w_sets
        torch.cuda.empty_cache()
        row["read"] = best_read_us(nbytes, sms, copies)
        torch.cuda.empty_cache()
        res["rows"].append(row)
        print(f"{N:>6}x{K:<5} {row['floor_us']:6.2f} " + " ".join(f"{row[c]:12.2f}" for c in cols)
              + f"  split {cfg.split_k} bn {cfg.block_n} bkw {cfg.block_kw} w {cfg.num_warps}", flush=True)
    H.write(res, args.out, "gemv-anatomy", args.tag)


if __name__ == "__main__":
    main()
