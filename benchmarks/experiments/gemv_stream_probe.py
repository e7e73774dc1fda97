"""The stream-K int4 GEMV (kernels/gemv_stream.py) at M = 1: checked against float64, timed against the fma table.

    python benchmarks/experiments/gemv_stream_probe.py [--phase check|bench|both] [--configs ...]

check: packings (native asym / sym, AWQ, GPTQ), fp16 / bf16 x, odd N, K from 512 to 16384, and grids of
1, 7, 132 and 1000 programs (so segments cover whole tiles, parts of tiles, and tiles are shared by many
programs), each launched twice on a NaN-poisoned output (the arrival counters reset themselves).
bench: per shape, the table's CUDA-core kernel (``choose(stream=False)``) and every stream configuration,
tinygemm and the floor, in
CUDA graphs over input sets rotated past 4x the L2 (``benchmarks/gemv.py``'s method).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import gemv as B                                        # noqa: E402
from experiments import harness                         # noqa: E402
from gemv_cases import weight                           # noqa: E402

from portakern.backends.triton import gemv_stream as S  # noqa: E402
from portakern.backends.triton import gemv_tuning as T  # noqa: E402
from portakern.backends.triton import quant_gemv as Q   # noqa: E402
from portakern.devices import torch_device              # noqa: E402
from portakern.ir.packing import dequantize             # noqa: E402
from portakern.validate import quant_gemv_op            # noqa: E402

#: (block_n, units ahead, programs per SM)
CONFIGS = [(256, 1, 2), (256, 2, 2), (256, 1, 1), (128, 1, 4), (128, 2, 4), (256, 1, 3)]


def _cfg(layout, bn, ahead, per_sm):
    return T.fit(T.GemvConfig("stream", bn, 16, prefetch=ahead, per_sm=per_sm, pdl=True), layout, 1)
CHECK_CASES = [  # (packing, sym, N, K, dtype)
    ("native", False, 40, 512, "bfloat16"), ("native", True, 300, 1024, "float16"),
    ("awq", False, 520, 2048, "bfloat16"), ("gptq", False, 256, 4096, "float16"),
    ("native", False, 4096, 4096, "bfloat16"), ("native", False, 1000, 14336, "bfloat16"),
    ("native", True, 640, 16384, "bfloat16"),
]
BENCH_SHAPES = [(4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 4096), (8192, 8192),
                (28672, 8192), (16384, 16384), (128256, 4096)]


def check(cfgs, res, make=None):
    """Every check case under each configuration of ``cfgs`` and grids of 1 / 7 / 132 / 1000 programs, two
    launches each on a NaN-poisoned output; returns the failures. ``make(op, prepared, cfg, programs)`` builds the
    launcher (default: the stream kernel's, ``cfg`` = (block_n, units ahead, programs per SM));
    ``experiments/gemv_stream_ws.py`` passes its own."""
    make = make or (lambda op, p, c, programs: S.Launcher(op, p, _cfg(p, *c), 132, "cuda", programs=programs))
    dev = torch_device("cuda", 0)
    fails = 0
    for packing, sym, N, K, dt in CHECK_CASES:
        case = (f"{packing}-{N}x{K}", packing, 4, 128, sym, 1, N, K, dt, {})
        w = weight(case)
        x = torch.randn(1, K, device="cuda", dtype=torch.float64).to(getattr(torch, dt))
        wd = w.with_tensors({k: torch.as_tensor(v).to("cuda") for k, v in w.tensors.items()})
        op, _ = quant_gemv_op(x, wd)
        p = Q.prepare_weight(None, w, dev)
        ref = x.double().cpu().numpy() @ dequantize(w.fmt, w.tensors, w.N, w.K).T
        for cfg in cfgs:
            for programs in (1, 7, 132, 1000):
                ln = make(op, p, cfg, programs)
                out = torch.empty(1, N, device="cuda", dtype=x.dtype)
                errs = harness.poisoned_errors(lambda: ln(x, p, out), out, ref)
                ok = all(e <= {"bfloat16": 1e-2, "float16": 2e-3}[dt] for e in errs)
                fails += not ok
                res["check"].append(dict(case=case[0], dtype=dt, cfg=list(cfg), programs=ln.programs,
                                         errs=errs, ok=ok))
                print(f"check {case[0]:18s} {dt:8s} {','.join(map(str, cfg))} P={ln.programs:5d} "
                      f"{'ok ' if ok else 'BAD'} {max(errs):.2e}", flush=True)
    return fails


def _problem(N, K, sms, res):
    """``(op, copies, sets, row)`` of shape (N, K): input sets rotated past 4x the L2, and the row with the
    floor and the CUDA-core table kernel's time (``choose(stream=False)``) in the same process."""
    op = B.gemv_op(1, N, K)
    copies = B.copies_for(B.floor_bytes(op))
    row = dict(N=N, K=K, floor_us=B.floor_bytes(op) / (res["copy_TBps"] * 1e12) * 1e6)
    fns, _ = B.ours(op, T.choose(B.random_prepared(N, K, 4, 128, False), 1, N, "sm_90", sms, stream=False), copies)
    row["table_us"] = B.graph_us(fns)
    sets = [(torch.randn(1, K, device="cuda").to(torch.bfloat16),
             B.random_prepared(N, K, 4, 128, False), torch.empty(1, N, device="cuda", dtype=torch.bfloat16))
            for _ in range(copies)]
    return op, copies, sets, row


def bench(cfgs, res, shapes):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in shapes:
        op, copies, sets, row = _problem(N, K, sms, res)
        floor_us = row["floor_us"]
        row["stream"] = {}
        for bn, ahead, per_sm in cfgs:
            key = f"{bn}x{ahead}x{per_sm}"
            try:
                ln = S.Launcher(op, sets[0][1], _cfg(sets[0][1], bn, ahead, per_sm), sms, "cuda")
                row["stream"][key] = B.graph_us([(lambda s=s: ln(*s)) for s in sets])
            except Exception as e:   # a configuration that does not compile is reported, not fatal
                row["stream"][key] = f"{type(e).__name__}: {str(e)[:200]}"
        del sets
        try:
            row["tinygemm_us"] = B.graph_us(B.tinygemm(1, N, K, 128, copies))
        except Exception as e:
            row["tinygemm_us"] = f"{type(e).__name__}: {e}"
        best = min((v for v in row["stream"].values() if isinstance(v, float)), default=float("nan"))
        row["best_stream_us"] = best
        res["bench"].append(row)
        tg = row["tinygemm_us"] if isinstance(row["tinygemm_us"], float) else float("nan")
        print(f"{N:6d}x{K:<6d} floor {floor_us:6.2f} table {row['table_us']:6.2f} ({floor_us / row['table_us']:.0%}) "
              f"stream {best:6.2f} ({floor_us / best:.0%}) tinygemm {tg:6.2f} | "
              + " ".join(f"{k}:{v:.2f}" if isinstance(v, float) else f"{k}:x" for k, v in row["stream"].items()),
              flush=True)
        torch.cuda.empty_cache()


#: kernel variants of the anatomy: 0 the kernel, 1 words read without arithmetic,
#: 3 x not staged, 4 no partial sums (every segment stored as a whole tile); 1, 3, 4 give wrong results
MODES = (0, 1, 3, 4)


def anatomy(cfgs, res, shapes):
    """The table's kernel, then each configuration in every mode of ``MODES``."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for N, K in shapes:
        op, _, sets, row = _problem(N, K, sms, res)
        floor_us = row["floor_us"]
        print(f"anatomy {N:6d}x{K:<6d} table {row['table_us']:.2f}", flush=True)
        res["anatomy"].append(row)
        for bn, ahead, per_sm in cfgs:
            row = dict(N=N, K=K, floor_us=floor_us, cfg=[bn, ahead, per_sm])
            for mode in MODES:
                try:
                    ln = S.Launcher(op, sets[0][1], _cfg(sets[0][1], bn, ahead, per_sm), sms, "cuda", mode=mode)
                    row[f"mode{mode}_us"] = B.graph_us([(lambda s=s: ln(*s)) for s in sets])
                except Exception as e:
                    row[f"mode{mode}_us"] = f"{type(e).__name__}: {str(e)[:160]}"
            res["anatomy"].append(row)
            print(f"anatomy {N:6d}x{K:<6d} {bn},{ahead},{per_sm} floor {floor_us:6.2f} | "
                  + " ".join(f"m{m}:{row[f'mode{m}_us']:.2f}" if isinstance(row[f"mode{m}_us"], float)
                             else f"m{m}:x" for m in MODES), flush=True)
        del sets
        torch.cuda.empty_cache()


def profile(cfg, N, K):
    """One launch of the stream kernel and one of the table's between cudaProfilerStart/Stop (ncu)."""
    op = B.gemv_op(1, N, K)
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    w = B.random_prepared(N, K, 4, 128, False)
    out = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    ln = S.Launcher(op, w, _cfg(w, *cfg), torch.cuda.get_device_properties(0).multi_processor_count, "cuda")
    table = Q.compile(op, torch_device("cuda", 0))
    for f in (lambda: ln(x, w, out), lambda: table(x, w, out)):
        f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def main():
    args = harness.parse_args(__doc__, lambda ap: (
        ap.add_argument("--phase", choices=("check", "bench", "both", "anatomy", "profile"), default="both"),
        ap.add_argument("--configs", nargs="+", default=None, help="block_n,units_ahead,programs_per_sm ..."),
        ap.add_argument("--shapes", nargs="+", default=None, help="NxK ..."),
        ap.add_argument("--check-configs", type=int, default=3, help="check the first N configurations")))
    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs else CONFIGS
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else BENCH_SHAPES
    if args.phase == "profile":
        return profile(cfgs[0], *shapes[0])
    res = harness.header(__doc__, B.copy_bandwidth_TBps(), check=[], bench=[], anatomy=[])
    fails = 0
    try:
        if args.phase in ("check", "both"):
            fails = check(cfgs[:args.check_configs], res)
        if args.phase in ("bench", "both"):
            bench(cfgs, res, shapes)
        if args.phase == "anatomy":
            anatomy(cfgs, res, shapes)
    finally:
        harness.write(res, args.out, "gemv-stream-probe", args.tag)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
