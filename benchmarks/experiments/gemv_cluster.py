"""Experiment, not part of the backend: M = 1 int4 GEMV with its K split merged through cluster shared memory.

Written in session 16 from ``benchmarks/gemv_notes.md`` "Next for the batch-1 step" (not run on a GPU yet): the
N = 4096 linears of the decode step (o 4096^2 at 33% of the floor, down 4096 x 14336 at 52%) lose 1.3-2.2 us
per call to their split-K merge (partials to global memory, a counter, the last program's loads) and their
one-launch ramp. Triton 3.6 cannot express a merge through distributed shared memory (gemv_notes, session 16),
so this kernel is CUDA C (``gemv_cluster.cu``), compiled by NVRTC and launched through the driver API
(``cuda.bindings``; with programmatic dependent launch like the Triton kernels): a cluster of ``CS`` CTAs owns
``BN`` columns, CTA r reads the r-th slice of K with every thread's next ``PF`` groups of words in registers,
and the cluster adds its ``CS`` partial columns in shared memory behind one cluster barrier. One wave: at
4096 x 4096 and 4096 x 14336, 16 clusters of 8 CTAs, one CTA per SM.

    python benchmarks/experiments/gemv_cluster.py --phase lower     # no GPU: NVRTC to sm_90a, registers, spills
    python benchmarks/experiments/gemv_cluster.py --phase emulate   # no GPU: the arithmetic in numpy vs float64
    python benchmarks/experiments/gemv_cluster.py --phase check     # GPU: against float64 (NaN-poisoned output)
    python benchmarks/experiments/gemv_cluster.py --phase bench     # GPU: against the table, tinygemm, the floor

The check runs every variant on random words, scales and zeros in portakern's internal layout against the
float64 product of the unpacked codes, each launch twice on an output poisoned with NaN; the bench times the
variants beside the table's kernel and tinygemm in CUDA graphs over weights rotated past 4x the L2.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from experiments.cuda_build import compile_cubin, registers  # noqa: E402

SOURCE = os.path.join(os.path.dirname(__file__), "gemv_cluster.cu")
#: (bits, N, K): the decode step's N = 4096 linears, its qkv projection (6144 x 4096, 41% of the floor on the
#: stream kernel), 8192^2 (58%), and int8 8192^2 (74%, the int8 target's missing shape), whose merges the same
#: structure may help
SHAPES = ((4, 4096, 4096), (4, 4096, 14336), (4, 6144, 4096), (4, 8192, 8192), (8, 8192, 8192))
#: per code width, (BN, CS, PF): columns per cluster, CTAs per cluster (K slices), groups in flight per thread
#: (an int8 group is twice the words of an int4 one)
VARIANTS = {4: ((256, 8, 4), (256, 8, 2), (128, 8, 4), (256, 4, 4)), 8: ((256, 8, 2), (128, 8, 2), (256, 8, 1))}


def defines(bits: int, N: int, K: int, NP: int, bn: int, cs: int, pf: int, pdl: bool) -> dict[str, int]:
    return {"BITS": bits, "N": N, "K": K, "NP": NP, "BN": bn, "CS": cs, "PF": pf, "PDL": int(pdl)}


def usable(N: int, K: int, bn: int, cs: int) -> str | None:
    """Why the kernel cannot take (N, K) with these tiles, or None."""
    if K % (128 * cs):
        return f"K={K} is not a multiple of 128 * CS = {128 * cs} (each CTA's slice holds whole groups)"
    if N % bn:
        return f"N={N} is not a multiple of BN={bn}"
    return None


class ClusterGemv:
    """``kern(x, w, out)`` for torch tensors: x (1, K) bf16, ``w`` a ``PreparedGemvWeight`` (int4 or int8 g128,
    asymmetric, fp16 scales), out (1, N) bf16, on the current CUDA stream."""

    def __init__(self, N: int, K: int, NP: int, bn: int = 256, cs: int = 8, pf: int = 4, pdl: bool = True,
                 bits: int = 4):
        why = usable(N, K, bn, cs)
        if why:
            raise ValueError(f"gemv_cluster({N}x{K}, BN={bn}, CS={cs}): {why}")
        self.N, self.K, self.bn, self.cs, self.pf, self.pdl, self.bits = N, K, bn, cs, pf, pdl, bits
        self.cubin, self.log = compile_cubin(SOURCE, defines(bits, N, K, NP, bn, cs, pf, pdl))
        from portakern.backends.cuda.nvrtc import Compiled, Function

        self.fn = Function(Compiled(self.cubin, self.log, "sm_90a"), "gemv_cluster", 0, 0, pdl)
        self.grid, self.threads = (N // bn) * cs, bn

    def __call__(self, x, w, out) -> None:
        self.fn(self.grid, self.threads, w.qweight.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(),
                x.data_ptr(), out.data_ptr())


@functools.lru_cache(maxsize=None)
def cluster_gemv(N: int, K: int, NP: int, bn: int, cs: int, pf: int, pdl: bool, bits: int) -> ClusterGemv:
    """One compiled and loaded ``ClusterGemv`` per configuration (the check and the bench share them)."""
    return ClusterGemv(N, K, NP, bn, cs, pf, pdl, bits)


def lower() -> int:
    """Compile every variant for sm_90a (no GPU) and print ptxas' report."""
    from portakern.backends.triton import quant_gemv as Q

    bad = 0
    for bits, N, K in SHAPES:
        NP = -(-N // Q.N_ALIGN_WORDS) * Q.N_ALIGN_WORDS
        for bn, cs, pf in VARIANTS[bits]:
            if usable(N, K, bn, cs):
                continue
            for pdl in (True, False):
                what = f"int{bits} {N}x{K} BN={bn} CS={cs} PF={pf} pdl={int(pdl)}"
                try:
                    _, log = compile_cubin(SOURCE, defines(bits, N, K, NP, bn, cs, pf, pdl))
                    print(f"{what}: {registers(log)}")
                except RuntimeError as e:
                    bad += 1
                    print(f"{what}: FAILED\n{e}")
    return 1 if bad else 0


def emulate(bits: int, N: int = 512, K: int = 2048, cs: int = 8) -> int:
    """No GPU: the kernel's arithmetic in numpy float32 -- words masked in place and read as subnormals, x
    pre-scaled per code position, per-group scales and zero points, the slices' sums -- against the float64
    product (checks the index map of the interleaved words and the scaling, not the CUDA mechanics)."""
    import numpy as np
    import torch

    from portakern.backends.triton import quant_gemv as Q

    rng = np.random.default_rng(0)
    epw, iw = 32 // bits, Q.interleave_words(bits, 128, False)
    gr = 128 // epw                                                 # word rows per group
    kwp, NP, G = -(-K // epw // Q.K_ALIGN_WORDS) * Q.K_ALIGN_WORDS, -(-N // Q.N_ALIGN_WORDS) * Q.N_ALIGN_WORDS, K // 128
    qw = rng.integers(-2**31, 2**31 - 1, (kwp, NP), dtype=np.int64).astype(np.int32)
    s = (rng.random((G, NP)) * 0.01 + 0.001).astype(np.float16)
    z = rng.integers(0, 1 << bits, (G, NP)).astype(np.float16)
    w = Q.PreparedGemvWeight(torch.from_numpy(qw), torch.from_numpy(s), torch.from_numpy(z), None, None, bits, 128,
                             1 << (bits - 1), N, K)
    assert w.interleave == iw
    x = torch.randn(1, K).to(torch.bfloat16)
    ref = _reference(x, w)[0]
    xf = x.float().numpy()[0]
    rows, u = K // epw // cs, qw.view(np.uint32)
    low = [bits * e + bits <= 23 for e in range(epw)]
    shift = [bits * e if low[e] else bits * e - 16 for e in range(epw)]
    out = np.zeros(N, np.float32)
    for rank in range(cs):
        ur = u[rank * rows:(rank + 1) * rows, :N]
        j = np.arange(rows)
        aq = np.zeros((rows // gr, N), np.float32)
        xg = np.zeros(rows // gr, np.float32)
        for e in range(epw):
            mask = np.uint32(((1 << bits) - 1) << shift[e])
            sub = ((ur if low[e] else ur >> 16) & mask).view(np.float32)       # subnormals
            k = rank * rows * epw + (j // iw) * iw * epw + e * iw + j % iw
            xe = (xf[k] * np.float32(2.0 ** (85 - shift[e]))).astype(np.float32)
            aq += (sub * xe[:, None]).reshape(rows // gr, gr, N).sum(1)
            xg += xf[k].reshape(rows // gr, gr).sum(1)
        g = rank * (rows // gr) + np.arange(rows // gr)
        out += (s[g, :N].astype(np.float32) * (aq * np.float32(2.0 ** 64) - z[g, :N].astype(np.float32) * xg[:, None])).sum(0)
    err = float(np.abs(out - ref).max() / np.abs(ref).max())
    print(f"emulation int{bits} {N}x{K}, {cs} slices: relative error {err:.3g} against float64")
    return 0 if err < 1e-5 else 1


def _reference(x, w):
    """float64 ``x @ dequant(W)^T`` of a prepared int4 weight (codes through ``unpack_internal``)."""
    import numpy as np

    from portakern.backends.triton import quant_gemv as Q

    codes = Q.unpack_internal(w.qweight.cpu().numpy(), w.bits, w.interleave, w.N, w.K).astype(np.float64)  # (N, K)
    g = np.arange(w.K) // w.group_size
    s = w.scales.double().cpu().numpy()[:, : w.N].T[:, g]     # (N, K)
    z = w.zeros.double().cpu().numpy()[:, : w.N].T[:, g]
    return x.double().cpu().numpy() @ ((codes - z) * s).T


def check(res) -> int:
    import torch

    from experiments.harness import poisoned_errors
    from gemv import random_prepared

    bad = 0
    for bits, N, K in SHAPES:
        w = random_prepared(N, K, bits, 128, False)
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        ref = _reference(x, w)
        for bn, cs, pf in VARIANTS[bits]:
            if usable(N, K, bn, cs):
                continue
            for pdl in (True, False):
                kern = cluster_gemv(N, K, w.stride_qk, bn, cs, pf, pdl, bits)
                out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
                errs = poisoned_errors(lambda: kern(x, w, out), out, ref)
                ok = max(errs) <= 1e-2
                bad += not ok
                row = {"bits": bits, "N": N, "K": K, "bn": bn, "cs": cs, "pf": pf, "pdl": pdl, "rel_err": errs, "ok": ok,
                       **registers(kern.log)}
                res["check"].append(row)
                print(row, flush=True)
    return bad


def bench(res) -> None:
    import torch

    from gemv import copies_for, floor_bytes, gemv_op, graph_us, int8_torch, ours, random_prepared, tinygemm

    for bits, N, K in SHAPES:
        op = gemv_op(1, N, K, bits=bits)
        fb = floor_bytes(op)
        copies = copies_for(fb)
        floor_us = fb / (res["copy_TBps"] * 1e12) * 1e6
        table_fns, _ = ours(op, None, copies)
        row = {"bits": bits, "N": N, "K": K, "floor_us": floor_us, "table_us": graph_us(table_fns)}
        del table_fns
        if bits == 4:
            row["tinygemm_us"] = graph_us(tinygemm(1, N, K, 128, copies_for(N * K // 2)))
        else:
            row["torch_int8_us"] = graph_us(int8_torch(1, N, K, copies_for(N * K)))
        ws = [random_prepared(N, K, bits, 128, False) for _ in range(copies)]
        xs = [torch.randn(1, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        for bn, cs, pf in VARIANTS[bits]:
            if usable(N, K, bn, cs):
                continue
            for pdl in (True, False):
                kern = cluster_gemv(N, K, ws[0].stride_qk, bn, cs, pf, pdl, bits)
                fns = [lambda x=x, w=w: kern(x, w, out) for x, w in zip(xs, ws)]
                t = graph_us(fns)
                row[f"cluster_bn{bn}_cs{cs}_pf{pf}_pdl{int(pdl)}_us"] = t
        res["bench"].append(row)
        print(row, flush=True)
        del ws, xs
        torch.cuda.empty_cache()


def main() -> int:
    from experiments.harness import header, parse_args, write

    args = parse_args(__doc__, lambda ap: ap.add_argument("--phase", choices=("lower", "emulate", "check", "bench"),
                                                          required=True))
    if args.phase == "lower":
        return lower()
    if args.phase == "emulate":
        return max(emulate(4), emulate(8))
    import torch

    from gemv import copy_bandwidth_TBps

    torch.cuda.init()
    torch.empty(1, device="cuda")      # the primary context current on this thread (the driver API uses it)
    res = header(__doc__, copy_bandwidth_TBps(), check=[], bench=[])
    bad = check(res)
    if args.phase == "bench" and not bad:
        bench(res)
    write(res, args.out, f"gemv-cluster-{args.phase}", args.tag)
    print(f"{len(res['check']) - bad}/{len(res['check'])} correct")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
