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
(M, shape) serves the main table in the same run, and is printed for the sm_90 rows of ``backends/triton/tuning.py``.
Kernels are compiled up front in a pool of processes (Triton's disk cache serves the main process).
"""


from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import asdict

import torch

from gemv_peers import bf16_linear, gemlite_fns, int8_torch, tinygemm  # benchmarks/ is the script's folder
from gemv_problems import config_json, dispatched, floor_bytes, gemv_op, ours, precompile
from gemv_sweep import frag_candidates, split_for_shape, sweep_candidates, with_split
from harness import default_out, result_path, write
from timing import copies_for, copy_bandwidth_TBps, eager_us, graph_us
from portakern.backends.triton.quant_gemv.config import GemvConfig
from portakern.conformance.report import run_identity
from portakern.devices import torch_device
from portakern.gemv_weight import check_layout
from portakern.ir.gemv_layout import frag_eligible
from portakern.ir.ops import QuantGemv

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (16384, 16384)]
MS = (1, 4, 16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true",
                    help="time the candidate configurations on --sweep-shapes first; the fastest serve the table")
    ap.add_argument("--quick", action="store_true", help="the main table's first two shapes only")
    ap.add_argument("--out", default=default_out(),
                    help="folder of the result gemv<TAG>-<card>.json (default $OUT or benchmarks/results)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                    help="processes compiling the kernels up front")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -int8-sweep)")
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS), help="rows of x (default 1 4 16)")
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
            # a sweep's winner may be a word kind: its weights keep both layouts; else what a user's weights hold
            layout = "words+fragments" if cfg is not None else check_layout(None)
            frag_only = layout == "fragments" and frag_eligible(bits, 128, False, False) is None
            fns, kern = ours(op, cfg, copies, kern, layout=layout)
            row["layout"] = "fragments" if frag_only else "words" if layout == "fragments" else layout
            row["pk_backend"] = backend
            row["pk_graph_us"] = graph_us(fns)
            row["pk_eager_us"] = eager_us(fns)
            row["pk_config"] = config_json(kern, frag_only)
            del fns
            if backend != "triton":   # the triton table beside the backend dispatch ranked first, same run
                fns, kern = ours(op, None, copies, layout=layout)
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

    path = write(res, result_path(args.out, "gemv", args.tag))
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
