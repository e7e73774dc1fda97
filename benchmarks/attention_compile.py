"""Compiling ``benchmarks/attention.py``'s kernels up front, in a pool of spawned processes (Triton's disk cache then
serves the timing process): the sweep's and the table's configurations, or every attention case of a conformance
tier."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import torch

from portakern.backends.triton.attention import forward as A
from portakern.backends.triton.attention.config import AttnConfig
from portakern.devices import torch_device


def _warm(job):
    """Worker: compile one (op, config) by launching it once on random inputs (fills Triton's cache)."""
    op_json, cfg_json = job
    from portakern.ir.ops import op_from_json

    op, cfg = op_from_json(op_json), AttnConfig(**cfg_json)
    dev = torch_device("cuda", 0)
    t = time.time()
    try:
        q, k, v, out, lse, aux = A.random_inputs(op, torch.device("cuda"))
        A.build(op, dev, cfg)(q, k, v, out, lse, aux)
        torch.cuda.synchronize()
        return None, time.time() - t
    except Exception as e:  # reported, the config is dropped
        return f"{type(e).__name__}: {str(e)[:300]}", time.time() - t


def _warm_case(args):
    """Worker: run one conformance case on triton once, so its kernel lands in Triton's disk cache."""
    case_id, tier = args
    from portakern.conformance.cases import by_id
    from portakern.conformance.execute import _call, build_op, place
    from portakern.plugins import registry

    be, dev = registry().get("triton"), torch_device("cuda", 0)
    try:
        case = by_id(case_id, tier)
        arrays = place(case, case.inputs(), be, dev)
        if be.supports(build_op(case, arrays), dev):
            _call(case, arrays, None, "triton")
            torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{case_id}: {type(e).__name__}: {str(e)[:200]}"


def warm_conformance(tier, workers):
    """Every attention case of the conformance ``tier`` run once on triton in ``workers`` processes."""
    from portakern.conformance.runner import collect_cases

    ids = [c.id for c in collect_cases(tier) if c.kind == "attention"]
    t = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        errs = [e for e in ex.map(_warm_case, [(i, tier) for i in ids], chunksize=4) if e]
    print(f"warmed {len(ids)} conformance cases ({tier} tier) in {time.time() - t:.1f}s; {len(errs)} errors", flush=True)
    for e in errs[:10]:
        print("  ", e, flush=True)


def precompile(jobs, workers):
    """Every distinct ``(op JSON, config JSON)`` compiled in ``workers`` processes; ``{job JSON: error}`` of the
    failures (their configurations are dropped from the sweep)."""
    uniq = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    if not uniq:
        return {}
    t = time.time()
    errors = {}
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(workers, len(uniq)), mp_context=ctx) as ex:
        for j, (err, _) in zip(uniq, ex.map(_warm, uniq)):
            if err:
                errors[json.dumps(j, sort_keys=True)] = err
    print(f"precompiled {len(uniq)} kernels in {time.time() - t:.1f}s with {workers} workers; "
          f"{len(errors)} failed", flush=True)
    for k, e in list(errors.items())[:5]:
        print("  compile error:", k[:200], e, flush=True)
    return errors
