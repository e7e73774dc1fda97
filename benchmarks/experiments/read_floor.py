"""What does merely reading N bytes cost, per call, inside a CUDA graph? The floor a GEMV of that size
can reach with one kernel launch per call, against the bytes / copy-bandwidth floor of the issue.

For each size (the decode step's GEMV weights: codes + fp16 scales and zeros), a read-only Triton
kernel streams a buffer of that many bytes with 16-byte loads and writes one word per program (so
the loads are live), in several shapes (programs per SM, warps, bytes per iteration, with and
without programmatic dependent launch); buffers rotate over more than 4x the L2, as in
``benchmarks/gemv.py``. Alongside: an empty kernel (launch-to-launch time in a graph) and the table's
int4 GEMV (M=1) on the same shapes, in the same run.

    python benchmarks/experiments/read_floor.py [--out DIR] [--tag T]
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import gemv as GB  # noqa: E402  (benchmarks/gemv.py)
sys.path.insert(0, os.path.dirname(__file__))
import harness as H  # noqa: E402

STEP_SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (14336, 4096), (28672, 4096), (128256, 4096)]


@triton.jit
def stream_read(src, out, n_words, chunk, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # -- this program's chunk of ``chunk`` words, BLOCK words (4 per lane: 16 bytes) per iteration
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, chunk, BLOCK):
        idx = base + i + offs
        acc ^= tl.load(src + idx, mask=idx < n_words, other=0)
    # -- one word per program keeps the loads live
    tl.store(out + pid, tl.xor_sum(acc, 0))


@triton.jit
def empty_kernel(out, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if tl.program_id(0) == 1 << 30:
        tl.store(out, 0)


def weight_bytes(N, K):
    return N * K // 2 + N * (K // 128) * 4


def read_variants(nbytes, sms):
    words = nbytes // 4
    for per_sm in (1, 2, 4, 8):
        for warps in (4, 8):
            for unroll in (1, 2, 4):
                block = warps * 32 * 4 * unroll
                progs = sms * per_sm
                chunk = -(-words // progs)
                chunk = -(-chunk // block) * block
                yield dict(per_sm=per_sm, warps=warps, block=block, chunk=chunk, programs=-(-words // chunk))


def fastest_read(bufs, sink, nbytes, sms, pdls=(False, True), keep=lambda v: True):
    """(us, shape) of the fastest ``stream_read`` over ``bufs`` (rotated, in a graph) among the
    ``read_variants`` that ``keep`` accepts, each with and without pdl as ``pdls`` says."""
    best = None
    for v in filter(keep, read_variants(nbytes, sms)):
        for pdl in pdls:
            fns = [(lambda b=b, v=v, pdl=pdl: stream_read[(v["programs"],)](
                b, sink, b.numel(), v["chunk"], BLOCK=v["block"], PDL=pdl, num_warps=v["warps"],
                launch_pdl=pdl)) for b in bufs]
            us = GB.graph_us(fns)
            if best is None or us < best[0]:
                best = (us, dict(v, pdl=pdl))
    return best


def main():
    args = H.parse_args(__doc__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = GB.copy_bandwidth_TBps()
    res = H.header(__doc__, bw, rows=[])
    sink = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    empty = {}
    for pdl in (False, True):
        fns = [lambda pdl=pdl: empty_kernel[(sms,)](sink, PDL=pdl, launch_pdl=pdl)]
        empty[pdl] = GB.graph_us(fns)
    res["empty_kernel_us"] = {"plain": empty[False], "pdl": empty[True]}
    print(f"copy {bw:.3f} TB/s; empty kernel in a graph {empty[False]:.2f} us, with pdl {empty[True]:.2f} us", flush=True)
    for N, K in STEP_SHAPES:
        nbytes = weight_bytes(N, K)
        copies = GB.copies_for(nbytes)
        bufs = [torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        best = fastest_read(bufs, sink, nbytes, sms)
        del bufs
        op = GB.gemv_op(1, N, K)
        gfns, _ = GB.ours(op, None, GB.copies_for(GB.floor_bytes(op)))
        gemv = GB.graph_us(gfns)
        del gfns
        torch.cuda.empty_cache()
        floor = nbytes / (bw * 1e12) * 1e6
        row = {"N": N, "K": K, "bytes": nbytes, "floor_us": floor, "read_us": best[0], "read_cfg": best[1],
               "gemv_us": gemv, "read_frac_floor": floor / best[0], "gemv_frac_floor": floor / gemv,
               "gemv_over_read": gemv / best[0]}
        res["rows"].append(row)
        print(f"{N:>6}x{K:<5} {nbytes / 1e6:7.1f} MB floor {floor:6.2f} read {best[0]:6.2f} ({floor / best[0]:.0%}) "
              f"gemv {gemv:6.2f} ({floor / gemv:.0%}) gemv/read {gemv / best[0]:.2f} {best[1]}", flush=True)
    H.write(res, args.out, "read-floor", args.tag)


if __name__ == "__main__":
    main()
