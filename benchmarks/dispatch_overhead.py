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

A growing decode loop (``growing``): ``--steps`` calls of one decode attention (B=1, Sq=1, Hq=8, Hkv=2, D=64)
whose key length grows by one each call (from 16), on fresh contiguous k/v arrays each step as a cache grown by
concatenation makes them; its ``overhead_us`` (per call, wall time minus time inside kernels, compiles counted) is
set against the same loop repeating one length (the middle one) in interleaved rounds. A call that only changes
a sequence length reuses its shape class's plan (``portakern.lengths``); goal: growing within
``GROWING_GOAL_RATIO`` (1.2x) of repeated.

Usage::

    python benchmarks/dispatch_overhead.py [--calls 50] [--rounds 200] [--steps 512] [--growing-rounds 10]
                                          [--out benchmarks/results]

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
GROWING_GOAL_RATIO = 1.2


# -- a backend whose kernels do nothing (measures dispatch alone) -------------------------------------

class _Null(Backend):
    version = "0"
    device_types = ("cpu", "cuda")
    priority = 10_000
    runtime_lengths = True  # nothing to specialise

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


class KernelClock:
    """Adds up the time spent inside every kernel of one plan, including kernels ``bind`` compiles for further
    lengths (for a backend without ``runtime_lengths``): the plan's kernel is wrapped, and so is each kernel the
    backend's ``compile`` returns while the clock is installed. Compile time itself is not subtracted."""

    def __init__(self, plan):
        self.plan, self.ns = plan, 0
        self.kernel, be = plan.kernel, plan.backend
        self.compile = be.__dict__.get("compile")
        orig = be.compile
        be.compile = lambda op, device: self.wrap(orig(op, device))
        plan.kernel, plan.last, plan.bound = self.wrap(self.kernel), None, None

    def wrap(self, kernel):
        def timed(*args):
            t0 = time.perf_counter_ns()
            kernel(*args)
            self.ns += time.perf_counter_ns() - t0
        return timed

    def remove(self):
        be = self.plan.backend
        if self.compile is None:
            del be.compile
        else:
            be.compile = self.compile
        self.plan.kernel, self.plan.last, self.plan.bound = self.kernel, None, None


def growing_case(lib: str, device: str, backend: str | None, rng, steps: int, rounds: int, chunk: int = 32) -> dict:
    """A decode loop of ``steps`` calls whose key length grows by one each call, against the same loop repeating
    its middle length, and against calls at that one length on ``chunk`` distinct arrays in turn (``fresh``: what
    reading new memory each call costs outside the kernel, with no length changing). Each pass is timed in chunks of ``chunk`` consecutive calls, a growing chunk and a repeated
    one in turn (short interleaved samples, as for the repeated-shape rows, so other load on the machine hits both
    alike); the figures are medians over every chunk of ``rounds`` passes. Returns the row's figures."""
    mk = _arrays(lib, device, rng)
    q, cache = mk(1, 1, 8, 64), mk(2, 1, 16 + steps, 2, 64)
    copy = (lambda a: a.copy()) if lib == "numpy" else (lambda a: a.clone().contiguous())  # fresh memory each step
    grown = [(copy(cache[0, :, :L]), copy(cache[1, :, :L])) for L in range(16, 16 + steps)]
    middle = [grown[steps // 2]] * chunk
    fresh = [tuple(copy(a) for a in grown[steps // 2]) for _ in range(chunk)]
    made = dispatch.cache_info()["plans_made"]
    portakern.attention(q, *grown[0], backend=backend)
    plan = _cached_plan("attention")
    clock = KernelClock(plan)
    sync = torch_sync(device)

    inside: dict[str, list] = {"grow": [], "rep": []}   # microseconds per call inside the kernel (host side on a GPU)

    def timed(pairs, into: str | None = None) -> float:
        """Microseconds per call outside kernels (compiles included) for ``pairs``."""
        clock.ns = 0
        t0 = time.perf_counter_ns()
        for k, v in pairs:
            portakern.attention(q, k, v, backend=backend)
        sync()
        if into is not None:
            inside[into].append(clock.ns / len(pairs) / 1e3)
        return (time.perf_counter_ns() - t0 - clock.ns) / len(pairs) / 1e3

    first = timed(grown)  # the first pass: every length new (compiles of a per-length backend included)
    grow, rep, new = [], [], []
    try:
        for _ in range(rounds):
            for i in range(0, steps, chunk):
                grow.append(timed(grown[i:i + chunk], "grow"))
                rep.append(timed(middle, "rep"))
                new.append(timed(fresh))
    finally:
        clock.remove()
    med = statistics.median
    info = dispatch.cache_info()
    return {"op": "attention", "inputs": f"{lib} {device}", "steps": steps, "backend": plan.backend.name,
            "runtime_lengths": plan.backend.runtime_lengths, "shape": f"B=1 Sq=1 Hq=8 Hkv=2 D=64, Sk 16..{15 + steps}",
            "chunk": chunk, "samples": len(grow),
            "plans_made": info["plans_made"] - made, "first_pass_overhead_us": round(first, 2),
            "growing_overhead_us": round(med(grow), 2), "repeated_overhead_us": round(med(rep), 2),
            "growing_min_us": round(min(grow), 2), "repeated_min_us": round(min(rep), 2),
            "ratio": round(med(grow) / med(rep), 3), "ratio_min": round(min(grow) / min(rep), 3),
            "fresh_arrays_overhead_us": round(med(new), 2), "ratio_to_fresh_arrays": round(med(grow) / med(new), 3),
            "plan_ms": plan.decision.plan_ms, "compile_ms": plan.decision.compile_ms,
            "lengths_compiled": plan.decision.lengths_compiled,
            # the kernel's own host part (a runtime_lengths kernel's per-length memo, checks and launch; on a GPU the
            # kernels run asynchronously, so this is host time) and, for triton, its builds (one per configuration)
            "kernel_growing_us": round(med(inside["grow"]), 2), "kernel_repeated_us": round(med(inside["rep"]), 2),
            "kernel_builds": getattr(plan.kernel, "builds", None)}


def torch_sync(device: str):
    if device != "cuda":
        return lambda: None
    import torch

    return torch.cuda.synchronize


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50, help="calls per timed round (default 50)")
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds per path (default 200)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="result folder")
    ap.add_argument("--tag", default="", help="what the run varies, in the result name (e.g. -quiet)")
    ap.add_argument("--steps", type=int, default=512, help="calls of the growing decode loop (default 512)")
    ap.add_argument("--growing-rounds", type=int, default=10,
                    help="timed passes of the growing loop, each in chunks of 32 calls (default 10)")
    ap.add_argument("--only-growing", action="store_true", help="run the growing decode loop only")
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
    growing = []

    def bench_growing(lib, device, kernel_kind, backend):
        r = {"kernel": kernel_kind, **growing_case(lib, device, backend, rng, args.steps, args.growing_rounds)}
        growing.append(r)
        print(f"growing    {lib:5s} {device:4s} {kernel_kind:4s} {r['backend']:12s} {args.steps} steps: overhead "
              f"{r['growing_overhead_us']:6.2f} us/call vs repeated {r['repeated_overhead_us']:6.2f} us "
              f"({r['ratio']:.2f}x; min {r['ratio_min']:.2f}x; {r['ratio_to_fresh_arrays']:.2f}x of fresh arrays at one "
              f"length), first pass {r['first_pass_overhead_us']:.2f} us, "
              f"{r['plans_made']} plan(s), {r['lengths_compiled']} length(s) compiled; kernel host "
              f"{r['kernel_growing_us']:.2f} vs {r['kernel_repeated_us']:.2f} us, builds {r['kernel_builds']}", flush=True)

    for lib, device in setups:   # real kernels: the backend dispatch picks, as for an application
        if not args.only_growing:
            for op_name, case in cases:
                bench(op_name, case, lib, device, "real", None)
        bench_growing(lib, device, "real", None)
    plugins.register(NullPlugin(), name="dispatch-overhead-null")
    try:
        for lib, device in setups:
            if not args.only_growing:
                for op_name, case in cases:
                    bench(op_name, case, lib, device, "null", f"null-{lib}")
            bench_growing(lib, device, "null", f"null-{lib}")
    finally:
        plugins.unregister("dispatch-overhead-null")

    worst = max((r["overhead_us"] for r in rows), default=None)
    worst_ratio = max(r["ratio"] for r in growing)
    result = {"benchmark": "dispatch_overhead", "tag": args.tag, "date": datetime.date.today().isoformat(),
              "portakern": portakern.__version__, "python": sys.version.split()[0],
              "numpy": np.__version__, "torch": _torch_version(), "machine": platform.machine(),
              "processor": platform.processor(), "calls_per_round": args.calls, "rounds": args.rounds,
              "target_us": TARGET_US, "worst_overhead_us": worst,
              "meets_target": None if worst is None else worst <= TARGET_US, "results": rows,
              "growing_steps": args.steps, "growing_rounds": args.growing_rounds,
              "growing_goal_ratio": GROWING_GOAL_RATIO, "growing_worst_ratio": worst_ratio,
              "growing_meets_goal": worst_ratio <= GROWING_GOAL_RATIO, "growing": growing,
              "identity": run_identity(CPU)}
    path = Path(result_path(args.out, "dispatch-overhead", args.tag, card=_card(setups)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if worst is not None:
        print(f"worst overhead {worst:.2f} us (target <= {TARGET_US} us)")
    print(f"growing decode loop: worst ratio {worst_ratio:.2f}x of repeated (goal <= {GROWING_GOAL_RATIO}x) -> {path}")
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
