"""The "fastest" dispatch policy: rank a plan's candidates by their measured time on the call's own inputs.

On a plan miss under ``use_policy("fastest")``, ``rank_by_measurement`` orders the plan by a ranking stored earlier
(this process or a previous one) or marks it for measuring; ``measure`` then compiles every supporting backend,
times each (``MEASURE_WARMUP`` untimed runs, then the median of ``MEASURE_REPEATS``) and orders the plan fastest
first. The ranking is stored in a ``TuningCache`` (namespace ``dispatch-fastest``, keyed by the device identity and
the version of every registered backend) under the op's ``content_hash()``, so a later process reads it instead of
measuring.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable

from .decision import Plan, fail_current
from .devices import Device
from .errors import PortakernError
from .plugins import registry

MEASURE_WARMUP, MEASURE_REPEATS = 1, 5  # untimed runs, then the median of this many timed runs
FASTEST_NAMESPACE = "dispatch-fastest"


def _tuning_cache(device: Device):
    """The ranking store for ``device``: tagged with portakern's and every registered backend's version."""
    from . import __version__
    from .cache import TuningCache

    versions = {"portakern": __version__,
                **{f"backend:{n}": str(b.version) for n, b in sorted(registry().backends.items())}}
    return TuningCache(FASTEST_NAMESPACE, device, versions)


def _stored_ranking(op: Any, device: Device) -> dict[str, float] | None:
    """The stored ``{backend: median_us}`` for ``op`` on ``device``; None when absent or malformed."""
    entry = _tuning_cache(device).get(op.content_hash())
    if not isinstance(entry, dict) or not entry or not all(
            isinstance(n, str) and isinstance(t, (int, float)) and t >= 0 for n, t in entry.items()):
        return None
    return {n: float(t) for n, t in entry.items()}


def _order_by_time(plan: Plan, times: dict[str, float]) -> None:
    """Fastest first; candidates without a time (they failed when measured) last, by priority."""
    inf = float("inf")
    plan.order.sort(key=lambda b: times.get(b.name, inf))  # stable: ties keep the priority order


def rank_by_measurement(plan: Plan) -> None:
    """Order ``plan`` by a stored ranking, or mark it for measuring (``dispatch.get_plan`` then calls ``measure``)."""
    d = plan.decision
    if len(plan.order) < 2:
        d.ranked_by = "one candidate"
        return
    stored = _stored_ranking(d.op, d.device)
    if stored is None:
        d.ranked_by, plan.to_measure = "not measured yet", True
        return
    supported = {b.name for b in plan.order}
    d.measured_us = {n: t for n, t in stored.items() if n in supported}
    d.ranked_by = "tuning cache"
    _order_by_time(plan, d.measured_us)


def _synchronizer(device: Device) -> Callable[[], None]:
    """Waits for ``device`` to finish queued work (CUDA / ROCm through torch, else cupy; OpenCL through its cached
    queue); no-op on CPU."""
    if device.type == "opencl":
        from .opencl_runtime import queue

        return queue(device).finish
    if device.type not in ("cuda", "rocm"):
        return lambda: None
    try:
        import torch

        return lambda: torch.cuda.synchronize(device.index)
    except ImportError:  # pragma: no cover - cupy-only installs
        import cupy

        return cupy.cuda.Device(device.index).synchronize


def _median_us(run: Callable[[], Any], sync: Callable[[], None]) -> float:
    for _ in range(MEASURE_WARMUP):
        run()
    sync()
    times = []
    for _ in range(MEASURE_REPEATS):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(plan: Plan, run: Callable[[Plan], Any]) -> None:
    """Compile every candidate of ``plan``, time ``run`` on each, order the plan fastest first, store it.

    A candidate that fails to compile or run is dropped as a fallback (an error under strict mode),
    exactly as on the priority path. Each run allocates fresh outputs, which are discarded; the
    compiled kernels are kept on the plan so the winner is not compiled twice.
    """
    from . import capture

    capture.refuse(f"{plan.decision.op.kind} on {plan.decision.device.label}",
                   "the 'fastest' policy would time every backend (with synchronisations)")
    d, sync = plan.decision, _synchronizer(plan.decision.device)
    times: dict[str, float] = {}
    for b in list(plan.order):
        try:
            kernel = b.compile(d.op, d.device)
        except PortakernError:
            raise
        except Exception as e:
            fail_current(plan, b, e, "compile")
            continue
        trial = Plan(decision=d, order=[b], backend=b, kernel=kernel)
        try:
            times[b.name] = _median_us(lambda: run(trial), sync)
        except PortakernError:
            raise
        except Exception as e:
            fail_current(plan, b, e, "run")
            continue
        plan.compiled[b.name] = kernel
    plan.to_measure = False
    d.measured_us, d.ranked_by = times, "measured"
    _order_by_time(plan, times)
    if times:
        try:
            _tuning_cache(d.device).put(d.op.content_hash(), {n: round(t, 3) for n, t in times.items()})
        except OSError as e:  # a read-only or full cache directory costs a re-measure, not the call
            warnings.warn(f"portakern: could not store the measured ranking of {d.op.kind}: {e}", RuntimeWarning,
                          stacklevel=4)
