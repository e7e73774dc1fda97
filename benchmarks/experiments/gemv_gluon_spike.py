"""Spike, not part of the backend: the M=16 int4 GEMV in Gluon with explicit layouts (Triton >= 3.6).

Session 5's Triton kernel (``gemv_mma_kernel``) is bound by the shared-memory pipe because Triton
stages the word tile and x through shared memory. Here the word tile is loaded from global memory
straight into the layout whose 32-bit elements are the bf16 pairs of ``mma_v2``'s A fragment (the
tf32 A layout, ``DotOperandLayout(0, mma, k_width=1)``); ``_pair`` dequantizes in place (as
``gemv_mma._code_pair``) and ``join`` + ``reshape`` give the bf16 A operand with a conversion that
``convert_layout(..., assert_trivial=True)`` proves free. x is gathered into the B layout (2-byte
loads: under the 8-row interleave the two halves of a pair are 32 columns apart). Static count
(Triton 3.6, sm_90a, 64 columns, 4 warps): no shared-memory instruction in the loop, 4.3 instructions
per code (76 LDG of which most are the x gathers).

Not done: split-K, bounds, the x gather (one contiguous tile per group re-laid once, or a prepared
order with the halves adjacent in K), a measurement. Group 128, asymmetric, bf16, N a multiple of 64.

    python benchmarks/experiments/gemv_gluon_spike.py --sass     # static count, no GPU
    python benchmarks/experiments/gemv_gluon_spike.py --check    # on a GPU: against float64 numpy
"""

import argparse
import math
import sys

import numpy as np
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _pair(v, zc2):
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t, one; mov.b32 one, 0x3F803F80; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; "
        "fma.rn.bf16x2 t, t, one, $3; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r", [v, zc2], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def spike(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, K, KWP, stride_qk, stride_xm,
          BN: gl.constexpr, BM: gl.constexpr, BKW: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    pid_n = gl.program_id(0)
    n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l))
    kw = gl.arange(0, BKW, layout=gl.SliceLayout(0, w_l))
    w_ptrs = qw_ptr + kw[None, :] * stride_qk + n[:, None]
    # x_p (2 BKW, BM) in the B layout: column kk = 2 kw + h meets k = (kw // 8) * 64 + h * 32 + p * 8 + kw % 8
    kk = gl.arange(0, 2 * BKW, layout=gl.SliceLayout(1, b_l))
    m = gl.arange(0, BM, layout=gl.SliceLayout(0, b_l))
    kwk = kk // 2
    hk = kk % 2
    kbase = (kwk // 8) * 64 + hk * 32 + kwk % 8
    ns = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros((BN, BM), gl.float32, layout=mma)
    for kw0 in range(0, KWP, BKW):
        words = gl.load(w_ptrs + kw0 * stride_qk)
        g = kw0 * 8 // 128
        s = gl.load(s_ptr + g * stride_qk + ns).to(gl.float32)
        z = gl.load(z_ptr + g * stride_qk + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l)) + pid_n * BN).to(gl.float32)
        zb = (z + 128.0).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        zc2 = ((zb | (zb << 16)) ^ -2147450880)[:, None]
        accg = gl.zeros((BN, BM), gl.float32, layout=mma)
        for p in gl.static_range(4):
            lo, hi = _pair(words >> (4 * p), zc2)
            wp = gl.join(lo, hi).reshape((BN, 2 * BKW))
            wp = gl.convert_layout(wp, a_l, assert_trivial=True)
            xp = gl.load(x_ptr + m[None, :] * stride_xm + (kw0 * 8 + kbase + p * 8)[:, None])
            accg = mma_v2(wp, xp, accg)
        acc += s[:, None] * accg
    mo = gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + mo[None, :] * 1 + ns[:, None] * BM, acc.to(gl.bfloat16))


BN, BM, BKW = 64, 16, 16


def sass_count() -> None:
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16", "K": "i32",
           "KWP": "i32", "stride_qk": "i32", "stride_xm": "i32", "BN": "constexpr", "BM": "constexpr", "BKW": "constexpr"}
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "KWP", "stride_qk", "stride_xm")
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(sig) if a in aligned}
    src = GluonASTSource(spike, sig, {"BN": BN, "BM": BM, "BKW": BKW}, attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import gemv_sass_count as C

    sass, _ = C.disassemble(ck.asm["cubin"])
    loop = C.sass_loop(sass)
    codes = BKW * BN * 8 / 128
    print(f"registers {C.registers(ck.asm['cubin'])}, loop {loop['instructions']} instructions, "
          f"{loop['instructions'] / codes:.2f} per code")
    print(loop["by_opcode"])


def check(N=4096, K=4096, seed=0) -> None:
    """Random words in the internal layout, float64 reference of the dequantized product."""
    import torch

    rng = np.random.default_rng(seed)
    kwp, g = K // 8, K // 128
    words = rng.integers(0, 2**32, size=(kwp, N), dtype=np.uint64).astype(np.uint32)
    s = (rng.random((g, N)) * 0.02 + 0.001).astype(np.float32)
    z = rng.integers(0, 16, size=(g, N)).astype(np.float32)
    x = rng.standard_normal((BM, K)).astype(np.float32)
    # W[n, k]: code e of word row j is column k = (j // 8) * 64 + e * 8 + j % 8 (the 8-row interleave)
    codes = np.zeros((N, K))
    for e in range(8):
        j = np.arange(kwp)
        codes[:, (j // 8) * 64 + e * 8 + j % 8] = ((words >> (4 * e)) & 0xF).T
    xs = torch.from_numpy(x).to(torch.bfloat16)
    st, zt = torch.from_numpy(s).to(torch.bfloat16), torch.from_numpy(z).to(torch.bfloat16)
    kg = np.arange(K) // 128
    w = (codes - zt.float().numpy()[kg].T) * st.float().numpy()[kg].T
    ref = xs.double().numpy() @ w.T                                   # (BM, N)
    dev = "cuda"
    out = torch.empty((N, BM), dtype=torch.bfloat16, device=dev)
    spike[(N // BN,)](xs.to(dev), torch.from_numpy(words.view(np.int32)).to(dev), st.to(dev), zt.to(dev), out,
                      K, kwp, N, K, BN=BN, BM=BM, BKW=BKW, num_warps=4)
    err = float(np.abs(out.double().cpu().numpy().T - ref).max() / np.abs(ref).max())
    print(f"max |out - ref| / max |ref| = {err:.2e} (bf16 output: ~4e-3 expected)")


def time_it(shapes=((4096, 4096), (4096, 14336), (28672, 8192), (16384, 16384))) -> None:
    """Per-call time in a CUDA graph (triton.testing.do_bench_cudagraph), words rotated over > 4x L2."""
    import torch
    from triton.testing import do_bench_cudagraph

    for N, K in shapes:
        kwp, g = K // 8, K // 128
        nbytes = N * K // 2 + 4 * N * g
        copies = max(1, math.ceil(4 * 60e6 / nbytes))
        ws = [torch.randint(-2**31, 2**31 - 1, (kwp, N), dtype=torch.int32, device="cuda") for _ in range(copies)]
        s = torch.rand(g, N, device="cuda").to(torch.bfloat16)
        z = torch.randint(0, 16, (g, N), device="cuda").to(torch.bfloat16)
        x = torch.randn(BM, K, device="cuda").to(torch.bfloat16)
        out = torch.empty((N, BM), dtype=torch.bfloat16, device="cuda")

        def run():
            for w in ws:
                spike[(N // BN,)](x, w, s, z, out, K, kwp, N, K, BN=BN, BM=BM, BKW=BKW, num_warps=4)

        ms = do_bench_cudagraph(run) / copies
        print(f"{N}x{K}: {ms * 1e3:7.1f} us per call, {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sass", action="store_true", help="static count of the loop for sm_90a (no GPU)")
    ap.add_argument("--check", action="store_true", help="run on the GPU against float64 numpy")
    ap.add_argument("--time", action="store_true", help="time it on the GPU at four shapes (CUDA graph)")
    args = ap.parse_args()
    if args.sass or not (args.check or args.time):
        sass_count()
    if args.check:
        check()
    if args.time:
        time_it()
