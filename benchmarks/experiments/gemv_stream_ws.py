"""Experiment, not part of the backend: the stream-K M=1 int4 GEMV with its words arriving through a TMA ring.

Written in session 14 from ``benchmarks/gemv_notes.md`` "Next for M = 1"; measured in session 15 (gemv_notes v14):
correct, and slower than the stream kernel at every shape and configuration (69% of the floor at best on
28672 x 8192 against its 79%), so it stays an experiment. The
backend's stream kernel (``backends/triton/kernels/gemv_stream.py``) keeps one unit of words ahead in
registers: ~32 KiB in flight per SM against the ~48 KiB that the copy rate needs at H200 latencies. Here
a one-warp partition fills a ring of ``STAGES`` shared-memory stages with each unit's words by TMA (no
registers held, so the ring can be deep), and the consumer partition (``NW`` warps) runs the stream kernel's
own unit loop (its helpers, imported from the kernel module) on words loaded from shared memory, releasing a
stage per unit (Gluon's arrive: a barrier of the consumer partition, then one arrive). Scales and zeros stay
one unit ahead in registers (2 values per thread). Grid, ranges, x staging, segments and the merge are the
stream kernel's.

    python benchmarks/experiments/gemv_stream_ws.py --phase check       # GPU: against float64
    python benchmarks/experiments/gemv_stream_ws.py --phase bench       # GPU: against the table and "stream"
    python benchmarks/experiments/gemv_stream_ws.py --phase lower       # no GPU: sm_90a lowering, shared memory

The check reuses ``gemv_stream_probe.py``'s cases (packings, odd N, grids of 1 / 7 / 132 / 1000 programs,
each launched twice on a NaN-poisoned output); the bench times its shapes for the table's CUDA-core kernel,
the stream kernel (table config) and this kernel's stages, programs per SM and consumer warps (``warp_rows``
4 or 8: 8 or 16 warps), in CUDA graphs over rotated inputs.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: E402

from portakern.backends.triton import kernels  # noqa: E402

_S = kernels.load("gemv_stream")            # the stream kernel's helpers (jit flavour)
cta_barrier = kernels.load("gluon_compat").cta_barrier
tma_load = kernels.load("gluon_compat").tma_load
EPW = gl.constexpr(8)

@gluon.jit
def _words_partition(w_desc, w_smem, ready, empty, u0, n, G: gl.constexpr, WR: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr):
    """Producer: the words of units ``u0 .. u0 + n - 1``, one TMA box ``(WR, RPT, BN)`` each, into the ring."""
    for i in range(n):
        u = u0 + i
        t = u // G
        g = u - t * G
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        tma_load(w_desc, (g * WR, 0, t * BN), ready.index(s), w_smem.index(s))


@gluon.jit
def _scales(s_ptr, z_ptr, u, ok, stride_qk, G: gl.constexpr, TR: gl.constexpr, BN: gl.constexpr, WR: gl.constexpr,
            RPT: gl.constexpr, HAS_Z: gl.constexpr, L3: gl.constexpr):
    """Unit ``u``'s scales and zeros ``(WR, BN)`` (nothing read where ``ok`` is false)."""
    _wo, _wm, so, sm = _S._unit_offsets(u, stride_qk, G, TR, BN, WR, RPT, L3)
    s = gl.load(s_ptr + so, mask=sm & ok, other=0.0)
    if HAS_Z:
        z = gl.load(z_ptr + so, mask=sm & ok, other=0.0)
    else:
        z = s
    return s, z


@gluon.jit
def _consumer(x_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, N, n_tiles, stride_qk, w_smem, ready, empty,
              pid, P, T, u0, n, G: gl.constexpr, XS: gl.constexpr, BY_UNIT: gl.constexpr, TR: gl.constexpr,
              BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, IW: gl.constexpr, ZP: gl.constexpr,
              HAS_Z: gl.constexpr, PDL: gl.constexpr, STAGES: gl.constexpr):
    """The stream kernel's phases 1-3 with the words of unit i read from ring stage ``i % STAGES``."""
    NW: gl.constexpr = WR * WC
    RPT: gl.constexpr = TR // WR
    L3: gl.constexpr = gl.BlockedLayout([1, RPT, 4], [1, 1, 32], [WR, 1, WC], [2, 1, 0])
    X3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [XS * EPW, WR, RPT], X3)
    xs_smem = gl.allocate_shared_memory(gl.float32, [XS, WR, RPT], X3)

    # -- phase 1: the first unit's scales in flight, then x staged (after the previous kernel: PDL)
    s0, z0 = _scales(s_ptr, z_ptr, u0, 0 < n, stride_qk, G, TR, BN, WR, RPT, HAS_Z, L3)
    _S._wait_for_producer(PDL)
    _S._stage_x(x_ptr, x_smem, xs_smem, u0, n, G, XS, BY_UNIT, TR, WR, RPT, IW, NW, "")
    cta_barrier()

    # -- phase 2: the units; words from the ring, the next unit's scales in flight
    acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
    head = gl.zeros([BN], gl.float32, gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    t_head = -1
    seg_start = u0
    for i in range(n):
        u = u0 + i
        t = u // G
        g = u - t * G
        sn, zn = _scales(s_ptr, z_ptr, u + 1, i + 1 < n, stride_qk, G, TR, BN, WR, RPT, HAS_Z, L3)
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        w = w_smem.index(st).load(L3)
        mbarrier.arrive(empty.index(st))          # the words are in registers: the stage may refill
        xslot = i if BY_UNIT else g
        acc = _S._scale_unit(acc, _S._row_sums(w, x_smem, xslot, L3), s0, z0, xs_smem.index(xslot), ZP, HAS_Z,
                             L3)
        s0, z0 = sn, zn
        # -- phase 3: a segment ends at its tile's end or the range's (as the stream kernel)
        if (g == G - 1) | (i == n - 1):
            res = _S._tile_sum(acc, L3)
            whole = (seg_start == t * G) & (u + 1 == (t + 1) * G)
            if whole:
                _S._store_tile(res, t, N, out_ptr, BN, L3)
            elif seg_start == u0:
                head = res
                t_head = t
            else:
                _S._publish(res, ws_ptr, 2 * pid + 1, BN, L3)
                if t_head >= 0:
                    _S._publish(head, ws_ptr, 2 * pid, BN, L3)
                cta_barrier()
                if t_head >= 0:
                    _S._arrive(t_head, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)
                _S._arrive(t, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)
                t_head = -1
            acc = gl.zeros([WR, BN], gl.float32, gl.SliceLayout(1, L3))
            seg_start = u + 1
    if t_head >= 0:
        _S._publish(head, ws_ptr, 2 * pid, BN, L3)
        cta_barrier()
        _S._arrive(t_head, P, T, N, out_ptr, ws_ptr, cnt_ptr, G, BN, L3)


@gluon.jit
def gemv_stream_ws_kernel(x_ptr, w_desc, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, N, n_tiles, stride_qk,
                          G: gl.constexpr, XS: gl.constexpr, BY_UNIT: gl.constexpr, TR: gl.constexpr,
                          BN: gl.constexpr, WR: gl.constexpr, WC: gl.constexpr, IW: gl.constexpr, ZP: gl.constexpr,
                          HAS_Z: gl.constexpr, PDL: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """``gemv_stream_kernel``'s contract (same workspace, counters and constexprs but ``AHEAD``/``MODE``),
    the words through ``w_desc``: 3-D over ``(KWP / RPT, RPT, NP)``, block ``(WR, RPT, BN)``."""
    RPT: gl.constexpr = TR // WR
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    T = n_tiles * G
    u0 = (pid * T) // P
    n = ((pid + 1) * T) // P - u0
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, WR, RPT, BN], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (x_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, N, n_tiles, stride_qk, w_smem, ready, empty,
                     pid, P, T, u0, n, G, XS, BY_UNIT, TR, BN, WR, WC, IW, ZP, HAS_Z, PDL, STAGES)),
        (_words_partition, (w_desc, w_smem, ready, empty, u0, n, G, WR, BN, STAGES))],
        [1], [PRODUCER_REGS])


# -- host --------------------------------------------------------------------------------------------------

def _w_layout(WR, RPT, BN):
    return gl.NVMMASharedLayout.get_default_for([WR, RPT, BN], gl.int32)


class Launcher:
    """``gemv_stream.Launcher``'s interface for this kernel: ``stages`` ring stages, ``per_sm`` programs per SM
    (or ``programs``), ``block_n`` columns, ``warp_rows`` consumer warps along a unit's rows (two along its
    256 columns: 8 or 16 consumer warps)."""

    def __init__(self, op, layout, block_n=256, warp_rows=4, stages=6, per_sm=2, num_sms=132, programs=None,
                 pdl=True):
        import torch

        from portakern.backends.triton import gemv_stream as S
        from portakern.backends.triton import gemv_tuning as Tn
        from portakern.backends.triton.backend import KERNEL_OPTIONS

        num_warps = 2 * warp_rows
        cfg = Tn.fit(Tn.GemvConfig("stream", block_n, 16, num_warps=8, prefetch=1, per_sm=per_sm, pdl=pdl),
                     layout, 1)
        self.programs = S.grid_programs(op, layout, cfg, num_sms, programs)
        c = S.constexprs(op, layout, cfg, self.programs)
        self.consts = {k: c[k] for k in ("G", "XS", "BY_UNIT", "TR", "BN", "WR", "WC", "IW", "ZP", "HAS_Z", "PDL")}
        self.consts.update(WR=warp_rows, WC=num_warps // warp_rows, STAGES=stages, PRODUCER_REGS=40)
        self.WR, self.RPT, self.BN = warp_rows, c["TR"] // warp_rows, c["BN"]
        self.opts = dict(num_warps=num_warps, launch_pdl=pdl, **KERNEL_OPTIONS)
        self.n_tiles = -(-op.N // block_n)
        self.N = op.N
        self.ws = torch.empty((self.programs * 2, block_n), dtype=torch.float32, device="cuda")
        self.cnt = torch.zeros((self.n_tiles,), dtype=torch.int32, device="cuda")
        self._descs: dict[int, object] = {}

    def desc(self, qweight):
        """The words' 3-D descriptor (cached per weight tensor)."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        d = self._descs.get(qweight.data_ptr())
        if d is None:
            kwp, npad = qweight.shape
            d = TensorDescriptor(qweight, [kwp // self.RPT, self.RPT, npad], [self.RPT * npad, npad, 1],
                                 [self.WR, self.RPT, self.BN], _w_layout(self.WR, self.RPT, self.BN))
            self._descs[qweight.data_ptr()] = d
        return d

    def __call__(self, x, w, out) -> None:
        z = w.scales if w.zeros is None else w.zeros
        gemv_stream_ws_kernel[(self.programs,)](x, self.desc(w.qweight), w.scales, z, out, self.ws, self.cnt, self.N,
                                                self.n_tiles, w.stride_qk, **self.consts, **self.opts)


def check(configs, res) -> int:
    """``gemv_stream_probe.check`` (its cases, grids of 1 / 7 / 132 / 1000 programs, NaN-poisoned outputs) with
    this kernel at each ``(stages, per_sm, warp_rows)``; returns the failures."""
    import experiments.gemv_stream_probe as SP

    return SP.check(configs, res, make=lambda op, p, c, programs: Launcher(op, p, stages=c[0], per_sm=c[1],
                                                                             warp_rows=c[2], programs=programs))


def bench(configs, res, shapes) -> None:
    """Per shape: the table's CUDA-core kernel, the stream kernel's table configuration and this kernel's
    ``(stages, per_sm, warp_rows)``, per call in CUDA graphs over rotated inputs (``gemv_stream_probe._problem``)."""
    import torch

    import experiments.gemv_stream_probe as SP
    import gemv as B
    from portakern.backends.triton import gemv_stream as S

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in shapes:
        op, _copies, sets, row = SP._problem(N, K, sms, res)
        p = sets[0][1]
        ref = sets[0][2].clone()
        st = S.Launcher(op, p, SP._cfg(p, 256, 1, 2), sms, "cuda")
        row["stream_us"] = B.graph_us([(lambda s=s: st(*s)) for s in sets])
        st(*sets[0])
        ref.copy_(sets[0][2])
        row["ws"] = {}
        for stages, per_sm, wr in configs:
            key = f"st{stages}-x{per_sm}-w{2 * wr}"
            try:
                ln = Launcher(op, p, stages=stages, per_sm=per_sm, warp_rows=wr, num_sms=sms)
                sets[0][2].fill_(float("nan"))
                ln(*sets[0])
                err = (sets[0][2].float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                row["ws"][key] = B.graph_us([(lambda s=s: ln(*s)) for s in sets]) if err < 1e-2 else f"ERR {err:.3g}"
            except Exception as e:
                row["ws"][key] = f"{type(e).__name__}: {str(e)[:200]}"
        best = min((v for v in row["ws"].values() if isinstance(v, float)), default=float("nan"))
        res["bench"].append(row)
        f = row["floor_us"]
        print(f"{N:6d}x{K:<6d} floor {f:6.2f} table {row['table_us']:6.2f} ({f / row['table_us']:.0%}) stream "
              f"{row['stream_us']:6.2f} ({f / row['stream_us']:.0%}) ws {best:6.2f} ({f / best:.0%}) | "
              + " ".join(f"{k}:{v:.2f}" if isinstance(v, float) else f"{k}:x" for k, v in row["ws"].items()),
              flush=True)
        del sets
        torch.cuda.empty_cache()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("check", "bench", "lower"), required=True)
    ap.add_argument("--configs", nargs="+", default=["6,1,8", "4,1,8", "8,1,8", "6,1,4"],
                    metavar="STAGES,PER_SM[,WARP_ROWS]", help="warp rows 4 (8 consumer warps, the default) or 8 (16)")
    ap.add_argument("--shapes", nargs="+", default=["28672x8192", "16384x16384", "14336x4096", "8192x8192",
                                                     "4096x14336", "4096x4096"], metavar="NxK")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    configs = [(tuple(int(v) for v in c.split(",")) + (4,))[:3] for c in a.configs]
    if a.phase == "lower":
        raise SystemExit(lower(sorted({(st, wr) for st, _, wr in configs})))
    import gemv as B
    from experiments import harness

    res = harness.header(__doc__, B.copy_bandwidth_TBps(), check=[], bench=[])
    fails = 0
    try:
        if a.phase == "check":
            fails = check(configs, res)
        else:
            bench(configs, res, [tuple(int(v) for v in s.split("x")) for s in a.shapes])
    finally:
        harness.write(res, a.out, f"gemv-stream-ws-{a.phase}", a.tag)
    raise SystemExit(1 if fails else 0)


def lower(variants) -> int:
    """sm_90a lowering of the kernel for 28672 x 8192 int4 g128 (no GPU): shared memory, TMA and barrier counts."""
    import re

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from portakern.backends.triton.backend import KERNEL_OPTIONS, interpret_env

    BN, N, K = 256, 28672, 8192
    kwp = K // 8
    for st, WR in variants:
        RPT = 16 // WR
        wd = TensorDescriptor(torch.empty((kwp, N), dtype=torch.int32, device="meta"), [kwp // RPT, RPT, N],
                              [RPT * N, N, 1], [WR, RPT, BN], _w_layout(WR, RPT, BN))
        sig = {"x_ptr": "*bf16", "w_desc": mangle_type(wd), "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
               "ws_ptr": "*fp32", "cnt_ptr": "*i32", "N": "i32", "n_tiles": "i32", "stride_qk": "i32"}
        consts = dict(G=K // 128, XS=64, BY_UNIT=True, TR=16, BN=BN, WR=WR, WC=2, IW=8, ZP=8, HAS_Z=True, PDL=True,
                      STAGES=st, PRODUCER_REGS=40)
        for k in consts:
            sig[k] = "constexpr"
        with interpret_env(False):
            ck = triton.compile(GluonASTSource(gemv_stream_ws_kernel, sig, consts),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2 * WR, **KERNEL_OPTIONS))
        ptx = ck.asm["ptx"]
        print(f"stages {st}, {2 * WR} consumer warps: {ck.n_regs if hasattr(ck, 'n_regs') else '?'} registers, "
              f"shared {ck.metadata.shared} bytes, TMA copies {len(re.findall('cp.async.bulk.tensor', ptx))}"
              f", mbarrier waits {len(re.findall('mbarrier.try_wait', ptx))}, bar.sync {len(re.findall('bar.sync', ptx))}",
              flush=True)
    return 0


if __name__ == "__main__":
    main()
