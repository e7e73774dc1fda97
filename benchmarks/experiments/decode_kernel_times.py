"""Where the fixed cost of split-KV decode goes: per-kernel device time of ``attn_fwd`` and
``attn_combine`` replayed in a CUDA graph, next to the graph's per-call time (experiment, GPU only).

B=1 decode (32 query / 8 KV heads, D=128, bf16) at the table configuration with programmatic
dependent launch off (with it on, the merge kernel starts early and its recorded duration includes
its wait). The graph holds one call per input set, sets rotated over more than 4x the L2 as in
``benchmarks/attention.py``. Per kernel: mean duration over the replays (torch.profiler / CUPTI);
the graph's per-call time minus the two durations is what launches and gaps between kernels cost.

    python benchmarks/experiments/decode_kernel_times.py [--lengths 2048 8192 32768] [--paged 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention as AB  # noqa: E402  (benchmarks/attention.py)
from step_timing import kernel_profile  # noqa: E402  (benchmarks/step_timing.py)

from portakern.backends.triton import attention as A  # noqa: E402
from portakern.devices import torch_device  # noqa: E402


def kernel_times(op, dev, cfg, l2: int, replays: int = 10) -> dict:
    """Graph per-call microseconds and mean device microseconds per kernel name."""
    kv_bytes = 2 * op.batch * op.seqlen_k * op.heads_kv * op.head_dim * 2
    sets = [A.random_inputs(op, torch.device("cuda"), seed=i) for i in range(AB.n_sets(kv_bytes, l2))]
    fns = AB.ours(op, dev, cfg, sets)
    per_call = AB.graph_ms(fns) * 1e3
    rows = kernel_profile(lambda: [f() for f in fns], replays)
    return {"graph_us_per_call": per_call, "floor_us": kv_bytes / AB.copy_bandwidth() * 1e6,
            "kernels_us": {r["name"]: r["us_mean"] for r in rows}, "config": cfg.to_json()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--paged", type=int, default=64, help="also the paged layout with this page size (0: no)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    dev = torch_device("cuda", 0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for page in (0, args.paged) if args.paged else (0,):
        for L in args.lengths:
            op = AB.decode(1, L, page)
            cfg = replace(AB.table_config(op, dev), pdl=False)
            r = {"B": 1, "L": L, "page": page, **kernel_times(op, dev, cfg, l2)}
            rows.append(r)
            ks = " ".join(f"{n}={t:.2f}" for n, t in r["kernels_us"].items())
            print(f"L={L:6d} page={page:3d} graph {r['graph_us_per_call']:6.2f} us  floor {r['floor_us']:6.2f}  "
                  f"{ks}  (splits {cfg.num_splits}, BN {cfg.block_n})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode-kernel-times.json")
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    print(path)


if __name__ == "__main__":
    main()
