"""Shared by the benchmark commands: per-call times in eager loops and inside CUDA graphs, over input sets rotated
past the L2, and the device-to-device copy bandwidth that every floor divides by."""

from __future__ import annotations

import math
import statistics

import torch

L2_ROTATE = 4 * 64 * 2**20   # rotate over more than 4x the (60 MB) L2


def copies_for(nbytes: int) -> int:
    """Input sets of ``nbytes`` each to rotate over so that no call finds its inputs in the L2."""
    return max(2, math.ceil(L2_ROTATE / max(1, nbytes)))


def warm_on_side_stream(fns) -> None:
    """Call each of ``fns`` once on a fresh stream ordered after the current one (what
    ``torch.cuda.graph`` needs first: lazy initialisation and allocations happen outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)


def eager_us(fns, reps=None):
    """Median per-call microseconds of a Python loop of launches cycling over ``fns`` (5 rounds)."""
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
    """Device-to-device copy rate in TB/s, bytes read plus bytes written, of back-to-back eager 1 GiB copies."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    t = eager_us([lambda: b.copy_(a)], reps=10)
    return 2 * n / (t * 1e-6) / 1e12
