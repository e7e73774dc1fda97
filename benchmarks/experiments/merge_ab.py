"""Which split-K merge is faster: the last slice to arrive (``MERGE = 0``, the tables') or the grid's last slice
(``MERGE = 1``)? One run, one process, CUDA graph.

Both are real kernels and add the partials in slice order, so they must write the same bits. ``MERGE = 0``: every
slice publishes its partial, counts itself with an acquire-release atomic and reads the count back; the one that
reads ``SPLIT_K - 1`` adds. ``MERGE = 1``: slices ``0 .. SPLIT_K - 2`` publish and count themselves with a release
reduction and leave at once (no round trip for the count); slice ``SPLIT_K - 1``, which the GPU dispatches after every
other slice of the grid, polls the count, adds the published partials and its own. The session-21 anatomy put the
"frag" kernel's merge at 2.1-3.3 us of 7.8-21 (M = 4 / 16, N * K <= 2^26) and session 10's put the CUDA-core
kernel's at 1.3-3.8 us (M = 1, N = 4096 and 8192^2).

For each case the table's configuration (when it splits K and its kind has the switch: "frag", "fma"), checked bit
for bit against the other merge on a NaN-poisoned output (three launches each: the counts must return to zero), then
both timed as ``benchmarks/gemv.py`` times a GEMV (graph of back-to-back calls, buffers rotated past 4x the L2), in
alternating rounds.

    python benchmarks/experiments/merge_ab.py [--rounds 2] [--out DIR] [--tag T]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

#: (bits, M, N, K): the M = 1 shapes the CUDA-core kernel serves on sm_90 (N < STREAM_MIN_N, int8), the "frag" rows
CASES = [(4, 1, 4096, 4096), (4, 1, 4096, 14336), (8, 1, 8192, 8192), (8, 1, 28672, 8192), (8, 1, 4096, 4096),
         (4, 4, 4096, 4096), (4, 4, 14336, 4096), (4, 4, 4096, 14336), (4, 4, 8192, 8192),
         (4, 16, 4096, 4096), (4, 16, 14336, 4096), (4, 16, 4096, 14336), (4, 16, 8192, 8192)]
#: kinds whose kernels take the ``MERGE`` constexpr
KINDS = ("fma", "frag")


def with_merge(kern, merge: int):
    """A copy of ``kern``'s (built) launcher that launches with ``MERGE = merge``: ``f(x, w, out)``."""
    import copy

    from portakern.backends.triton.launch import KernelLaunch

    ln = copy.copy(next(iter(kern.launchers.values())))
    if ln.kind not in KINDS or "MERGE" not in ln.consts:
        raise ValueError(f"kind {ln.kind!r} has no MERGE switch (kinds with one: {', '.join(KINDS)})")
    ln.consts = {**ln.consts, "MERGE": merge}
    ln.launch = KernelLaunch(ln.fn, ln.grid, ln.consts, ln.opts, False)
    return ln


def same_bits(a, b, xwo) -> bool:
    """Whether launchers ``a`` and ``b`` write the same, finite bits on the operands ``xwo`` (NaN-poisoned output,
    three launches each, so a count left mid-way by either shows)."""
    import torch

    x, w, out = xwo
    outs = []
    for f in (a, b):
        for _ in range(3):
            out.fill_(float("nan"))
            f(x, w, out)
        torch.cuda.synchronize()
        outs.append(out.clone())
    return bool(torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))) and bool(outs[0].isfinite().all())


def bench(args) -> int:
    import torch

    import gemv as GB  # benchmarks/gemv.py
    import harness as H

    bw = GB.copy_bandwidth_TBps()
    res = H.header(__doc__, bw, rows=[])
    print(f"copy {bw:.3f} TB/s\n{'b':>2} {'M':>2} {'shape':>12} {'kind':>5} {'split':>5} {'floor':>6} "
          f"{'merge0':>7} {'merge1':>7} {'gain':>6} equal", flush=True)
    bad = 0
    for bits, M, N, K in CASES:
        op = GB.gemv_op(M, N, K, bits=bits)
        copies = GB.copies_for(GB.floor_bytes(op))
        row = {"bits": bits, "M": M, "N": N, "K": K, "floor_us": GB.floor_bytes(op) / (bw * 1e12) * 1e6}
        try:
            fns, kern = GB.ours(op, None, copies)
            fns[0]()                 # the first call builds the launcher (the kernel's introspection holds it)
            torch.cuda.synchronize()
            ln = next(iter(kern.launchers.values()))
            row["cfg"] = ln.cfg.to_json()
            if ln.kind not in KINDS or ln.cfg.split_k == 1:
                row["skipped"] = f"kind {ln.kind}, split_k {ln.cfg.split_k}: no merge to compare"
            else:
                sets = [f.__defaults__[0] for f in fns]          # (x, w, out) of each rotated set
                m = {v: with_merge(kern, v) for v in (0, 1)}
                row["bit_equal"] = same_bits(m[0], m[1], sets[0])
                bad += not row["bit_equal"]
                for v in (0, 1):
                    row[f"merge{v}_us"] = []
                for _ in range(args.rounds):
                    for v in (0, 1):
                        row[f"merge{v}_us"].append(GB.graph_us([(lambda s=s, f=m[v]: f(*s)) for s in sets]))
                del fns, sets
        except Exception as e:       # recorded; the other cases go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            bad += 1
        torch.cuda.empty_cache()
        res["rows"].append(row)
        cfg = row.get("cfg", {})
        if "merge0_us" in row:
            a, b = min(row["merge0_us"]), min(row["merge1_us"])
            print(f"{bits:>2} {M:>2} {N:>6}x{K:<5} {cfg['kind']:>5} {cfg['split_k']:>5} {row['floor_us']:6.2f} "
                  f"{a:7.2f} {b:7.2f} {a - b:6.2f} {row['bit_equal']}", flush=True)
        else:
            print(f"{bits:>2} {M:>2} {N:>6}x{K:<5} {row.get('skipped') or row.get('error')}", flush=True)
    H.write(res, args.out, "merge-ab", args.tag)
    return 1 if bad else 0


if __name__ == "__main__":
    import harness as H

    args = H.parse_args(__doc__, lambda ap: ap.add_argument("--rounds", type=int, default=2,
                                                          help="alternating timing rounds (default 2)"))
    sys.exit(bench(args))
