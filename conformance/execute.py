"""Run one case on one backend and judge it: place inputs, ask ``supports()``, call, compare.

Inputs go where the backend would receive them from a user: numpy arrays for a numpy backend on
the CPU, torch tensors on ``cuda:N`` for a device, CPU torch tensors for a torch backend on the CPU
(Triton's interpreter), pyopencl arrays on ``opencl:N`` (on portakern's cached queue of that device).
bfloat16 needs torch (numpy has no bfloat16); pyopencl arrays cannot hold it, so bfloat16 cases on an
OpenCL device are reported unsupported with that reason (``--device cpu --backend opencl`` runs them from
CPU torch tensors, which the backend carries as float32). The call goes through the
public API with ``backend=NAME`` (no fallback) inside ``poison_outputs()``, so every output starts
as NaN and an element a kernel forgets to write fails the case.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from portakern.backend import Support
from portakern.errors import PortakernError, UnsupportedError

from . import tolerance as T
from .report import Record


class CannotPlace(Exception):
    """The inputs of a case cannot be built for this backend/device (reported as unsupported)."""


def _torch():
    try:
        import torch
    except Exception as e:  # pragma: no cover - torch is in the [test] extra
        raise CannotPlace(f"this case needs torch to build its inputs ({type(e).__name__}: {e}); "
                          "pip install torch") from None
    return torch


def place(case, inputs: dict[str, np.ndarray], backend, device) -> dict[str, Any]:
    """Convert a case's numpy inputs to the arrays a user of ``backend`` on ``device`` would pass."""
    if device.type == "opencl":
        return _place_opencl(case, inputs, backend, device)
    if device.type not in ("cpu", "cuda", "rocm"):
        raise CannotPlace(f"the conformance runner cannot place inputs on {device.type} devices yet")
    use_torch = device.type != "cpu" or backend.array_kind == "torch" or case.dtype == "bfloat16"
    float_names = ("q", "k", "v", "x")
    if not use_torch:
        np_dt = {"float16": np.float16, "float32": np.float32}[case.dtype]
        return {n: (a.astype(np_dt) if n in float_names else a) for n, a in inputs.items()}
    torch = _torch()
    where = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    tdt = getattr(torch, case.dtype)
    out = {}
    for n, a in inputs.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        out[n] = t.to(device=where, dtype=tdt) if n in float_names else t.to(where)
    return out


def _place_opencl(case, inputs: dict[str, np.ndarray], backend, device) -> dict[str, Any]:
    """pyopencl arrays on ``device``'s cached queue (what a user of an OpenCL device passes). A bfloat16 case
    cannot be placed (no bf16 pyopencl dtype): reported unsupported with the backend's own ``supports()`` reason
    for the case's op when it refuses it, else with the placement reason."""
    if case.dtype == "bfloat16":
        s = supports(backend, static_op(case), device)
        if not s.ok:
            raise CannotPlace(s.reason)
        raise CannotPlace("pyopencl arrays have no bfloat16 dtype, so a bfloat16 case cannot be placed on an "
                          "OpenCL device; run it with --device cpu (CPU torch bf16 tensors)")
    try:
        import pyopencl.array as cla

        from portakern.opencl_runtime import queue
    except Exception as e:
        raise CannotPlace(f"placing inputs on {device} needs pyopencl ({type(e).__name__}: {e}); "
                          "pip install 'portakern[opencl]'") from None
    qu = queue(device)
    np_dt = {"float16": np.float16, "float32": np.float32}[case.dtype]
    return {n: cla.to_device(qu, np.ascontiguousarray(a.astype(np_dt) if n in ("q", "k", "v", "x") else a))
            for n, a in inputs.items()}


def weight_for(case, inputs: dict[str, np.ndarray], device, as_torch: bool):
    """The case's ``QuantizedWeight``, its tensors numpy on the CPU, torch on a CUDA/ROCm ``device``, pyopencl
    on an OpenCL one."""
    w = case.weight(inputs)
    if device.type == "opencl":
        return w.to(str(device))
    if not as_torch:
        return w
    torch = _torch()
    where = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    return w.with_tensors({k: torch.from_numpy(np.ascontiguousarray(v)).to(where) for k, v in w.tensors.items()})


def build_op(case, arrays: dict[str, Any], weight=None):
    """The IR node dispatch would build for these arrays (the op ``supports()`` is asked about)."""
    from portakern.validate import attention_op, quant_gemv_op

    if case.kind == "attention":
        aux = {k: v for k, v in arrays.items() if k not in ("q", "k", "v")}
        return attention_op(arrays["q"], arrays["k"], arrays["v"], **case.kwargs(), **aux)[0]
    return quant_gemv_op(arrays["x"], weight, **case.kwargs())[0]


def static_op(case):
    """The op of ``case`` in its storage dtype, from placeholders (no data, no torch needed)."""
    from portakern.ir.dtypes import DType

    ph = case.placeholders()
    weight = case.weight(ph) if case.kind == "quant_gemv" else None
    return build_op(case, ph, weight).replace(dtype=DType(case.dtype))


def _call(case, arrays, weight, name: str):
    import portakern

    if case.kind == "attention":
        aux = {k: v for k, v in arrays.items() if k not in ("q", "k", "v")}
        r = portakern.attention(arrays["q"], arrays["k"], arrays["v"], backend=name, **case.kwargs(), **aux)
        return r if case.return_lse else (r, None)
    return portakern.quant_gemv(arrays["x"], weight, backend=name, **case.kwargs()), None


def _host(a) -> np.ndarray | None:
    from portakern.arrays import to_numpy

    return None if a is None else np.asarray(to_numpy(a), dtype=np.float32)


def _sync(device) -> None:
    if device.type == "opencl":
        from portakern.opencl_runtime import queue

        queue(device).finish()
    elif device.type in ("cuda", "rocm"):
        import torch

        torch.cuda.synchronize(device.index)


def supports(backend, op, device) -> Support:
    from portakern.backend import support_of

    try:
        return support_of(backend, op, device)
    except Exception as e:
        return Support(False, f"supports() raised {type(e).__name__}: {e}")


def run_case(case, inputs: dict, golden, backend, device, repeat: int = 1) -> Record:
    """Run ``case`` on ``backend`` at ``device`` ``repeat`` times and return its record.

    ``golden`` is the case's ``Golden`` or a zero-argument function returning it (called only
    when the backend supports the case, so unsupported cases never cost a reference run).
    """
    from portakern.dispatch import poison_outputs

    rec = Record(case=case.id, op=case.kind, dtype=case.dtype, backend=backend.name, device=str(device),
                 status="error")
    try:
        arrays = place(case, inputs, backend, device)
        as_torch = any(type(a).__module__.startswith("torch") for a in arrays.values())
        weight = weight_for(case, inputs, device, as_torch) if case.kind == "quant_gemv" else None
        op = build_op(case, arrays, weight)
    except CannotPlace as e:
        rec.status, rec.reason = "unsupported", str(e)
        return rec
    except Exception as e:
        rec.reason = f"building the inputs failed: {type(e).__name__}: {e}"
        return rec
    s = supports(backend, op, device)
    if not s.ok:
        rec.status, rec.reason = "unsupported", s.reason or "supports() said no without a reason"
        return rec
    outs, times = [], []
    try:
        with poison_outputs():
            for _ in range(max(1, repeat)):
                t0 = time.perf_counter()
                out, lse = _call(case, arrays, weight, backend.name)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
                outs.append((_host(out), _host(lse)))
    except UnsupportedError as e:
        rec.status, rec.reason = "unsupported", f"supports() said yes but the call raised: {e}"
        return rec
    except PortakernError as e:
        rec.reason = f"{type(e).__name__}: {e}"
        return rec
    except Exception as e:
        rec.reason = f"the call raised {type(e).__name__}: {e}"
        return rec
    rec.time_ms = float(np.median(times[1:] if len(times) > 1 else times))
    if len(times) > 1:
        rec.extra["first_call_ms"] = times[0]
    try:
        gold = golden() if callable(golden) else golden
    except Exception as e:
        rec.reason = f"the golden is unavailable: {type(e).__name__}: {e}"
        return rec
    try:
        return judge(rec, case, gold, outs)
    except Exception as e:       # a tolerance rule or comparison that cannot handle this case: its record, not the run
        rec.status, rec.reason = "error", f"judging the outputs failed: {type(e).__name__}: {e}"
        return rec


def judge(rec: Record, case, golden, outs: list) -> Record:
    """Fill ``rec`` from the outputs of every repeat compared with ``golden``: the first failing repeat's verdict,
    else the largest error (output, LSE, nmse) over all repeats, so a margin is never the best repeat's."""
    rule = T.rule(case.kind, case.dtype)
    tol = T.bound(case.kind, case.dtype, golden.naive_err, golden.gold_max)
    rec.tolerance = tol
    worst = None
    for out, lse in outs:
        v = T.compare(out, golden.out, tol, rule.nmse, "out")
        if v.ok and golden.lse is not None:
            lt = T.bound("attention.lse", case.dtype, golden.naive_lse_err, golden.lse_max)
            lv = T.compare(lse, golden.lse, lt, None, "lse") if lse is not None else \
                T.Verdict(False, float("inf"), lt, "lse was not returned")
            rec.extra["lse_err"] = max(lv.max_abs_err, rec.extra.get("lse_err", lv.max_abs_err))
            rec.extra["lse_tolerance"] = lt
            if not lv.ok:
                v = T.Verdict(False, v.max_abs_err, tol, lv.reason, v.nmse)
        if v.nmse is not None:
            rec.extra["nmse"] = max(v.nmse, rec.extra.get("nmse", v.nmse))
        if worst is None or not v.ok or v.max_abs_err > worst.max_abs_err:
            worst = v
        if not v.ok:
            break
    rec.max_abs_err = worst.max_abs_err
    if not worst.ok:
        rec.status, rec.reason = "fail", worst.reason
        return rec
    rec.status = "pass"
    first = outs[0]
    for i, (out, lse) in enumerate(outs[1:], 2):
        if not _same(first[0], out) or not _same(first[1], lse):
            rec.status = "nondeterministic"
            rec.reason = f"repeat {i} differs bitwise from repeat 1 (every repeat is within tolerance)"
            break
    return rec


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
