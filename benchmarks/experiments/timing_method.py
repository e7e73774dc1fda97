"""What a benchmark's per-call time in a CUDA graph charges to the call (experiment, GPU only).

``benchmarks/attention.py`` times a graph holding one call per input set (at most 8 sets, rotated past 4x
the L2) with ``triton.testing.do_bench``, which zeroes a 256 MB buffer before each replay, and divides by
the calls. That figure carries ``1 / len(sets)`` of two costs of the replay, not of the call: the graph's
own launch, and what the zeroing leaves behind for the first reads (dirty L2 lines to write back, up to the
L2's size, presumably). Session 13's decode anatomy showed the first: an empty kernel on split decode's grid "took" 1.30
us per call in a graph of 8 calls and 2.90 us in a graph of 2. This measures, per workload:

* ``per_replay_us`` -- the benchmarks' figure (graph of ``len(sets)`` calls, time / calls);
* ``graph_ms_us``   -- ``benchmarks/attention.py``'s ``graph_ms`` since session 13 (a graph of ~4 ms);
* ``slope_us``      -- graphs of ``n1`` and ``n2`` calls cycling over the same sets, ``(t2 - t1) / (n2 - n1)``:
  what one more call costs in a long graph (a decode step holds 32 attention calls and 129 GEMVs);

for an empty kernel, B=1 decode (portakern's table, cuDNN SDPA, the anatomy's read-only walks over the
table's grid with the head-interleaved and with contiguous rows), and the device copy both ways (its
bandwidth is the floors' denominator).

    python benchmarks/experiments/timing_method.py [--lengths 8192 32768 131072] [--out DIR] [--tag T]
"""

from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def replay_us(fns, calls: int) -> float:
    """Median microseconds of one replay of a graph of ``calls`` calls cycling over ``fns`` (do_bench: L2
    zeroed before each)."""
    import attention as AB  # noqa: E402  (benchmarks/attention.py)
    from cuda_graphs import warm_on_side_stream  # noqa: E402  (benchmarks/cuda_graphs.py)

    warm_on_side_stream(fns)
    g = AB.capture(fns, calls)
    return do_bench(g.replay, warmup=10, rep=150, return_mode="median") * 1e3


def methods(fns, n1: int | None = None, n2: int | None = None) -> dict:
    """The benchmarks' per-call figure and the slope between graphs of ``n1`` and ``n2`` calls."""
    k = len(fns)
    n1 = n1 or k * -(-8 // k)     # the smallest multiple of the sets holding 8 calls
    n2 = n2 or 4 * n1
    t0, t1, t2 = replay_us(fns, k), replay_us(fns, n1), replay_us(fns, n2)
    return {"sets": k, "per_replay_us": t0 / k, "n1": n1, "n2": n2, "t1_us": t1, "t2_us": t2,
            "slope_us": (t2 - t1) / (n2 - n1), "intercept_us": t1 - n1 * (t2 - t1) / (n2 - n1)}


def copy_rates(graph_ms, nbytes: int = 1 << 30) -> dict:
    """The device copy's rate (bytes read + written) by do_bench on one copy (the benchmarks' method
    before session 13), by the slope and by ``graph_ms`` (both in graphs, where the copy is a memcpy
    node: 2.7 TB/s on the H200 in session 13), and eagerly back to back (``copy_bandwidth`` since); TB/s."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fns = [lambda: dst.copy_(src)]
    m = methods(fns, n1=2, n2=6)
    m.update(do_bench_TBps=2 * nbytes / do_bench(fns[0], warmup=20, rep=80, return_mode="median") / 1e9,
             slope_TBps=2 * nbytes / m["slope_us"] / 1e6, graph_ms_TBps=2 * nbytes / graph_ms(fns) / 1e9)
    return m



def main() -> None:
    import harness as Hs

    def extra(ap):
        ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])

    args = Hs.parse_args(__doc__, extra)
    import attention as AB  # noqa: E402  (benchmarks/attention.py)
    from decode_anatomy import HKV, b1_decode, walk_fns  # noqa: E402
    from read_floor import empty_kernel  # noqa: E402

    from portakern.devices import torch_device

    dev = torch_device("cuda", 0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cr = copy_rates(AB.graph_ms)
    cr["eager_TBps"] = AB.copy_bandwidth() / 1e12
    bw_bench, bw_eager = cr["do_bench_TBps"] * 1e12, cr["eager_TBps"] * 1e12
    res = Hs.header(__doc__, cr["eager_TBps"], rows=[], copy=cr)
    print(f"copy: do_bench {cr['do_bench_TBps']:.3f} TB/s, eager back to back {cr['eager_TBps']:.3f}, in graphs: "
          f"slope {cr['slope_TBps']:.3f}, graph_ms {cr['graph_ms_TBps']:.3f}", flush=True)
    sink = torch.empty(1 << 12, device="cuda")
    em = methods([lambda: empty_kernel[(128,)](sink, PDL=True, launch_pdl=True)] * 8)
    res["empty"] = em
    print(f"empty kernel: per replay {em['per_replay_us']:.2f} us, slope {em['slope_us']:.2f}, "
          f"intercept {em['intercept_us']:.2f}", flush=True)
    for L in args.lengths:
        op, cfg, kv_bytes, sets = b1_decode(L, dev, l2)
        wsink = torch.empty(cfg.num_splits * HKV, device="cuda")
        work = {"table": AB.ours(op, dev, cfg, sets), "cudnn": AB.sdpa_fns(op, sets, "cudnn"),
                "read": walk_fns(sets, wsink, cfg, 0), "read_contiguous": walk_fns(sets, wsink, cfg, 2)}
        floors = {"copy_do_bench": kv_bytes / bw_bench * 1e6, "copy_eager": kv_bytes / bw_eager * 1e6}
        row = {"L": L, "config": cfg.to_json(), "floor_us": floors}
        for name, fns in work.items():
            row[name] = methods(fns)
            m = row[name]
            m["graph_ms_us"] = AB.graph_ms(fns) * 1e3
            print(f"L={L:6d} {name:16s} per replay {m['per_replay_us']:7.2f} us  slope {m['slope_us']:7.2f}  "
                  f"intercept {m['intercept_us']:6.2f}  graph_ms {m['graph_ms_us']:7.2f}  ({m['sets']} sets; "
                  f"floor {floors['copy_do_bench']:.2f} / "
                  f"{floors['copy_eager']:.2f})", flush=True)
        res["rows"].append(row)
        del sets, work
    Hs.write(res, args.out, "timing-method", args.tag)


if __name__ == "__main__":
    main()
