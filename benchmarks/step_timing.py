"""Timing and comparing decode steps (``benchmarks/decode_step.py``): warm-up, CUDA-graph capture, the median of
timed replays, per-kernel device time under the profiler, and how far two steps' logits are apart. A step is any
callable that enqueues its kernels on the current stream."""

from __future__ import annotations

import math
import statistics

import torch


def warm(step, runs: int = 3):
    """Run ``step`` a few times on a side stream (compiles, allocator pools) before timing or capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(runs):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def capture(step):
    """``step`` captured in a CUDA graph (after ``warm``), replayed once."""
    warm(step)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_step(step, graph: bool, reps=20):
    if graph:
        fn = capture(step).replay
    else:
        warm(step)
        fn = step
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def logits_diff(ref, other) -> dict:
    """How far the logits ``other`` are from ``ref`` (fp32 copies of bf16 logits): the largest difference, the
    scale of the logits, one bf16 unit in the last place at the logit of the largest difference, how many differ,
    whether both are finite."""
    d = (other - ref).abs()
    worst = ref.flatten()[d.argmax()].abs().item()
    return {"logits_max_abs_diff": d.max().item(), "logits_max_abs": ref.abs().max().item(),
            "logits_ulp_at_max_diff": 2.0 ** (math.floor(math.log2(max(worst, 1e-30))) - 7),
            "logits_differing": int((other != ref).sum().item()),
            "logits_finite": bool(torch.isfinite(ref).all() & torch.isfinite(other).all())}


def kernel_profile(step, replays: int = 3):
    """Per-kernel device time of the step replayed in its CUDA graph (torch.profiler / CUPTI): one row
    per kernel name with calls and microseconds per replay, largest total first. Durations only; the
    gaps between kernels are what the graph time adds on top of their sum."""
    from torch.profiler import ProfilerActivity, profile

    g = capture(step)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        r = rows.setdefault(ev.name, [0, 0.0])
        r[0] += 1
        r[1] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
    out = [{"name": n, "calls": c // replays, "us_total": t / replays, "us_mean": t / max(c, 1)}
           for n, (c, t) in rows.items()]
    return sorted(out, key=lambda r: -r["us_total"])


def exposed_times(intervals) -> dict:
    """Attribute a replay's span to its kernels when they overlap (programmatic dependent launches start a kernel
    before the one it waits for has ended, so durations double-count). ``intervals``: ``(name, start, end)`` of
    every kernel of one replay, any order, microseconds. Taken in order of their ends, kernel i is charged the part
    of ``(end_{i-1}, end_i]`` during which some kernel ran -- the time by which it moved the finish line -- and the
    rest of that stretch, when nothing ran, is idle. Charges and idle add up to the span.

    Returns ``{"span_us", "idle_us", "kernels": [{"name", "calls", "us_duration", "us_exposed"}, ...]}``, largest
    exposed time first."""
    spans = sorted((s, e) for _, s, e in intervals)
    union: list[list[float]] = []
    for s, e in spans:                       # the union of the intervals, as disjoint sorted segments
        if union and s <= union[-1][1]:
            union[-1][1] = max(union[-1][1], e)
        else:
            union.append([s, e])

    def covered(lo: float, hi: float) -> float:
        return sum(max(0.0, min(hi, e) - max(lo, s)) for s, e in union if e > lo and s < hi)

    rows: dict[str, list] = {}
    idle, prev_end = 0.0, None
    for name, start, end in sorted(intervals, key=lambda t: (t[2], t[1])):
        lo = spans[0][0] if prev_end is None else prev_end   # the first to finish: from the replay's first start
        busy = covered(lo, end) if end > lo else 0.0
        idle += max(0.0, end - lo) - busy
        r = rows.setdefault(name, [0, 0.0, 0.0])
        r[0] += 1
        r[1] += end - start
        r[2] += busy
        prev_end = end if prev_end is None else max(prev_end, end)
    kernels = [{"name": n, "calls": c, "us_duration": d, "us_exposed": x} for n, (c, d, x) in rows.items()]
    return {"span_us": 0.0 if not spans else prev_end - spans[0][0], "idle_us": idle,
            "kernels": sorted(kernels, key=lambda k: -k["us_exposed"])}


def kernel_timeline(step) -> dict:
    """``exposed_times`` of one replay of ``step``'s CUDA graph under the profiler (CUPTI kernel records)."""
    from torch.profiler import ProfilerActivity, profile

    g = capture(step)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    spans = [(ev.name, ev.time_range.start, ev.time_range.end) for ev in prof.events()
             if ev.device_type == torch.autograd.DeviceType.CUDA]
    return exposed_times(spans)
