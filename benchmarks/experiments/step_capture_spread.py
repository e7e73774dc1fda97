"""Experiment: is the decode step's two-level spread a property of each captured graph or of the time it runs?

Session 17 saw portakern's Llama-3-8B-shaped step (``benchmarks/decode_step.py``), captured afresh several times in
one process, run at one of two levels ~0.04 ms apart (2.23 vs 2.27 ms at ctx 2048), while the plain-PyTorch peers'
captures agreed within 0.02 ms. This script captures the same step ``--graphs`` times, keeping every graph alive, and
replays them round-robin for ``--rounds`` rounds (median of ``--reps`` replays per turn):

* if each graph keeps its level in every round, the level belongs to the capture -- to where its activations landed
  (each capture allocates its own from its private pool); the addresses of the first layer's activations (RMSNorm
  output, attention output, SiLU-mul output) are recorded per graph to compare;
* if every graph moves together between rounds, it is the machine's state over time.

    python benchmarks/experiments/step_capture_spread.py [--ctx 2048] [--graphs 6] [--rounds 4] [--reps 20]
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def recorded_step(step, seen: dict):
    """``step`` with its first layer's activations' addresses written to ``seen`` on every call."""
    rms, attend, silu = step.add_rmsnorm, step.attend, step.silu_mul
    calls = {"rms": 0}

    def add_rmsnorm(*a):
        r, xn = rms(*a)
        if calls["rms"] == 0:
            seen["rmsnorm_out"] = xn.data_ptr()
        calls["rms"] += 1
        return r, xn

    def attend_rec(i, q):
        o = attend(i, q)
        if i == 0:
            seen["attention_out"] = o.data_ptr()
        return o

    def silu_rec(gu):
        a = silu(gu)
        seen.setdefault("silu_out", a.data_ptr())
        return a

    step.add_rmsnorm, step.attend, step.silu_mul = add_rmsnorm, attend_rec, silu_rec
    return calls


def main() -> int:
    import torch

    from decode_step import DEFAULT_GLUE, PortakernStep
    from step_timing import warm
    from experiments.harness import header, parse_args, write
    from gemv import copy_bandwidth_TBps

    def extra(ap):
        ap.add_argument("--ctx", type=int, default=2048)
        ap.add_argument("--graphs", type=int, default=6)
        ap.add_argument("--rounds", type=int, default=4)
        ap.add_argument("--reps", type=int, default=20)

    args = parse_args(__doc__, extra)
    res = header(__doc__, copy_bandwidth_TBps(), graphs=[])
    step = PortakernStep(args.ctx, DEFAULT_GLUE, "portakern")
    step()
    torch.cuda.synchronize()
    graphs = []
    seen: dict = {}
    calls = recorded_step(step, seen)
    for g in range(args.graphs):
        warm(step)
        calls["rms"] = 0
        seen.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        graphs.append(graph)
        res["graphs"].append({"addresses": dict(seen), "ms": []})
        print(f"graph {g}: " + ", ".join(f"{k} {v:#x}" for k, v in seen.items()), flush=True)
    for r in range(args.rounds):
        for g, graph in enumerate(graphs):
            ts = []
            for _ in range(args.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1))
            res["graphs"][g]["ms"].append(statistics.median(ts))
        print(f"round {r}: " + " ".join(f"{res['graphs'][g]['ms'][-1]:.4f}" for g in range(len(graphs))), flush=True)
    write(res, args.out, "step-capture-spread", args.tag)
    print("graph  " + " ".join(f"round{r:<3}" for r in range(args.rounds)))
    for g, row in enumerate(res["graphs"]):
        print(f"{g:5d}  " + " ".join(f"{t:.4f}  " for t in row["ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
