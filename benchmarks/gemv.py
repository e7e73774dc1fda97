"""Weight-only quantized GEMV on an NVIDIA GPU: portakern against its peers.

Same process, same inputs. Peers: tinygemm (``torch.ops.aten._weight_int4pack_mm``, its own
packing from ``_convert_weight_to_int4pack``, bf16), bf16 ``F.linear``, torch's int8 per-channel
``_weight_int8pack_mm`` for the int8 rows, and gemlite when it is importable. Every figure is the
median time per call, eager (a Python loop of launches) and inside a CUDA graph, over input sets
rotated across more than 4x the L2, so no call reads its weight from cache. The floor of a
problem is its bytes (packed codes + one fp16 scale, and one fp16 zero for asymmetric formats,
per group, + x + out) over the device-to-device copy bandwidth measured in the same run.

    python benchmarks/gemv.py [--sweep] [--quick] [--out DIR] [--workers N]

The main table's "pk" figures are the kernel ``portakern.quant_gemv`` runs for the problem (``pk_backend``: the
triton table, or the cuda backend where its measured table ranks it first -- the triton table is then timed
beside it as ``triton_*``), or a sweep's winner where ``--sweep`` ran.

``--sweep`` times the candidate configurations on representative shapes first; the fastest per
(M, shape) serves the main table in the same run, and is printed for ``gemv_tuning``'s sm_90 table.
Kernels are compiled up front in a pool of processes (Triton's disk cache serves the main process).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace

import torch

from cuda_graphs import warm_on_side_stream  # benchmarks/ is the script's folder
from portakern.backends.triton import gemv_tuning as tuning
from portakern.backends.triton import quant_gemv as Q
from portakern.backends.triton.gemv_tuning import GemvConfig
from portakern.conformance.report import run_identity
from portakern.devices import torch_device
from portakern.gemv_weight import PreparedGemvWeight
from portakern.ir import DType, QuantFormat, gemv_layout
from portakern.ir.ops import QuantGemv

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (16384, 16384)]
MS = (1, 4, 16)
L2_ROTATE = 4 * 64 * 2**20   # rotate over more than 4x the (60 MB) L2


# -- problems ---------------------------------------------------------------------------------------

def gemv_op(M, N, K, bits=4, gs=128, sym=False, dtype=DType.bfloat16) -> QuantGemv:
    return QuantGemv(M=M, N=N, K=K, dtype=dtype, fmt=QuantFormat(bits=bits, group_size=gs, symmetric=sym))


def floor_bytes(op: QuantGemv) -> int:
    """Codes + fp16 scale (+ fp16 zero) per group + x + out (the peers' convention)."""
    G = op.K // op.fmt.group_size
    per_group = 2 + (0 if op.fmt.symmetric else 2)
    return (op.N * op.K * op.fmt.bits // 8 + op.N * G * per_group
            + op.M * op.K * op.dtype.itemsize + op.M * op.N * op.result_dtype.itemsize)


def random_prepared(N, K, bits, gs, sym, device="cuda", scale_dtype=torch.float16) -> PreparedGemvWeight:
    """A random weight directly in the internal layout (timing only: random codes, no zeros)."""
    epw = 32 // bits
    kw = -(-K // epw)
    kwp = -(-kw // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    npad = -(-N // gemv_layout.N_ALIGN_WORDS) * gemv_layout.N_ALIGN_WORDS
    qw = torch.randint(-2**31, 2**31 - 1, (kwp, npad), dtype=torch.int32, device=device)
    qw[kw:] = 0
    G = K // gs
    s = (torch.rand(G, npad, device=device) * 0.01 + 0.001).to(scale_dtype)
    z = None if sym else torch.randint(0, 1 << bits, (G, npad), device=device).to(scale_dtype)
    frag = None   # the tensor-core fragment layout, where prepare_weight would build one (random words too)
    if gemv_layout.frag_eligible(bits, gs, False, False) is None:
        frag = torch.randint(-2**31, 2**31 - 1, (-(-K // gemv_layout.FRAG_CHUNK), npad // 16, 256), dtype=torch.int32,
                             device=device)
    return PreparedGemvWeight(qw, s, z, None, None, bits, gs, 1 << (bits - 1), N, K, frag=frag)


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(L2_ROTATE / max(1, nbytes)))


# -- timing -----------------------------------------------------------------------------------------

def eager_us(fns, reps=None):
    reps = reps or max(1, 200 // len(fns))
    for f in fns:
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            for f in fns:
                f()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / (reps * len(fns)))
    return statistics.median(ts)


def graph_us(fns, calls=240):
    """Per-call time inside one CUDA graph of ``calls`` launches cycling over ``fns``."""
    warm_on_side_stream(fns)
    torch.cuda.synchronize()
    reps = max(1, calls // len(fns))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / (reps * len(fns)))
    del g
    return statistics.median(ts)


def copy_bandwidth_TBps() -> float:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    t = eager_us([lambda: b.copy_(a)], reps=10)
    return 2 * n / (t * 1e-6) / 1e12


# -- portakern and peers ----------------------------------------------------------------------------

def ours(op: QuantGemv, cfg: GemvConfig | None, copies: int, kern=None):
    """Input sets for the triton kernel of ``op`` under ``cfg`` (None: its table) -- or for ``kern``, any kernel of
    the triton layout -- and that kernel."""
    dev = torch_device("cuda", 0)
    kern = Q.compile(op, dev, cfg) if kern is None else kern
    dt = getattr(torch, op.dtype.value)
    sets = []
    for _ in range(copies):
        w = random_prepared(op.N, op.K, op.fmt.bits, op.fmt.group_size, op.fmt.symmetric)
        x = torch.randn(op.M, op.K, device="cuda").to(dt)
        out = torch.empty(op.M, op.N, device="cuda", dtype=dt)
        sets.append((x, w, out))
    fns = [(lambda s=s: kern(*s)) for s in sets]
    return fns, kern


def dispatched(op: QuantGemv) -> tuple[str, object]:
    """``(backend, kernel)``: what ``portakern.quant_gemv`` / the torch op run for ``op`` on this GPU (the triton
    table, or the cuda backend where its measured table ranks it first; ``torch_ops.gemv_kernel``)."""
    from portakern import torch_ops

    return torch_ops.gemv_kernel(op, torch_device("cuda", 0))


def config_json(kern) -> dict:
    """The launch configuration of a triton table kernel or a cuda backend kernel, as JSON."""
    cfg = getattr(kern, "config", None)     # the cuda backend's SmallMConfig
    return asdict(cfg) if cfg is not None else next(iter(kern.launchers.values())).cfg.to_json()


def tinygemm(M, N, K, gs, copies):
    sets = []
    for _ in range(copies):
        w = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
        packed = torch.ops.aten._convert_weight_to_int4pack(w, 8)
        sz = (torch.rand(K // gs, N, 2, device="cuda") * 0.01).to(torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        sets.append((x, packed, sz))
    return [(lambda s=s: torch.ops.aten._weight_int4pack_mm(s[0], s[1], gs, s[2])) for s in sets]


def bf16_linear(M, N, K, copies):
    sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
             torch.randn(N, K, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    return [(lambda s=s: torch.nn.functional.linear(s[0], s[1])) for s in sets]


def int8_torch(M, N, K, copies):
    sets = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
             torch.randint(-128, 127, (N, K), dtype=torch.int8, device="cuda"),
             torch.rand(N, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    return [(lambda s=s: torch.ops.aten._weight_int8pack_mm(s[0], s[1], s[2])) for s in sets]


def gemlite_fns(M, N, K, gs, copies):
    import gemlite  # noqa: F401  (optional peer)
    from gemlite.helper import A16W4

    sets = []
    for _ in range(copies):
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.float16, device="cuda")
        layer = A16W4(device="cuda").from_linear(lin)
        sets.append((torch.randn(M, K, device="cuda", dtype=torch.float16), layer))
    return [(lambda s=s: s[1](s[0])) for s in sets]


# -- compile up front ---------------------------------------------------------------------------------

def _warm(job):
    try:
        op = QuantGemv.from_json(job["op"])
        fns, _ = ours(op, GemvConfig(**job["cfg"]) if job["cfg"] else None, 1)
        fns[0]()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, and the config is skipped in the sweep
        return f"{type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, workers):
    uniq = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    t = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    errors = {}
    with cf.ProcessPoolExecutor(max_workers=max(1, min(workers, len(uniq))), mp_context=ctx) as ex:
        for j, err in zip(uniq, ex.map(_warm, uniq)):
            if err:
                errors[json.dumps(j, sort_keys=True)] = err
    print(f"precompiled {len(uniq)} kernels in {time.time() - t:.1f}s ({len(errors)} failed)", flush=True)
    for k, e in list(errors.items())[:6]:
        print("   ", k[:160], "->", e, flush=True)
    return errors


# -- sweep -------------------------------------------------------------------------------------------

def sweep_candidates(M: int, dqs=(2,), swaps=(False,), stages=(1,), prefetch=(1,), pdls=(False,),
                     group_rows=(False,), mma=False, mma_grid=((64, 128), (4, 8), (1, 2, 3, 4)),
                     bits: int = 4) -> list[GemvConfig]:
    """What the sweep times per M (``split_k=0``: the automatic split and no split; for group-resident
    tiles half, once and twice the automatic split), for each dequant variant in ``dqs``, pipeline
    depth in ``stages`` and register prefetch depth in ``prefetch`` (CUDA-core kernel), operand order
    in ``swaps`` (tensor-core kernel), each programmatic-dependent-launch setting in ``pdls``, and
    (M=1) with ``True`` in ``group_rows`` the group-resident tiles: 4 or 8 columns per thread, 8 or 16
    word rows (int8: also 32, a whole group), 1, 2 or 4 warps. ``mma``: the group-scaled tensor-core kernel (also at M=1, where its
    MMA multiplies 15 rows of padding for free), 64 or 128 columns, 4 or 8 warps, 2 to 4 pipeline
    stages (its K tile is the group's)."""
    out = []
    if mma:
        out += [GemvConfig("mma", bn, 16, w, st, 0, x_runs=xr) for bn in mma_grid[0] for w in mma_grid[1]
                for st in mma_grid[2] for xr in (False, True)]
    for dq in dqs:
        if M == 1:
            out += [GemvConfig("fma", bn, bkw, w, st, 0, dq, prefetch=pf) for bn in (32, 64) for bkw in (32, 64)
                    for w in (4, 8) for st in stages for pf in prefetch if st == 1 or pf == 1]
            if True in group_rows:
                out += [GemvConfig("fma", 32 * cols * w, bkw, w, 1, 0, dq, group_rows=True)
                        for w in (1, 2, 4) for cols in (4, 8) for bkw in (8, 16) + ((32,) if bits == 8 else ())]
        elif M <= 4:
            out += [GemvConfig("fma", bn, bkw, 4, 1, 0, dq) for bn in (32, 64) for bkw in (32, 64)]
    for sw in swaps:
        if 1 < M <= 4:
            out += [GemvConfig("dot", bn, bkw, 4, 2, 0, 2, sw) for bn in (64, 128) for bkw in (16, 32)]
        if M > 4:
            out += [GemvConfig("dot", bn, bkw, 4, 2, 0, 2, sw) for bn in (32, 64, 128) for bkw in (16, 32)]
            out += [GemvConfig("dot", bn, 32, 8, 2, 0, 2, sw) for bn in (64, 128)]
    return [replace(c, pdl=bool(p)) for p in pdls for c in out]


def with_split(cfg: GemvConfig, op: QuantGemv, splits=None) -> list[GemvConfig]:
    """``split_k=0`` in a candidate means: the automatic choice, and 1."""
    if cfg.split_k:
        return [cfg]
    kwp = -(-(-(-op.K // (32 // op.fmt.bits))) // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    auto = tuning.split_k_for(op.N, kwp, cfg, 132)
    more = {max(1, auto // 2), 2 * auto} if (cfg.group_rows or cfg.kind == "mma") else {1}
    return [replace(cfg, split_k=s) for s in sorted({auto} | more | set(splits or ()))]


def frag_candidates(op: QuantGemv, pdls=(False,), num_sms: int = 132) -> list[GemvConfig]:
    """Kind "frag" (M = 2..16, int4 groups of a multiple of 128): the table's row counts (64 rows of 2 warps,
    128 and 256 of 4; 256 is the LM head's) at the automatic split of K, half and twice it, with each setting in
    ``pdls``."""
    if not tuning.FRAG_MIN_M <= op.M <= 16 or op.fmt.bits != 4 or op.fmt.group_size % 128:
        return []
    out = []
    for bn, w in ((64, 2), (128, 4), (256, 4)):
        base = GemvConfig("frag", bn, 32, w)
        auto = tuning.frag_split(op.N, op.K, base, op.M, num_sms)
        for sk in sorted({max(1, auto // 2), auto, min(2 * auto, tuning.FRAG_MAX_SPLIT)}):
            out += [replace(base, split_k=sk, pdl=bool(p)) for p in pdls]
    return out


def split_for_shape(cfg: GemvConfig, M: int, N: int, K: int, bits: int) -> GemvConfig:
    """``cfg`` (a sweep winner of another shape) with the split of K its kind's rule gives ``(N, K)``."""
    if cfg.kind == "frag":
        return replace(cfg, split_k=tuning.frag_split(N, K, cfg, M, 132))
    kwp = -(-(-(-K // (32 // bits))) // gemv_layout.K_ALIGN_WORDS) * gemv_layout.K_ALIGN_WORDS
    return replace(cfg, split_k=tuning.split_k_for(N, kwp, cfg, 132))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--tag", default="")
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS))
    ap.add_argument("--dq", type=int, nargs="+", default=[2],
                    help="dequant variants the sweep times for the CUDA-core kernel (M <= 4)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1],
                    help="num_stages values the sweep times for the CUDA-core kernel at M=1 (Triton's pipeliner)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[1],
                    help="register prefetch depths (tiles of words ahead) the sweep times at M=1")
    ap.add_argument("--pdl", type=int, nargs="+", default=[0], choices=(0, 1),
                    help="programmatic dependent launch settings the sweep times (1: GemvConfig.pdl, sm_90+; "
                         "in a graph of back-to-back calls each kernel's start overlaps the previous one's tail)")
    ap.add_argument("--sweep-shapes", nargs="+", default=["4096x4096", "28672x8192", "4096x14336"],
                    help="(N)x(K) shapes the sweep times")
    ap.add_argument("--sweep-bits", type=int, nargs="+", default=[4], choices=(4, 8),
                    help="code widths the sweep times (8: int8 at M=1 only, the main table's int8 rows take its "
                         "winner of the nearest shape)")
    ap.add_argument("--group-rows", type=int, nargs="+", default=[0], choices=(0, 1),
                    help="1: the sweep also times group-resident tiles at M=1 (GemvConfig.group_rows)")
    ap.add_argument("--no-table", action="store_true", help="only the sweep, not the main table")
    ap.add_argument("--table-bits", type=int, nargs="+", default=[4, 8], choices=(4, 8),
                    help="code widths of the main table's rows (int4: every M and shape; int8: M=1, the three "
                         "largest shapes)")
    ap.add_argument("--swap", choices=("no", "yes", "both", "none"), default="no",
                    help="operand order(s) the sweep times for the tensor-core kernel (GemvConfig.swap_ab); "
                         "none: no 'dot' candidates")
    ap.add_argument("--frag", type=int, default=0, choices=(0, 1),
                    help="1: the sweep also times the fragment-layout tensor-core kernel (kind 'frag', M > 1): 64 "
                         "and 128 rows per program at the automatic split of K, half and twice it, each --pdl")
    ap.add_argument("--mma", type=int, default=0, choices=(0, 1),
                    help="1: the sweep also times the group-scaled tensor-core kernel (kind 'mma')")
    ap.add_argument("--mma-bn", type=int, nargs="+", default=[64, 128], help="block_n values of the 'mma' sweep")
    ap.add_argument("--mma-warps", type=int, nargs="+", default=[4, 8], help="num_warps values of the 'mma' sweep")
    ap.add_argument("--mma-stages", type=int, nargs="+", default=[1, 2, 3, 4], help="num_stages values of the 'mma' sweep")
    args = ap.parse_args()
    swaps = {"no": (False,), "yes": (True,), "both": (False, True), "none": ()}[args.swap]
    stages = tuple(args.stages)
    ms = tuple(args.ms)

    props = torch.cuda.get_device_properties(0)
    import triton

    res = {"what": "quantized GEMV, medians per call; floor = bytes / copy bandwidth (see benchmarks/gemv.py)",
           "date": datetime.date.today().isoformat(),
           "env": {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                   "triton": triton.__version__, "cuda": torch.version.cuda,
                   "l2": getattr(props, "L2_cache_size", None)},
           "sweep": [], "rows": []}
    res["identity"] = run_identity(torch_device("cuda", 0))
    bw = copy_bandwidth_TBps()
    res["copy_TBps"] = bw
    print(f"copy bandwidth {bw:.3f} TB/s", flush=True)
    try:
        import gemlite  # noqa: F401
        has_gemlite = True
    except Exception as e:
        has_gemlite = False
        res["gemlite"] = f"not importable: {type(e).__name__}: {e}"

    shapes = SHAPES[:2] if args.quick else SHAPES
    sweep_shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.sweep_shapes]
    best: dict[tuple, GemvConfig] = {}

    # -- compile everything the run will launch, in parallel
    jobs = []
    sweep_problems = [(bits, M, N, K) for bits in args.sweep_bits for M in (ms if bits == 4 else (1,))
                      for (N, K) in sweep_shapes]
    def sweep_configs(op: QuantGemv) -> list[GemvConfig]:
        """The concrete configurations the sweep times for ``op`` (each with its split of K)."""
        out = [cs for c in sweep_candidates(op.M, args.dq, swaps, stages, tuple(args.prefetch), tuple(args.pdl),
                                            tuple(bool(g) for g in args.group_rows), bool(args.mma),
                                            (args.mma_bn, args.mma_warps, args.mma_stages), op.fmt.bits)
               for cs in with_split(c, op)]
        return out + (frag_candidates(op, tuple(bool(p) for p in args.pdl)) if args.frag else [])

    if args.sweep:
        for bits, M, N, K in sweep_problems:
            op = gemv_op(M, N, K, bits=bits)
            jobs += [{"op": op.to_json(), "cfg": asdict(cs)} for cs in sweep_configs(op)]
    if args.no_table:
        shapes = []
    table = [(bits, M, N, K) for bits in args.table_bits for M in (ms if bits == 4 else (1,))
             for (N, K) in (shapes if bits == 4 else shapes[3:])]
    jobs += [{"op": gemv_op(M, N, K, bits=bits).to_json(), "cfg": None} for bits, M, N, K in table]
    failed = precompile(jobs, args.workers)

    # -- sweep: graph time per candidate
    if args.sweep:
        for bits, M, N, K in sweep_problems:
            op = gemv_op(M, N, K, bits=bits)
            copies = copies_for(floor_bytes(op))
            timed = []
            for cs in sweep_configs(op):
                if json.dumps({"op": op.to_json(), "cfg": asdict(cs)}, sort_keys=True) in failed:
                    continue
                try:
                    fns, _ = ours(op, cs, copies)
                    t = graph_us(fns, calls=60)
                except Exception as e:
                    print(f"  sweep error {cs}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                del fns
                timed.append((t, cs))
                res["sweep"].append({"bits": bits, "M": M, "N": N, "K": K, "cfg": asdict(cs), "graph_us": t,
                                     "frac_floor": floor_bytes(op) / (t * 1e-6) / (bw * 1e12)})
            timed.sort(key=lambda p: p[0])
            if timed:
                best[(bits, M, N, K)] = timed[0][1]
                print(f"sweep int{bits} M={M} N={N} K={K}: " + "; ".join(
                    f"{t:.1f}us {c.kind} bn{c.block_n} kw{c.block_kw} w{c.num_warps} s{c.num_stages} "
                    f"sk{c.split_k} dq{c.dq}{' swap' if c.swap_ab else ''}{' xruns' if c.x_runs else ''}{' ahead2' if c.prefetch == 2 else ''}{' pdl' if c.pdl else ''}"
                    f"{' rows' if c.group_rows else ''}"
                    for t, c in timed[:4]), flush=True)
            torch.cuda.empty_cache()

    def pick(bits, M, N, K):
        """The sweep winner of the nearest swept shape (same bits and M), else the table."""
        cands = [(abs(math.log(N / n)) + abs(math.log(K / k)), c) for (b, m, n, k), c in best.items()
                 if (b, m) == (bits, M)]
        if not cands:
            return None
        dist, c = min(cands, key=lambda p: p[0])
        if dist == 0:   # the swept shape itself: its winner as timed
            return c
        return split_for_shape(c, M, N, K, bits)   # the split follows the shape

    # -- main table
    rows = []
    for bits, M, N, K in table:
        op = gemv_op(M, N, K, bits=bits)
        fb = floor_bytes(op)
        floor_us = fb / (bw * 1e12) * 1e6
        row = {"bits": bits, "M": M, "N": N, "K": K, "floor_us": floor_us, "bytes": fb}
        copies = copies_for(fb)
        try:
            cfg = pick(bits, M, N, K)
            backend, kern = ("triton", None) if cfg is not None else dispatched(op)
            fns, kern = ours(op, cfg, copies, kern)
            row["pk_backend"] = backend
            row["pk_graph_us"] = graph_us(fns)
            row["pk_eager_us"] = eager_us(fns)
            row["pk_config"] = config_json(kern)
            del fns
            if backend != "triton":   # the triton table beside the backend dispatch ranked first, same run
                fns, kern = ours(op, None, copies)
                row["triton_graph_us"], row["triton_eager_us"] = graph_us(fns), eager_us(fns)
                row["triton_config"] = config_json(kern)
                del fns
        except Exception as e:
            row["pk_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        peers = {}
        if bits == 4:
            peers["tinygemm"] = lambda: tinygemm(M, N, K, 128, copies_for(N * K // 2))
            if has_gemlite:
                peers["gemlite"] = lambda: gemlite_fns(M, N, K, 128, copies_for(N * K // 2))
        else:
            peers["torch_int8"] = lambda: int8_torch(M, N, K, copies_for(N * K))
        peers["bf16"] = lambda: bf16_linear(M, N, K, copies_for(2 * N * K))
        for name, mk in peers.items():
            try:
                fns = mk()
                row[f"{name}_graph_us"] = graph_us(fns)
                row[f"{name}_eager_us"] = eager_us(fns)
                del fns
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if "pk_graph_us" in row:
            row["pk_frac_floor_graph"] = floor_us / row["pk_graph_us"]
            row["pk_frac_floor_eager"] = floor_us / row["pk_eager_us"]
            for name in peers:
                if f"{name}_graph_us" in row:
                    row[f"speedup_vs_{name}_graph"] = row[f"{name}_graph_us"] / row["pk_graph_us"]
                    row[f"speedup_vs_{name}_eager"] = row[f"{name}_eager_us"] / row["pk_eager_us"]
        rows.append(row)
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
    res["rows"] = rows
    res["best_sweep"] = {f"int{b}-M{m}-N{n}-K{k}": asdict(c) for (b, m, n, k), c in best.items()}

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gemv-{res['date']}{args.tag}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    # -- short table last
    print(f"\ncopy {bw:.3f} TB/s; {path}")
    print(f"{'b':>2} {'M':>2} {'N':>6} {'K':>6} {'floor':>6} {'backend':>7} {'pk_g':>6} {'frac':>5} {'tiny_g':>6} "
          f"{'x':>5} {'bf16_g':>6} {'pk_e':>6} {'tiny_e':>6} {'trit_g':>6}")
    for r in rows:
        peer = "tinygemm" if r["bits"] == 4 else "torch_int8"
        print(f"{r['bits']:>2} {r['M']:>2} {r['N']:>6} {r['K']:>6} {r['floor_us']:6.1f} {r.get('pk_backend', '-'):>7} "
              f"{r.get('pk_graph_us', float('nan')):6.1f} {r.get('pk_frac_floor_graph', float('nan')):5.2f} "
              f"{r.get(peer + '_graph_us', float('nan')):6.1f} {r.get('speedup_vs_' + peer + '_graph', float('nan')):5.2f} "
              f"{r.get('bf16_graph_us', float('nan')):6.1f} {r.get('pk_eager_us', float('nan')):6.1f} "
              f"{r.get(peer + '_eager_us', float('nan')):6.1f} {r.get('triton_graph_us', float('nan')):6.1f}")


if __name__ == "__main__":
    sys.exit(main())
