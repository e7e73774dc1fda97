"""Spike, not part of the backend: does TMA streaming bring the M=1 int4 GEMV closer to the DRAM floor?

Hypothesis: on an H200 the batch-1 int4 GEMV is limited by how many bytes each SM keeps in flight.
The backend's kernel prefetches the next tile of words into registers; Hopper's TMA engine, fed by
Triton's software pipeliner (``tl.range(..., num_stages=S)``), keeps ``S - 1`` tiles in flight in
shared memory at no register cost and with no per-thread addresses. One kernel body, two loads of
the same ``(16, BN)`` word tile (one group of 128 columns of K), swept over (BN, stages, split-K):

* ``tma``: a host-side ``TensorDescriptor``, ``desc.load`` (sm_90: UTMALDG + mbarrier waits),
* ``ptr``: pointer loads of the same tile (sm_90: the pipeliner's cp.async, LDGSTS).

Layout (as ``backends/triton/kernels/gemv_quant.py``, int4, group 128, interleave 8): ``qw`` int32
``(K/8, N)``; code ``e`` of word row ``j`` is ``W[n, (j // 8) * 64 + e * 8 + j % 8]``; ``s``, ``z``
``(K/128, N)`` bf16; ``W = (code - z) * s``; ``out (N,) = x @ W^T`` in fp32. N a multiple of BN.

Dequantization (``--dq``): 1 = ``((w >> 4e) & 15) | 2^23`` as fp32 minus 2^23, ~6 instructions per
code in the loop (sm_90a, Triton 3.6): over the ~4.1 an H200 can issue per code at the copy
bandwidth, so it would measure issue, not memory; 3 (default) = the backend's subnormal codes (one
LOP3 + one FFMA per code), 3.5-3.8 per code. The scale multiplies per word row (the tile's rows lie
in two or four warps; their sum waits for the end), the zero point once per group and column.
Triton 3.6 pipelines a load only at >= 4 bytes per thread: at BN=128 the (BN,) scale and zero loads
(2 bytes per thread) stay synchronous in both variants, at BN=256 they go through cp.async; the
x loads (L2 hits) stay synchronous. TMA: Triton 3.6 cuts the tile into 16 x 32-word boxes (128-byte
swizzle), each warp's elected lane issues its share (BN=128: one box per warp), and every iteration
has a fence.proxy.async + bar.sync before the next copy into a freed buffer.

H200, session 6 (16f4090, ``benchmarks/results/gemv-tma-spike-h200.json``, dq 3): TMA 5-10%
faster than the pointer loads on the large shapes (28672x8192 43.4 vs 48.2 us, 16384^2 47.7 vs
50.3), a tie or a loss on the small ones; both slower than the backend's table kernel (38.8 / 43.4
us). Not adopted (``benchmarks/gemv_notes.md`` v8).

    python benchmarks/experiments/gemv_tma_spike.py --check           # GPU: both variants vs float64 numpy
    python benchmarks/experiments/gemv_tma_spike.py --time [--dq 1]   # GPU: sweep, $OUT/gemv-tma-spike[-dq1].json
    python benchmarks/experiments/gemv_tma_spike.py --sass            # no GPU: sm_90a loop counts (Triton 3.6)
    TRITON_INTERPRET=1 python benchmarks/experiments/gemv_tma_spike.py --interpret-check   # CPU
"""

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import triton
import triton.language as tl

BKW = 16          # word rows per tile: one group of 128 columns of K
GROUP = 128


@triton.jit
def _code(w, E: tl.constexpr, DQ: tl.constexpr):
    """Code position ``E`` of every word as an exact fp32. DQ=1: ``((w >> 4E) & 15) | 2^23`` read as
    fp32, minus 2^23 (the code). DQ=3: only the AND (after one shared ``w >> 16`` for E >= 5); read as
    fp32 the masked bits are the subnormal ``code * 2^(4E - SH - 149)``, undone in x (``_xscale``)."""
    if DQ == 1:
        return (((w >> (4 * E)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        SH: tl.constexpr = 0 if E < 5 else 16
        return ((w >> SH) & (0xF << (4 * E - SH))).to(tl.float32, bitcast=True)


@triton.jit
def _xscale(E: tl.constexpr, DQ: tl.constexpr):
    """The power of two x carries for position ``E``: DQ=3 2^(149 - (4E - SH) - 64), so every product
    is ``x q 2^-64`` (normal for |x q| >= 2^-62); the sums are scaled back once at the end."""
    if DQ == 1:
        return 1.0
    else:
        SH: tl.constexpr = 0 if E < 5 else 16
        return 2.0 ** (149 - (4 * E - SH) - 64)


@triton.jit
def gemv_tile_kernel(x_ptr, qw, s_ptr, z_ptr, out_ptr, N, n_groups, BN: tl.constexpr, STAGES: tl.constexpr,
                     TMA: tl.constexpr, ATOMIC: tl.constexpr, DQ: tl.constexpr):
    """Columns ``pid_n * BN ..`` over a contiguous share of the groups (``tl.num_programs(1)`` shares;
    the last ones may be shorter or empty). ``qw`` is a tensor descriptor (TMA) or a pointer."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BN
    cols = n0 + tl.arange(0, BN)
    r = tl.arange(0, 16)
    xk = (r // 8) * 64 + r % 8                  # + 8 e: the column of K of code e in word row r
    per = tl.cdiv(n_groups, tl.num_programs(1))
    t_lo = pid_k * per
    t_hi = tl.minimum(t_lo + per, n_groups)
    UNIT: tl.constexpr = 1.0 if DQ == 1 else 2.0 ** -64   # the scale of the products x q
    acc = tl.zeros((16, BN), tl.float32)    # s sum_e x q per word row and column, summed over rows at the end
    zacc = tl.zeros((BN,), tl.float32)      # s z sum x per column
    for t in tl.range(t_lo, t_hi, num_stages=STAGES):
        # -- load: the group's 16 word rows, its scales and zeros, the sum of its 128 values of x
        if TMA:
            w = qw.load([t * 16, n0])
        else:
            w = tl.load(qw + (t * 16 + r)[:, None] * N + cols[None, :])
        s = tl.load(s_ptr + t * N + cols).to(tl.float32)
        z = tl.load(z_ptr + t * N + cols).to(tl.float32)
        xsum = tl.sum(tl.load(x_ptr + t * 128 + tl.arange(0, 128)).to(tl.float32), axis=0)
        dot = tl.zeros((16, BN), tl.float32)
        for e in tl.static_range(8):
            # -- dequantize code position e
            q = _code(w, e, DQ)
            # -- multiply by the 16 values of x that meet it (word row r: x[128 t + 64 (r // 8) + 8 e + r % 8])
            xe = tl.load(x_ptr + t * 128 + e * 8 + xk).to(tl.float32) * _xscale(e, DQ)
            dot += xe[:, None] * q
        # -- scale and zero point: s (sum x q - z sum x); the rows of the tile may lie in different warps,
        #    so the sum over them waits for the end (one FFMA per word) and the zero point is per column
        acc += s[None, :] * dot
        zacc += s * z * xsum
    # -- write: split-K partials add into the fp32 output
    acc = tl.sum(acc, axis=0) * (1.0 / UNIT) - zacc
    if ATOMIC:
        tl.atomic_add(out_ptr + cols, acc, sem="relaxed")
    else:
        tl.store(out_ptr + cols, acc)


def launch(x, qw, s, z, out, N, K, BN, stages, split, tma, dq=3, desc=None):
    """One launch; ``desc`` (TMA) is a prebuilt descriptor of ``qw``, built here when absent."""
    if tma and desc is None:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor(qw, [K // 8, N], [N, 1], [BKW, BN])
    gemv_tile_kernel[(N // BN, split)](x, desc if tma else qw, s, z, out, N, K // GROUP,
                                       BN=BN, STAGES=stages, TMA=tma, ATOMIC=split > 1, DQ=dq, num_warps=4)


def make_problem(N, K, seed=0):
    """Random words, bf16-rounded scales / integer zeros / x (as float32 arrays), float64 reference."""
    import torch

    rng = np.random.default_rng(seed)
    kwp, g = K // 8, K // GROUP
    words = rng.integers(0, 2**32, size=(kwp, N), dtype=np.uint64).astype(np.uint32)
    bf = lambda a: torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).float().numpy()
    s = bf(rng.random((g, N)) * 0.02 + 0.001)
    z = bf(rng.integers(0, 16, size=(g, N)))
    x = bf(rng.standard_normal(K))
    codes = np.zeros((N, K))
    j = np.arange(kwp)
    for e in range(8):
        codes[:, (j // 8) * 64 + e * 8 + j % 8] = ((words >> (4 * e)) & 0xF).T
    kg = np.arange(K) // GROUP
    w = (codes - z.astype(np.float64)[kg].T) * s.astype(np.float64)[kg].T
    return words.view(np.int32), s, z, x, x.astype(np.float64) @ w.T


def check(shapes, configs, device="cuda", dtype="bfloat16", variants=(False, True), dqs=(1, 3)) -> float:
    import torch

    dt = getattr(torch, dtype)
    worst = 0.0
    for N, K in shapes:
        words, s, z, x, ref = make_problem(N, K)
        t = lambda a, d=dt: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=d)
        qw, st, zt, xt = t(words, torch.int32), t(s), t(z), t(x)
        for tma, dq in [(v, d) for v in variants for d in dqs]:
            for BN, stages, split in configs:
                out = torch.zeros(N, dtype=torch.float32, device=device)
                launch(xt, qw, st, zt, out, N, K, BN, stages, split, tma, dq)
                err = float(np.abs(out.double().cpu().numpy() - ref).max() / np.abs(ref).max())
                worst = max(worst, err)
                print(f"{N}x{K} {'tma' if tma else 'ptr'} dq={dq} BN={BN} stages={stages} split={split}: "
                      f"max |out - ref| / max |ref| = {err:.2e}", flush=True)
    return worst


def interpret_check() -> None:
    """CPU (TRITON_INTERPRET=1): fp32 copies of the bf16 values (the interpreter's bf16 is not exact)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--interpret-check needs TRITON_INTERPRET=1 in the environment")
    cfgs = [(128, 3, 1), (128, 2, 3), (256, 4, 2)]
    worst = check([(256, 512)], cfgs, device="cpu", dtype="float32", variants=(False,))
    try:
        worst = max(worst, check([(256, 512)], cfgs, device="cpu", dtype="float32", variants=(True,)))
    except Exception as exc:   # an interpreter without host tensor descriptors
        print(f"tma variant not checked under the interpreter: {type(exc).__name__}: {exc}")
    print(f"worst {worst:.2e}: {'PASS' if worst < 1e-5 else 'FAIL'} (fp32 inputs: ~1e-7 expected)")
    if worst >= 1e-5:
        sys.exit(1)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), best of 10, cuda events."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = math.inf
    for i in range(13):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:
            best = min(best, e0.elapsed_time(e1) * 1e-3)
    del a, b
    return 2 * (1 << 30) / best


SHAPES = ((4096, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336), (8192, 8192),
          (28672, 8192), (16384, 16384))


def configs_for(N, K):
    """(BN, stages, split) with 132 <= programs <= ~1100 and at least 2 groups per program."""
    g = K // GROUP
    return [(bn, st, sp) for bn in (128, 256) for sp in (1, 2, 4, 8, 16) for st in (3, 4, 6)
            if N % bn == 0 and 132 <= (N // bn) * sp <= 1100 and g // sp >= 2]


def time_it(dq=3) -> None:
    """Per-call time inside a CUDA graph, words/scales/zeros rotated over > 4x the 60 MB L2."""
    import torch
    from triton.testing import do_bench_cudagraph
    from triton.tools.tensor_descriptor import TensorDescriptor

    t0 = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()}, triton {triton.__version__})")
    rows = []
    for N, K in SHAPES:
        kwp, g = K // 8, K // GROUP
        nbytes = N * K // 2 + 4 * N * K // GROUP
        copies = max(1, math.ceil(4 * 60e6 / nbytes))
        ws = [torch.randint(-2**31, 2**31 - 1, (kwp, N), dtype=torch.int32, device="cuda") for _ in range(copies)]
        ss = [(torch.rand(g, N, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        zs = [torch.randint(0, 16, (g, N), device="cuda").to(torch.bfloat16) for _ in range(copies)]
        x = torch.randn(K, device="cuda").to(torch.bfloat16)
        out = torch.zeros(N, dtype=torch.float32, device="cuda")   # split-K: accumulates over launches
        best = {}
        for tma in (False, True):
            for BN, stages, split in configs_for(N, K):
                descs = [TensorDescriptor(w, [kwp, N], [N, 1], [BKW, BN]) if tma else None for w in ws]

                def run(ws=ws, ss=ss, zs=zs, descs=descs, BN=BN, stages=stages, split=split, tma=tma):
                    for i in range(copies):
                        launch(x, ws[i], ss[i], zs[i], out, N, K, BN, stages, split, tma, dq, descs[i])

                us = do_bench_cudagraph(run, rep=20, return_mode="median") / copies * 1e3
                row = {"N": N, "K": K, "variant": "tma" if tma else "ptr", "BN": BN, "stages": stages,
                       "split": split, "programs": N // BN * split, "us": round(us, 2), "bytes": nbytes,
                       "TBps": round(nbytes / us / 1e6, 3), "floor_fraction": round(nbytes / (us * 1e-6) / bw, 3),
                       "dq": dq, "copies": copies}
                rows.append(row)
                if row["variant"] not in best or us < best[row["variant"]]["us"]:
                    best[row["variant"]] = row
        for v, b in best.items():
            print(f"{N:6d}x{K:<6d} {v}: {b['us']:7.2f} us  {b['TBps']:.2f} TB/s  {b['floor_fraction']:.3f} of floor  "
                  f"(BN={b['BN']} stages={b['stages']} split={b['split']} programs={b['programs']})", flush=True)
        print(f"{'':14s} tma / ptr time {best['tma']['us'] / best['ptr']['us']:.3f}  [{time.time() - t0:.0f} s]")
        del ws, ss, zs
        torch.cuda.empty_cache()
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {"what": "M=1 int4 g128 GEMV, TMA descriptor loads vs pointer loads, both through Triton's software "
                   "pipeliner (benchmarks/experiments/gemv_tma_spike.py); per-call us in a CUDA graph, weights "
                   "rotated over > 4x L2; floor_fraction = bytes / us / copy bandwidth",
           "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "triton": triton.__version__, "torch": torch.__version__, "copy_bandwidth_Bps": bw,
           "dq": dq, "num_warps": 4, "wall_s": round(time.time() - t0, 1), "rows": rows}
    path = out_dir / ("gemv-tma-spike.json" if dq == 3 else f"gemv-tma-spike-dq{dq}.json")
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path} ({len(rows)} rows, {time.time() - t0:.0f} s)")


def sass_count(bns=(128, 256), dqs=(1, 3), stages=4, atomic=True) -> None:
    """Compile both variants for sm_90a (no GPU) and count the instructions of the main loop."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gemv_sass_count as C

    for tma, BN, dq in [(tma, bn, dq) for dq in dqs for bn in bns for tma in (False, True)]:
        sig = {"x_ptr": "*bf16", "qw": f"tensordesc<i32[{BKW},{BN}]>" if tma else "*i32", "s_ptr": "*bf16",
               "z_ptr": "*bf16", "out_ptr": "*fp32", "N": "i32", "n_groups": "i32", "BN": "constexpr",
               "STAGES": "constexpr", "TMA": "constexpr", "ATOMIC": "constexpr", "DQ": "constexpr"}
        aligned = {"x_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "n_groups"} | (set() if tma else {"qw"})
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(sig) if a in aligned}
        src = ASTSource(gemv_tile_kernel, sig, {"BN": BN, "STAGES": stages, "TMA": tma, "ATOMIC": atomic, "DQ": dq}, attrs)
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        sass, _ = C.disassemble(ck.asm["cubin"])
        # the mbarrier try-wait retry blocks sit after the last EXIT and branch back into the loop:
        # cut them off, or the largest backward branch spans the epilogue too
        loop = C.sass_loop(sass[:sass.rindex("EXIT")])
        ops = loop["by_opcode"]
        words = BKW * BN // 128   # words per thread per tile
        mem = {o: ops[o] for o in ("UTMALDG", "SYNCS", "LDGSTS", "LDGDEPBAR", "DEPBAR", "LDG", "LDS", "STS", "BAR")
               if o in ops}
        print(f"{'tma' if tma else 'ptr'} BN={BN} stages={stages} dq={dq}: registers {C.registers(ck.asm['cubin'])}, "
              f"shared {ck.metadata.shared} B, loop {loop['instructions']} instructions "
              f"({loop['instructions'] / (8 * words):.2f} per code), memory/sync {mem}")
        print(f"    {ops}")
        want = ("UTMALDG", "SYNCS") if tma else ("LDGSTS",)
        print(f"    {'/'.join(want)} in the loop: {'yes' if all(o in ops for o in want) else 'NO'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="GPU: both variants against float64 numpy")
    ap.add_argument("--time", action="store_true", help="GPU: the sweep in CUDA graphs, JSON to $OUT")
    ap.add_argument("--sass", action="store_true", help="no GPU: sm_90a instruction counts of the loop")
    ap.add_argument("--interpret-check", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny shapes")
    ap.add_argument("--dq", type=int, default=3, choices=(1, 3), help="--time: dequantization (see above)")
    args = ap.parse_args()
    if args.interpret_check:
        interpret_check()
    if args.sass:
        sass_count()
    if args.check:
        worst = check([(4096, 4096), (4096, 14336)], [(128, 3, 1), (256, 4, 8), (128, 6, 3), (256, 3, 16)])
        print(f"worst {worst:.2e}: {'PASS' if worst < 1e-3 else 'FAIL'} (bf16 inputs, fp32 output)")
    if args.time:
        time_it(args.dq)
    if not (args.interpret_check or args.sass or args.check or args.time):
        ap.print_help()
