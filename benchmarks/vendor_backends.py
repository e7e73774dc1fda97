"""Vendor backends against portakern's own kernels on one GPU: each backend's time per shape and auto's choice.

For the attention shapes (prefill at head dims 64 and 128, causal and not; GQA decode, dense and paged) and the int4
GEMV shapes (M = 1 and 16; the symmetric bfloat16-scale format every backend here can run exactly), every registered
backend that runs on the GPU is asked through its own ``supports()``; each one that says yes is checked against the
cpu reference once (a wrong answer is recorded, never timed) and timed per call through the public API two ways:
eagerly (``us``: median of 5 rounds of CUDA-event timed loops, so a wrapper's host work counts) and replayed in a
CUDA graph (``graph_us``: the kernels alone; a backend whose call cannot be captured says why in ``graph_error``).
``auto`` is what ``explain()`` picks with no backend named; the result says, per shape, the fastest correct backend
and how far auto is from it, in the graph (``fastest_graph``, ``auto_over_fastest_graph``: what the dispatch tables
rank) and eagerly (``fastest``, ``auto_over_fastest``).

A GEMV row times a ring of prepared weights whose codes together exceed 4x the L2 (``timing.copies_for``), the
memory-bound case the dispatch tables measure; one weight called over and over stays in the L2 and ranks kernels
differently. ``--certified-by`` names gpu-tier conformance reports of this card: a backend with a failing or erroring
case there is still timed, but marked ``uncertified`` and never counted as the fastest correct backend nor printed as
a candidate (``auto`` may only rank a backend that passes the suite).

    python benchmarks/vendor_backends.py [--quick] [--out DIR] [--tag -x] [--certified-by REPORT.json ...]

Results: ``DIR/vendor-backends<TAG>-<card>.json``. A vendor that beats every portakern kernel on a shape class by
more than 3% is printed as a candidate row for its backend's ``tuning.RANK_OVER_OWN`` (the table stays data: a row
names this result file in its ``source``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import default_out, result_path, write  # noqa: E402  (benchmarks/ is the script's folder)
from timing import eager_us, graph_us  # noqa: E402

import portakern  # noqa: E402
from portakern.plugins import registry  # noqa: E402

OWN = ("triton", "cuda", "cpu", "opencl", "triton-rocm")
#: (name, B, Sq, Sk, Hq, Hkv, D, causal, page size or 0)
ATTENTION = [("prefill", 2, 2048, 2048, 16, 16, d, c, 0) for d in (64, 128) for c in (False, True)] + [
    ("decode", 8, 1, 8192, 32, 8, 128, False, 0), ("decode-paged", 8, 1, 8192, 32, 8, 128, False, 64)]
#: (M, N, K)
GEMV = [(m, n, k) for m in (1, 16) for n, k in ((4096, 4096), (11008, 4096), (4096, 11008))]


def _gpu_backends() -> list[str]:
    return sorted(n for n, b in registry().backends.items() if "cuda" in b.device_types)


def _attention_inputs(B, Sq, Sk, Hq, Hkv, D, ps, dev):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, Hq, D, generator=g).to(dev, torch.bfloat16)
    if not ps:
        k, v = (torch.randn(B, Sk, Hkv, D, generator=g).to(dev, torch.bfloat16) for _ in range(2))
        return (q, k, v), {}
    pages = B * Sk // ps
    k, v = (torch.randn(pages, ps, Hkv, D, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    table = torch.randperm(pages, generator=g).reshape(B, Sk // ps).to(dev, torch.int32)
    return (q, k, v), {"block_table": table, "seqlens_k": torch.full((B,), Sk, dtype=torch.int32, device=dev)}


def uncertified(reports: list[str], card: str) -> dict[str, str]:
    """{backend: why} for each backend with a failing or erroring case in the conformance ``reports`` (JSON) that
    ran on a GPU named ``card``. Raises ValueError naming the report when it ran on another device."""
    import collections
    import json

    failing: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in reports:
        rep = json.load(open(path))
        name = rep.get("device", {}).get("name")
        if name != card:
            raise ValueError(f"--certified-by {path}: that report ran on {name!r}, this GPU is {card!r}; pass a "
                             "gpu-tier report of this card (portakern conformance --tier gpu --report ...)")
        for r in rep.get("results", []):
            if r.get("status") in ("fail", "error"):
                failing[r["backend"]][os.path.basename(path)] += 1
    return {b: "failing case(s): " + ", ".join(f"{n} in {f}" for f, n in sorted(c.items()))
            for b, c in sorted(failing.items())}


def _row(fn, args, kw, shape, reference, tol, backends, graph_calls, rotate=(), bad=None) -> dict:
    """Time every backend that supports ``fn(*args, **kw)``; record refusals and wrong answers. ``rotate``: more
    argument tuples like ``args`` that the timed loops cycle through (a weight ring past the L2); ``bad``: the
    uncertified backends and why."""
    row = {"op": fn.__name__, "shape": shape, "backends": {}}
    bad = bad or {}

    def call(backend=None, a=args):
        return fn(*a, backend=backend, **kw)

    def calls(name):
        return [lambda a=a: call(backend=name, a=a) for a in (args, *rotate)]

    for name in backends:
        try:
            portakern.explain(fn, *args, backend=name, **kw)
        except portakern.UnsupportedError as e:
            row["backends"][name] = {"refused": str(e)[:300]}
            continue
        try:
            out = call(backend=name)
            err = (out.float().cpu().double() - reference).abs().max().item() / max(reference.abs().max().item(), 1e-30)
            if not err <= tol:
                row["backends"][name] = {"wrong": err}
                continue
            row["backends"][name] = {"us": eager_us(calls(name), reps=20), "rel_err": err}
        except Exception as e:  # a vendor failure is a result, not a crash of the benchmark
            row["backends"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        try:
            row["backends"][name]["graph_us"] = graph_us(calls(name), calls=graph_calls)
        except Exception as e:  # e.g. a host synchronisation inside the call: recorded, eager figure kept
            torch.cuda.synchronize()
            row["backends"][name]["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row["auto"] = portakern.explain(fn, *args, **kw).chosen
    return judge(row, bad)


def judge(row: dict, bad: dict[str, str]) -> dict:
    """Mark ``row``'s uncertified backends (``bad``: name -> why), then per timing (eager ``us``, ``graph_us``) name
    the fastest certified backend, auto's distance from it and, where a vendor beats every own kernel by more than
    3%, the candidate for its ``RANK_OVER_OWN``."""
    for name, why in bad.items():
        if name in row["backends"]:
            row["backends"][name]["uncertified"] = why
    for key, suffix in (("us", ""), ("graph_us", "_graph")):
        timed = {n: r[key] for n, r in row["backends"].items() if key in r and "uncertified" not in r}
        if not timed:
            continue
        best = min(timed, key=timed.get)
        row["fastest" + suffix] = best
        auto_us = timed.get(row["auto"])
        row["auto_over_fastest" + suffix] = None if auto_us is None else auto_us / timed[best] - 1
        own = [timed[n] for n in timed if n in OWN]
        if best not in OWN and own and timed[best] < 0.97 * min(own):
            row["candidate_rank_over_own" + suffix] = best
    return row


def _print(row: dict) -> None:
    """One line per shape: each backend's graph / eager us (or why not), and auto's choice."""
    def cell(r):
        if "us" not in r:
            return next(iter(r))
        mark = " (uncertified)" if "uncertified" in r else ""
        return (f"{r['graph_us']:.1f} / {r['us']:.1f}" if "graph_us" in r else f"- / {r['us']:.1f}") + mark
    print(row["shape"], {n: cell(r) for n, r in row["backends"].items()}, "auto:", row["auto"], flush=True)


def run(quick: bool, bad: dict | None = None) -> list[dict]:
    from timing import copies_for

    dev = f"cuda:{torch.cuda.current_device()}"
    backends, rows = _gpu_backends(), []
    for name, B, Sq, Sk, Hq, Hkv, D, causal, ps in ATTENTION[: 3 if quick else None]:
        args, kw = _attention_inputs(B, Sq, Sk, Hq, Hkv, D, ps, dev)
        kw["causal"] = causal
        ref = portakern.attention(*(a.float().cpu() for a in args), backend="cpu",
                                  **{k: v.cpu() if torch.is_tensor(v) else v for k, v in kw.items()})
        rows.append(_row(portakern.attention, args, kw, dict(kind=name, B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D,
                                                              causal=causal, page_size=ps), ref.double(), 3e-2,
                         backends, graph_calls=20, bad=bad))
        _print(rows[-1])
    for M, N, K in GEMV[: 2 if quick else None]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        ws = [portakern.quantize(torch.randn(N, K, generator=g), bits=4, group_size=128, symmetric=True,
                                 scale_dtype="bfloat16") for _ in range(copies_for(N * K // 2))]
        ref = x.double() @ torch.as_tensor(np.asarray(ws[0].dequantize(), dtype=np.float64)).T
        xd = x.to(dev)
        args = [(xd, w.to(dev)) for w in ws]
        rows.append(_row(portakern.quant_gemv, args[0], {},
                         dict(M=M, N=N, K=K, fmt="int4 sym g128 bf16 scales", weights=len(ws)), ref, 1.6e-2,
                         backends, graph_calls=200, rotate=args[1:], bad=bad))
        _print(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three attention and two GEMV shapes")
    ap.add_argument("--out", default=default_out(), help="folder for the result JSON (default: $OUT or "
                    "benchmarks/results)")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -quick)")
    ap.add_argument("--certified-by", nargs="+", default=[], metavar="REPORT",
                    help="gpu-tier conformance reports (JSON) of this card: a backend failing a case there is timed "
                         "but marked uncertified, never the fastest correct backend nor a RANK_OVER_OWN candidate")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("vendor_backends.py needs a CUDA device: it times kernels on the GPU")
    try:
        bad = uncertified(a.certified_by, torch.cuda.get_device_name(0))
    except (OSError, ValueError) as e:
        ap.error(str(e))
    rows = run(a.quick, bad)
    res = {"what": __doc__.splitlines()[0], "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": os.environ.get("PK_COMMIT", ""),
           "backends": {n: registry().backends[n].status() for n in _gpu_backends()},
           "certified_by": [os.path.basename(p) for p in a.certified_by], "uncertified": bad, "rows": rows}
    write(res, result_path(a.out, "vendor-backends", a.tag))
    for suffix, how in (("_graph", "in a CUDA graph"), ("", "eagerly")):
        worst = max((r.get("auto_over_fastest" + suffix) or 0.0 for r in rows), default=0.0)
        print(f"{how}: auto within {worst:.1%} of the fastest correct backend on every shape")
        for r in rows:
            if "candidate_rank_over_own" + suffix in r:
                print(f"RANK_OVER_OWN candidate ({how}):", r["candidate_rank_over_own" + suffix], r["op"], r["shape"])


if __name__ == "__main__":
    main()
