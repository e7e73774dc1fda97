"""Python dispatch overhead of ``portakern.attention`` / ``portakern.quant_gemv`` per call.

For a tiny problem, time a repeated call through the public API (after the first call has planned
and compiled it) against calling the very kernel that plan holds, directly, on arrays already
converted to the backend's array kind with preallocated outputs. The difference of the medians is
what portakern adds to a call: signature, plan lookup, conversions, output allocation, result
wrapping. Two kinds of kernel are measured:

* ``real``: the backend dispatch picks (``cpu`` for numpy / torch-CPU inputs, the best GPU backend
  on cuda); the kernel's own time is in both figures and cancels.
* ``null``: a registered backend whose kernels do nothing, so the API figure *is* the overhead
  with no kernel noise around it (numpy and torch array kinds).

Usage::

    python benchmarks/dispatch_overhead.py [--calls 50] [--rounds 200] [--out benchmarks/results]

Writes ``benchmarks/results/dispatch-overhead-<date>.json`` and prints a table. Target: <= 15 us.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import portakern
from portakern import Backend, dispatch, hookimpl, plugins
from portakern.arrays import convert_for_backend, empty
from portakern.backend import YES
from portakern.ir.dtypes import DType

TARGET_US = 15.0


# -- a backend whose kernels do nothing (measures dispatch alone) -------------------------------------

class _Null(Backend):
    version = "0"
    device_types = ("cpu", "cuda")
    priority = 10_000

    def supports(self, op, device):
        return YES

    def compile(self, op, device):
        return _nothing


class NullNumpy(_Null):
    name = "null-numpy"
    array_kind = "numpy"


class NullTorch(_Null):
    name = "null-torch"
    array_kind = "torch"


def _nothing(*args):
    return None


class NullPlugin:
    @hookimpl
    def portakern_register_backends(self):
        return [NullNumpy(), NullTorch()]


# -- timing ------------------------------------------------------------------------------------------

def _per_call_us(fn, calls: int, sync) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def measure(api_call, direct_call, calls: int, rounds: int, sync=lambda: None) -> dict:
    """Interleaved rounds of ``calls`` calls each; medians of the per-call microseconds."""
    for _ in range(max(3, rounds // 20)):  # warm up both paths
        api_call(), direct_call()
    sync()
    api, direct = [], []
    for _ in range(rounds):
        api.append(_per_call_us(api_call, calls, sync))
        direct.append(_per_call_us(direct_call, calls, sync))
    a, d = statistics.median(api), statistics.median(direct)
    return {"api_us": round(a, 2), "direct_us": round(d, 2), "overhead_us": round(a - d, 2),
            "api_p10_p90_us": [round(x, 2) for x in statistics.quantiles(api, n=10)[::8]],
            "direct_p10_p90_us": [round(x, 2) for x in statistics.quantiles(direct, n=10)[::8]]}


def _cached_plan(op_kind: str):
    """The plan dispatch cached for the call just made (the newest entry of that op)."""
    plans = [p for k, p in dispatch._plans.items() if k[0] == op_kind]
    return plans[-1]


# -- cases -------------------------------------------------------------------------------------------

def _arrays(lib: str, device: str, rng):
    def mk(*shape):
        a = rng.standard_normal(shape).astype(np.float32)
        if lib == "numpy":
            return a
        import torch

        return torch.from_numpy(a).to(device)
    return mk


def attention_case(lib: str, device: str, backend: str | None, rng) -> tuple:
    mk = _arrays(lib, device, rng)
    q, k, v = mk(1, 1, 1, 16), mk(1, 16, 1, 16), mk(1, 16, 1, 16)  # B=1 Sq=1 Sk=16 H=1 D=16

    def api():
        return portakern.attention(q, k, v, backend=backend)

    api()
    plan = _cached_plan("attention")
    be, dev, op = plan.backend, plan.decision.device, plan.decision.op
    qb, kb, vb = (convert_for_backend(a, be, dev) for a in (q, k, v))
    out = empty(be.array_kind, op.shapes()["out"], op.dtype, dev)
    aux = {"block_table": None, "seqlens_k": None, "cu_seqlens_q": None, "cu_seqlens_k": None}
    kernel = plan.kernel

    def direct():
        return kernel(qb, kb, vb, out, None, aux)

    return api, direct, be.name, str(dev)


def quant_gemv_case(lib: str, device: str, backend: str | None, rng) -> tuple:
    mk = _arrays(lib, device, rng)
    w = portakern.quantize(mk(32, 64), bits=4, group_size=32)  # N=32 K=64
    x = mk(1, 64)

    def api():
        return portakern.quant_gemv(x, w, backend=backend)

    api()
    plan = _cached_plan("quant_gemv")
    be, dev, op = plan.backend, plan.decision.device, plan.decision.op
    prepared = w.prepared[(be.name, str(dev))]
    xb = convert_for_backend(x, be, dev)
    out = empty(be.array_kind, (op.M, op.N), op.result_dtype, dev)
    kernel = plan.kernel

    def direct():
        return kernel(xb, prepared, out)

    return api, direct, be.name, str(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed round (default 50)")
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds per path (default 200)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="result folder")
    args = ap.parse_args(argv)

    setups = [("numpy", "cpu"), ("torch", "cpu")]
    sync = {"cpu": lambda: None}
    try:
        import torch

        if torch.cuda.is_available():
            setups.append(("torch", "cuda"))
            sync["cuda"] = torch.cuda.synchronize
    except ImportError:
        setups = [s for s in setups if s[0] == "numpy"]

    rng = np.random.default_rng(0)
    rows = []
    plugins.register(NullPlugin(), name="dispatch-overhead-null")
    try:
        for op_name, case in (("attention", attention_case), ("quant_gemv", quant_gemv_case)):
            for lib, device in setups:
                for kernel_kind in ("real", "null"):
                    null = {"numpy": "null-numpy", "torch": "null-torch"}[lib]
                    backend = null if kernel_kind == "null" else None
                    if kernel_kind == "real":  # let dispatch pick, as an application would, minus the null backend
                        backend = _best_real(op_name, lib, device, rng)
                    api, direct, be, dev = case(lib, device, backend, rng)
                    r = measure(api, direct, args.calls, args.rounds, sync[device])
                    rows.append({"op": op_name, "inputs": f"{lib} {device}", "kernel": kernel_kind,
                                 "backend": be, "device": dev, **r})
                    print(f"{op_name:10s} {lib:5s} {device:4s} {kernel_kind:4s} {be:12s} "
                          f"api {r['api_us']:8.2f} us  direct {r['direct_us']:8.2f} us  "
                          f"overhead {r['overhead_us']:6.2f} us", flush=True)
    finally:
        plugins.unregister("dispatch-overhead-null")

    worst = max(r["overhead_us"] for r in rows)
    result = {"benchmark": "dispatch_overhead", "date": datetime.date.today().isoformat(),
              "portakern": portakern.__version__, "python": sys.version.split()[0],
              "numpy": np.__version__, "torch": _torch_version(), "machine": platform.machine(),
              "processor": platform.processor(), "calls_per_round": args.calls, "rounds": args.rounds,
              "target_us": TARGET_US, "worst_overhead_us": worst, "meets_target": worst <= TARGET_US,
              "results": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"dispatch-overhead-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"worst overhead {worst:.2f} us (target <= {TARGET_US} us) -> {path}")
    return 0


def _best_real(op_name: str, lib: str, device: str, rng) -> str:
    """The backend dispatch would pick for this problem if the null backend were not registered."""
    return "cpu" if device == "cpu" else _gpu_choice(op_name)


def _gpu_choice(op_name: str) -> str | None:
    ranked = [b for b in portakern.backends() if not b.name.startswith("null-") and "cuda" in b.device_types
              and b.status().startswith("ok")]
    ranked.sort(key=lambda b: -b.priority)
    return ranked[0].name if ranked else None


def _torch_version() -> str | None:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
