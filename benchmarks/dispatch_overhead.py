"""Python dispatch overhead of ``portakern.attention`` / ``portakern.quant_gemv`` per call.

For a tiny problem, a repeated call through the public API (after the first call has planned and
compiled it) is timed against the very kernel that plan holds. The overhead is what portakern adds
around the kernel: signature, plan lookup, conversions, output allocation, result wrapping.

* ``overhead_us``: per API call, wall time minus the time spent inside the kernel during those same
  calls (the cached kernel is wrapped with a timer). Immune to the kernel's own speed drifting
  between rounds, which on a loaded or small machine swamps a difference of two medians.
* ``api_minus_direct_us``: median API call minus median direct call of the same kernel on arrays
  already converted to the backend's array kind, with preallocated outputs (for reference).
* ``*_min_us``: the same from the fastest round, the intrinsic cost with the least interference
  from other processes (medians are what a loaded machine sees).

Two kinds of kernel:

* ``real``: the backend dispatch picks (``cpu`` for numpy / torch-CPU inputs, the best GPU backend
  on cuda).
* ``null``: a registered backend whose kernels do nothing (numpy and torch array kinds): the API
  call *is* the overhead, with no kernel around it.

Usage::

    python benchmarks/dispatch_overhead.py [--calls 50] [--rounds 200] [--out benchmarks/results]

Writes ``benchmarks/results/dispatch-overhead-<card>.json`` (``-cpu`` without a GPU) and prints a table.
Target: <= 15 us.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import card_of, result_path  # noqa: E402  (benchmarks/ is the script's folder)

import portakern  # noqa: E402
from portakern import Backend, dispatch, hookimpl, plugins  # noqa: E402
from portakern.arrays import convert_for_backend, empty  # noqa: E402
from portakern.backend import YES  # noqa: E402
from portakern.conformance.report import run_identity  # noqa: E402
from portakern.devices import CPU  # noqa: E402

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

class KernelTimer:
    """Wraps a plan's kernel and adds up the time spent inside it."""

    def __init__(self, kernel):
        self.kernel, self.ns = kernel, 0

    def __call__(self, *args):
        t0 = time.perf_counter_ns()
        self.kernel(*args)
        self.ns += time.perf_counter_ns() - t0


def _round(fn, calls: int, sync) -> float:
    """Nanoseconds for ``calls`` calls of ``fn`` (device work synchronised at the end)."""
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    sync()
    return time.perf_counter_ns() - t0


def measure(api_call, direct_call, plan, calls: int, rounds: int, sync=lambda: None) -> dict:
    """Interleaved rounds of ``calls`` API calls and ``calls`` direct kernel calls.

    ``overhead_us`` is measured *inside* the API rounds: per-call wall time minus the time spent
    in the kernel during those same calls (the plan's kernel is wrapped with a timer), so drift in
    the kernel's own speed (caches, frequency, other load) does not leak into the figure.
    ``api_minus_direct_us`` is the plain difference of the two medians, for reference.
    """
    for _ in range(max(3, rounds // 20)):  # warm up both paths
        api_call(), direct_call()
    sync()
    timer = plan.kernel = KernelTimer(plan.kernel)
    api, inside, direct = [], [], []
    try:
        for _ in range(rounds):
            timer.ns = 0
            api.append(_round(api_call, calls, sync) / calls / 1e3)
            inside.append(api[-1] - timer.ns / calls / 1e3)
            direct.append(_round(direct_call, calls, sync) / calls / 1e3)
    finally:
        plan.kernel = timer.kernel
    med = statistics.median
    return {"overhead_us": round(med(inside), 2), "overhead_min_us": round(min(inside), 2),
            "api_us": round(med(api), 2), "direct_us": round(med(direct), 2),
            "api_minus_direct_us": round(med(api) - med(direct), 2),
            "api_minus_direct_min_us": round(min(api) - min(direct), 2),
            "overhead_p10_p90_us": [round(x, 2) for x in statistics.quantiles(inside, n=10)[::8]]}


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
    q, k, v = mk(1, 1, 1, 64), mk(1, 16, 1, 64), mk(1, 16, 1, 64)  # B=1 Sq=1 Sk=16 H=1 D=64

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

    return api, direct, plan, be.name, str(dev)


def quant_gemv_case(lib: str, device: str, backend: str | None, rng) -> tuple:
    mk = _arrays(lib, device, rng)
    w = portakern.quantize(mk(64, 128), bits=4, group_size=32)  # N=64 K=128
    x = mk(1, 128)

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

    return api, direct, plan, be.name, str(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed round (default 50)")
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds per path (default 200)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="result folder")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -quiet)")
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

    def bench(op_name, case, lib, device, kernel_kind, backend):
        api, direct, plan, be, dev = case(lib, device, backend, rng)
        r = measure(api, direct, plan, args.calls, args.rounds, sync[device])
        rows.append({"op": op_name, "inputs": f"{lib} {device}", "kernel": kernel_kind, "backend": be,
                     "device": dev, **r})
        print(f"{op_name:10s} {lib:5s} {device:4s} {kernel_kind:4s} {be:12s} api {r['api_us']:8.2f} us  "
              f"direct {r['direct_us']:8.2f} us  api-direct {r['api_minus_direct_us']:6.2f} us  "
              f"overhead {r['overhead_us']:6.2f} us (min {r['overhead_min_us']:5.2f})", flush=True)

    cases = (("attention", attention_case), ("quant_gemv", quant_gemv_case))
    for op_name, case in cases:  # real kernels: the backend dispatch picks, as for an application
        for lib, device in setups:
            bench(op_name, case, lib, device, "real", None)
    plugins.register(NullPlugin(), name="dispatch-overhead-null")
    try:
        for op_name, case in cases:
            for lib, device in setups:
                bench(op_name, case, lib, device, "null", f"null-{lib}")
    finally:
        plugins.unregister("dispatch-overhead-null")

    worst = max(r["overhead_us"] for r in rows)
    result = {"benchmark": "dispatch_overhead", "tag": args.tag, "date": datetime.date.today().isoformat(),
              "portakern": portakern.__version__, "python": sys.version.split()[0],
              "numpy": np.__version__, "torch": _torch_version(), "machine": platform.machine(),
              "processor": platform.processor(), "calls_per_round": args.calls, "rounds": args.rounds,
              "target_us": TARGET_US, "worst_overhead_us": worst, "meets_target": worst <= TARGET_US,
              "results": rows, "identity": run_identity(CPU)}
    path = Path(result_path(args.out, "dispatch-overhead", args.tag, card=_card(setups)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"worst overhead {worst:.2f} us (target <= {TARGET_US} us) -> {path}")
    return 0


def _card(setups) -> str:
    """The GPU the run measured (``h200``, ...), or ``cpu`` where it measured none."""
    if ("torch", "cuda") not in setups:
        return "cpu"
    import torch

    return card_of(torch.cuda.get_device_name(0))


def _torch_version() -> str | None:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
