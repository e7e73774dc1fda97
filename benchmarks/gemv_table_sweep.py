"""The sweep that writes ``backends/cuda/tuning.py``: the cuda backend's small-M GEMV kernel
(``backends/cuda/kernels/gemv_small_m.cu``) over its launch variants, each checked against float64 and timed beside
the triton table and tinygemm; ``--phase write-table`` turns the sweeps' JSON into the table.

The kernel keeps one LOP3 and one FFMA per code and drops the rest: x staged once per CTA in shared memory, scaled
and in word-row order; scales and zeros once per group; 64-256-thread CTAs of ~64 registers, many per SM; split K
merged by the tile's last CTA to arrive, in slice order. Each variant is compiled by NVRTC and launched through the
driver API as a programmatic dependent, by the backend's own ``nvrtc.py`` and ``quant_gemv.defines``.

    python benchmarks/gemv_table_sweep.py --phase lower    # no GPU: every variant to sm_90a, registers, spills
    python benchmarks/gemv_table_sweep.py --phase check    # GPU: every variant against float64 (NaN-poisoned)
    python benchmarks/gemv_table_sweep.py --phase bench    # GPU: check, then time beside the table and tinygemm
    python benchmarks/gemv_table_sweep.py --phase bench --m 4                               # the same at M = 4
    python benchmarks/gemv_table_sweep.py --phase bench --deep-max-n 1000000 --tag -deep    # deep rings everywhere
    python benchmarks/gemv_table_sweep.py --phase write-table --from benchmarks/results/gemv-wide-sweep-h200.json
    python benchmarks/gemv_table_sweep.py --kernel frag --phase bench     # the kernel that reads the fragment layout

``--kernel frag`` sweeps the backend's second kernel (``kernels/gemv_frag.cu``, for weights prepared without words)
on the int4 table's six shapes, beside the word kernel at its table's choice, the triton table and tinygemm
(``gemv_cuda_frag.py``).

The bench times each variant in CUDA graphs over weights rotated past 4x the L2, in the same process as the
table's Triton kernel and tinygemm, and prints the best variant per shape against both and the floor. A problem's
entry ranks the cuda backend first where its best variant timed ``WIN_MARGIN`` x the triton table's time or less.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import default_out  # noqa: E402  (benchmarks/ is the script's folder)

#: (bits, N, K): the int4 table's six shapes, the decode step's other three (qkv, gate/up, lm_head) and the int8
#: target's three
SHAPES = ((4, 4096, 4096), (4, 14336, 4096), (4, 4096, 14336), (4, 8192, 8192), (4, 28672, 8192),
          (4, 16384, 16384), (4, 6144, 4096), (4, 28672, 4096), (4, 128256, 4096),
          (8, 8192, 8192), (8, 28672, 8192), (8, 16384, 16384))
QUADS = (16, 32)
LANES = {4: (2, 4, 8), 8: (4, 8, 16)}
PFS = (1, 2)
#: deeper rings for the shapes whose time is their ramp (N <= 6144: the qkv / o / down projections' shapes), PF up to
#: a slice's every group -- all of a CTA's words requested before its griddepcontrol.wait, so under programmatic
#: dependent launch they load while the kernel before it finishes; at most MAX_RING_ROWS word rows
#: (16-byte loads) in flight per thread, 4 registers each
DEEP_PFS = (4, 8)
DEEP_MAX_N = 6144
MAX_RING_ROWS = 32
SPLITS = (1, 2, 4, 7, 8, 14, 16, 32)
NUM_SMS = 132


def splits_for(N: int, K: int, quads: int) -> list[int]:
    """K slices worth timing for a tile width: whole groups per slice, 256-4096 CTAs (and S = 1 from one wave)."""
    tiles = N // (4 * quads)
    return [s for s in SPLITS if K % (128 * s) == 0 and (256 <= tiles * s <= 4096 or (s == 1 and tiles >= NUM_SMS))]


def shapes_for(M: int) -> tuple:
    """(bits, N, K) to sweep at M rows: every shape at M = 1, the int4 table's six above it."""
    return SHAPES if M == 1 else SHAPES[:6]


def variants(bits: int, N: int, K: int, M: int = 1,
             deep_max_n: int | None = None) -> list[tuple[int, int, int, int, int]]:
    """(QUADS, LANES, S, PF, LDNA) to time for one shape; LDNA (no-L1 loads with a 256-byte L2 hint) only on the
    PF >= 2, 4-lane variants; PF 4 and 8 (``DEEP_PFS``) on the shapes up to ``deep_max_n`` (default
    ``DEEP_MAX_N``) columns."""
    deep_max_n = DEEP_MAX_N if deep_max_n is None else deep_max_n
    out = []
    for q in QUADS:
        for lanes in LANES[bits]:
            rpg = 128 * bits // 32 // lanes            # word rows of one thread in one group
            deep = tuple(p for p in DEEP_PFS if rpg * p <= MAX_RING_ROWS) if N <= deep_max_n else ()
            for s in splits_for(N, K, q):
                for pf in PFS + deep:
                    if K // 128 // s >= pf and smem_bytes(bits, K, q, lanes, s, M) <= 100 * 1024:
                        out.append((q, lanes, s, pf, 0))
                        if pf >= 2 and lanes == LANES[bits][1]:
                            out.append((q, lanes, s, pf, 1))
    return out


def _op_cfg(M: int, bits: int, N: int, K: int, v: tuple):
    from gemv_problems import gemv_op

    from portakern.backends.cuda.quant_gemv import SmallMConfig

    return gemv_op(M, N, K, bits=bits), SmallMConfig(*v)


def smem_bytes(bits: int, K: int, quads: int, lanes: int, s: int, M: int = 1) -> int:
    from portakern.backends.cuda import quant_gemv as C

    return C.smem_bytes(*_op_cfg(M, bits, 128, K, (quads, lanes, s)))


def _compile(job, target: str = "sm_90a"):
    """(job, Compiled or None, log) for one (M, bits, N, K, variant): the backend's NVRTC path and ``-D``
    constants."""
    from portakern.backends.cuda.common import nvrtc
    from portakern.backends.cuda import quant_gemv as C
    from portakern.errors import BackendError

    M, bits, N, K, v = job
    op, cfg = _op_cfg(M, bits, N, K, v)
    try:
        c = nvrtc.compile_source(C.SOURCE, tuple(C.defines(op, cfg, True, None).items()), target)
        return job, c, c.log
    except BackendError as e:
        return job, None, str(e)


def compile_all(jobs, workers: int = 16) -> dict:
    """Every (M, bits, N, K, variant) compiled in parallel processes (before CUDA is initialised here)."""
    with ProcessPoolExecutor(workers) as ex:
        return {job: (compiled, log) for job, compiled, log in ex.map(_compile, jobs)}


class WideGemv:
    """``kern(x, w, out)``: x (1, K) bf16, ``w`` a ``PreparedGemvWeight`` (g128, fp16 scales, zeros), out (1, N)
    bf16, on the current CUDA stream of device 0, under variant ``v``; ``ws`` / ``counters`` the split-K workspace
    and the tiles' arrival counters (zeroed once; the last CTA of a tile resets its counter)."""

    def __init__(self, compiled, M, bits, N, K, v: tuple, ws, counters, pdl=True):
        from portakern.backends.cuda.common import nvrtc
        from portakern.backends.cuda import quant_gemv as C

        op, cfg = _op_cfg(M, bits, N, K, v)
        self.fn = nvrtc.Function(compiled, C.ENTRY, 0, C.smem_bytes(op, cfg), pdl)
        self.grid, self.threads = -(-N // cfg.columns) * cfg.splits, cfg.threads
        self.ws, self.counters = ws, counters

    def __call__(self, x, w, out) -> None:
        self.fn(self.grid, self.threads, w.qweight.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(),
                x.data_ptr(), out.data_ptr(), self.ws.data_ptr(), self.counters.data_ptr())


#: how much faster than the triton table (same process) a variant must time for the table to rank cuda first
WIN_MARGIN = 0.98


def write_table(paths: list[str], out: str | None = None, scope: str = "card") -> str:
    """``backends/cuda/tuning.py``'s ``TABLE`` rewritten from the ``gemv-wide-sweep*.json`` files ``paths``: per
    problem the fastest variant, whether it timed under ``WIN_MARGIN`` x the triton table's time in the same run, and
    the sweep file's name as its ``source`` (a later file's row replaces an earlier one's); keyed by the card that ran
    the sweep (``scope`` "card": ``"sm_90/h200"``, which serves that card only) or by its family (``"family"``:
    ``"sm_90"``, which serves every card of the family that has no entry of its own). The rest of the module (its
    docstring, ``GemvEntry``) is kept as it is. Returns the path written."""
    import json

    from portakern.backends.cuda import tuning as gemv_table
    from portakern.backends.cuda.quant_gemv import card
    from portakern.backends.cuda.tuning import GemvEntry

    if scope not in ("card", "family"):
        raise ValueError(f"scope={scope!r}: the table's entries are keyed by 'card' or 'family'")
    table = dict(gemv_table.TABLE)
    for path in paths:
        res = json.load(open(path))
        if "capability" not in res:
            raise ValueError(f"{path} records no GPU capability (written before --write-table existed); re-run the "
                             "sweep")
        key = "sm_{}{}".format(*res["capability"])
        if scope == "card":
            c = card(res.get("gpu", ""))
            if c is None:
                raise ValueError(f"{path}: no card in its GPU name {res.get('gpu')!r}; write it with scope 'family'")
            key = f"{key}/{c}"
        for r in res["bench"]:
            v = tuple(int(t) for t in r["best"].split(","))
            table[(key, r.get("M", 1), r["bits"], r["N"], r["K"])] = GemvEntry(
                *v, r["best_us"] <= WIN_MARGIN * r["table_us"], os.path.basename(path))
    src = open(gemv_table.__file__).read()
    start = src.index(TABLE_MARKER)
    decl = src[start:src.index("= {", start) + 3]          # the table's comment and annotated name, as they are
    lines = [f"    {k!r}: GemvEntry({', '.join(map(repr, v))})," for k, v in sorted(table.items())]
    path = out or gemv_table.__file__
    with open(path, "w") as f:
        f.write(src[:start] + decl + ("\n" + "\n".join(lines) + "\n" if lines else "") + "}\n")
    print(f"{path}: {len(table)} entries, {sum(v.beats_triton for v in table.values())} ahead of triton")
    return path


#: the comment line that opens ``TABLE`` in ``backends/cuda/tuning.py``: what ``write_table`` keeps before it
TABLE_MARKER = "#: (family or family/card, M, bits, N, K)"


def registers(log: str) -> dict:
    """ptxas' report in a compiler log: registers, spill stores / loads, static shared memory (None where absent)."""
    find = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else None   # noqa: E731
    return {"registers": find(r"Used (\d+) registers"), "spill_stores": find(r"(\d+) bytes spill stores"),
            "spill_loads": find(r"(\d+) bytes spill loads"), "smem": find(r"(\d+) bytes smem")}


def report(compiled, log: str) -> dict:
    """ptxas' report of a variant (``registers``); on a GPU machine whose driver's compute cache answered
    NVRTC (no report in the log), the registers and the stack frame (``frame_bytes``) the cubin records instead."""
    r = registers(log)
    if r["registers"] is None:
        r.update(registers=compiled.registers, frame_bytes=compiled.frame_bytes, from_cubin=True)
    return r


def lower(deep_max_n: int | None = None) -> int:
    jobs = [(M, b, N, K, v) for M in (1, 4) for b, N, K in shapes_for(M) for v in variants(b, N, K, M, deep_max_n)]
    bad = 0
    for (M, b, N, K, v), (compiled, log) in compile_all(jobs).items():
        r = report(compiled, log) if compiled else None
        bad += compiled is None or bool(r["spill_stores"] or r.get("frame_bytes"))
        print(f"M={M} int{b} {N}x{K} quads,lanes,S,PF,ldna={v}: {r if compiled else 'FAILED ' + log}")
    print(f"{len(jobs)} variants, {bad} failed or spilled")
    return 1 if bad else 0


def reference(x, w):
    """float64 ``x @ dequant(W)^T`` of a prepared weight, unpacked with torch on the weight's device: code e of
    word row j is column (j // IW) * IW * EPW + e * IW + j % IW of K (the internal layout)."""
    import torch

    bits, epw, iw, N, K = w.bits, 32 // w.bits, w.interleave, w.N, w.K
    qw = w.qweight[: K // epw, :N]
    codes = torch.stack([(qw >> (bits * e)) & ((1 << bits) - 1) for e in range(epw)], dim=1)   # (KW, EPW, N)
    codes = codes.view(K // epw // iw, iw, epw, N).permute(0, 2, 1, 3).reshape(K, N).double()
    g = torch.arange(K, device=qw.device) // w.group_size
    dq = (codes - w.zeros.double()[g, :N]) * w.scales.double()[g, :N]
    return (x.double() @ dq).cpu().numpy()


@functools.lru_cache(maxsize=None)
def _buffers(N: int, K: int, M: int = 1):
    import torch

    np_ = -(-N // 128) * 128                 # the words' row stride: the workspace's too
    return (torch.zeros(max(SPLITS) * M * np_, device="cuda", dtype=torch.float32),
            torch.zeros(N, device="cuda", dtype=torch.int32))


def run(phase: str, res, M: int = 1, shapes=None, save=lambda: None) -> int:
    """Check (and for ``phase`` "bench" time) every compiled variant of ``shapes`` (default ``shapes_for(M)``),
    calling ``save()`` after each shape so that a run stopped part-way keeps the shapes it finished."""
    import torch

    from gemv_peers import int8_torch, tinygemm
    from gemv_problems import floor_bytes, gemv_op, ours, random_prepared
    from harness import poisoned_errors
    from timing import copies_for, graph_us

    cubins = res.pop("_cubins")
    jobs = list(cubins)
    bad = 0
    for bits, N, K in shapes or shapes_for(M):
        ws, counters = _buffers(N, K, M)
        w = random_prepared(N, K, bits, 128, False)
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = reference(x, w)
        kerns = {}
        mine = [j for j in jobs if j[:4] == (M, bits, N, K)]
        for job in mine:
            compiled, log = cubins[job]
            v = job[4]
            row = {"M": M, "bits": bits, "N": N, "K": K, "variant": v,
                   **(report(compiled, log) if compiled else {"error": log})}
            if compiled is not None:
                counters.zero_()             # a wrong variant must not leave the next one a stale count
                kern = WideGemv(compiled, M, bits, N, K, v, ws, counters)
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                errs = poisoned_errors(lambda: kern(x, w, out), out, ref, times=3)
                row.update(rel_err=errs, ok=max(errs) <= 1e-2)
                if row["ok"]:
                    kerns[v] = kern
            bad += not row.get("ok", False)
            res["check"].append(row)
        print(f"M={M} int{bits} {N}x{K}: {len(kerns)}/{len(mine)} variants correct",
              flush=True)
        if phase != "bench" or not kerns:
            save()
            continue
        op = gemv_op(M, N, K, bits=bits)
        fb = floor_bytes(op)
        copies = copies_for(fb)
        row = {"M": M, "bits": bits, "N": N, "K": K, "floor_us": fb / (res["copy_TBps"] * 1e12) * 1e6}
        table_fns, _ = ours(op, None, copies)
        row["table_us"] = graph_us(table_fns)
        del table_fns
        if bits == 4:
            row["tinygemm_us"] = graph_us(tinygemm(M, N, K, 128, copies_for(N * K // 2)))
        else:
            row["torch_int8_us"] = graph_us(int8_torch(M, N, K, copies_for(N * K)))
        wss = [random_prepared(N, K, bits, 128, False) for _ in range(copies)]
        xs = [torch.randn(M, K, device="cuda").to(torch.bfloat16) for _ in range(copies)]
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        row["wide_us"] = {}
        for v, kern in kerns.items():
            row["wide_us"][",".join(map(str, v))] = graph_us([lambda x=x, w=w: kern(x, w, out)
                                                              for x, w in zip(xs, wss)])
        best = min(row["wide_us"], key=row["wide_us"].get)
        row["best"], row["best_us"] = best, row["wide_us"][best]
        res["bench"].append(row)
        peer = row.get("tinygemm_us", row.get("torch_int8_us"))
        print(f"M={M} int{bits} {N}x{K}: floor {row['floor_us']:.2f} table {row['table_us']:.2f} "
              f"({row['floor_us'] / row['table_us']:.0%}) wide {row['best_us']:.2f} "
              f"({row['floor_us'] / row['best_us']:.0%}, {best}) peer {peer:.2f} "
              f"-> {peer / row['best_us']:.2f}x", flush=True)
        del wss, xs
        torch.cuda.empty_cache()
        save()
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("\n\n") + 2:])
    ap.add_argument("--phase", choices=("lower", "check", "bench", "write-table"), required=True,
                    help="lower: every variant to sm_90a, no GPU; check: every variant against float64; bench: "
                         "check, then time beside the triton table and tinygemm; write-table: rewrite "
                         "backends/cuda/tuning.py from --from")
    ap.add_argument("--out", default=default_out(),
                    help="folder of the result gemv-wide-<sweep|check>[-m<M>]<TAG>-<card>.json (default $OUT or "
                         "benchmarks/results)")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -deep)")
    ap.add_argument("--from", dest="sources", nargs="+", default=[], metavar="JSON",
                    help="--phase write-table: the gemv-wide-sweep JSON files to take the table from")
    ap.add_argument("--table-scope", choices=("card", "family"), default="card",
                    help="--phase write-table: key the entries by the card that ran the sweep (default; they "
                         "serve that card only) or by its family (they serve every card of the family without "
                         "entries of its own)")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="BITSxNxK",
                    help="only these of the sweep's shapes, e.g. 4x4096x4096 4x6144x4096 (default: all)")
    ap.add_argument("--deep-max-n", type=int, default=DEEP_MAX_N, metavar="N",
                    help=f"sweep the deep rings (PF {'/'.join(map(str, DEEP_PFS))}) on shapes of at most N "
                         f"columns (default {DEEP_MAX_N}: the N = 4096 / 6144 shapes; 1000000: every shape)")
    ap.add_argument("--m", type=int, default=1, choices=(1, 2, 3, 4),
                    help="rows of x (M > 1: the int4 table's six shapes; the results file is named -m<M>)")
    ap.add_argument("--kernel", choices=("words", "frag"), default="words",
                    help="words: the word-layout kernel (gemv_small_m.cu, the table's); frag: the kernel that reads "
                         "the fragment layout (gemv_frag.cu) on the int4 table's six shapes, timed beside the word "
                         "kernel, the triton table and tinygemm (gemv-cuda-frag-sweep[-m<M>]-<card>.json)")

    args = ap.parse_args()
    if args.deep_max_n < 1:
        raise SystemExit(f"--deep-max-n {args.deep_max_n}: must be a positive column count (e.g. 6144, or 1000000 "
                         "for every shape)")
    if args.phase == "lower" and args.kernel == "words":
        return lower(args.deep_max_n)
    if args.phase == "write-table" and args.kernel == "words":
        if not args.sources:
            raise SystemExit("--phase write-table needs --from JSON [JSON ...] (gemv-wide-sweep files)")
        write_table(args.sources, scope=args.table_scope)
        return 0
    M = args.m
    shapes = shapes_for(M) if args.kernel == "words" else SHAPES[:6]
    if args.kernel == "frag" and args.phase == "write-table":
        raise SystemExit("--kernel frag --phase write-table: not automated; tuning.FRAG_TABLE takes a sweep's 'best' "
                         "per shape where it beat 'translated_us' by more than 2% (tests/test_cuda_frag.py checks "
                         "each entry against its file); use --phase lower, check or bench")
    if args.shapes:
        try:
            wanted = {tuple(int(t) for t in sh.split("x")) for sh in args.shapes}
        except ValueError:
            raise SystemExit(f"--shapes {' '.join(args.shapes)}: each must be BITSxNxK, e.g. 4x4096x4096") from None
        if not wanted <= set(shapes):
            raise SystemExit(f"--shapes {sorted(wanted - set(shapes))}: not among the sweep's (bits, N, K) at M={M}: "
                             f"{', '.join('x'.join(map(str, s)) for s in shapes)}")
        shapes = tuple(s for s in shapes if s in wanted)
    if args.kernel == "frag":
        return _frag_main(args, M, shapes)
    jobs = [(M, b, N, K, v) for b, N, K in shapes for v in variants(b, N, K, M, args.deep_max_n)]
    cubins = compile_all(jobs)           # before CUDA is initialised in this process (forked workers)
    import torch

    from harness import header, result_path, write
    from timing import copy_bandwidth_TBps

    torch.cuda.init()
    torch.empty(1, device="cuda")        # the primary context current on this thread (the driver API uses it)
    res = header(__doc__, copy_bandwidth_TBps(), check=[], bench=[])
    res["capability"] = list(torch.cuda.get_device_capability(0))
    res["_cubins"] = cubins
    name = {"check": "gemv-wide-check", "bench": "gemv-wide-sweep"}[args.phase] + (f"-m{M}" if M > 1 else "")
    path = result_path(args.out, name, args.tag)
    bad = run(args.phase, res, M, shapes, save=lambda: write(res, path))
    write(res, path)
    print(f"{len(res['check']) - bad}/{len(res['check'])} correct")
    for r in res["bench"]:
        peer = r.get("tinygemm_us", r.get("torch_int8_us"))
        print(f"| M={r['M']} int{r['bits']} {r['N']}x{r['K']} | {r['floor_us']:.2f} | {r['table_us']:.2f} "
              f"({r['floor_us'] / r['table_us']:.0%}) | {r['best_us']:.2f} ({r['floor_us'] / r['best_us']:.0%}) "
              f"| {r['best']} | {peer / r['best_us']:.2f}x |")
    return 1 if bad else 0


def _frag_main(args, M: int, shapes) -> int:
    """``--kernel frag``: lower (no GPU), check or bench the fragment kernel's variants (``gemv_cuda_frag``)."""
    import gemv_cuda_frag as F

    if args.phase == "lower":
        return F.lower(M, shapes)
    cubins = F.compile_all([(M, N, K, v) for _, N, K in shapes for v in F.frag_variants(N, K, M)])
    import torch

    from harness import header, result_path, write
    from timing import copy_bandwidth_TBps

    torch.cuda.init()
    torch.empty(1, device="cuda")        # the primary context current on this thread (the driver API uses it)
    res = header(F.__doc__, copy_bandwidth_TBps(), check=[], bench=[])
    res["capability"] = list(torch.cuda.get_device_capability(0))
    res["_cubins"] = cubins
    name = "gemv-cuda-frag-" + ("sweep" if args.phase == "bench" else "check") + (f"-m{M}" if M > 1 else "")
    path = result_path(args.out, name, args.tag)
    bad = F.run(res, M, shapes, save=lambda: write(res, path), time=args.phase == "bench")
    write(res, path)
    print(f"{len(res['check']) - bad}/{len(res['check'])} fragment variants correct")
    F.summary(res)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
