"""Dispatch: from a call's arrays to a compiled kernel, planned once per signature.

``plan_for(...)`` builds a ``Plan`` (candidates, reasons, the compiled kernel, fallbacks) the first
time a signature is seen; after that a call costs a signature tuple and a dictionary lookup.
Overrides, strongest first: the ``backend=`` argument, ``use_backend(...)``, ``PORTAKERN_BACKEND``.
``PORTAKERN_STRICT=1`` turns every fallback into an error.

Ordering policy (``use_policy(...)`` or ``PORTAKERN_POLICY``): ``"priority"`` (default) ranks the
supporting backends by the priority hook; ``"fastest"`` compiles every supporting backend on a plan
miss, times each on the call's own inputs and ranks them by median time. The ranking is stored in
a ``TuningCache`` (namespace ``dispatch-fastest``, keyed by the device identity and the version of
every registered backend) under the op's ``content_hash()``, so a later process reads it instead of
measuring.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .backend import Backend, Support, support_of
from .devices import Device
from .errors import (BackendError, InvalidInputError, InvalidTypeError, PortakernError, StrictModeError,
                     UnsupportedError)
from .plugins import registry


class FallbackWarning(UserWarning):
    """A backend failed to compile or run and the next candidate served the call."""


#: (backend forced by ``use_backend``, policy set by ``use_policy``): one ContextVar, one lookup per call.
_context: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "portakern_dispatch", default=(None, None))
_poison: contextvars.ContextVar[bool] = contextvars.ContextVar("portakern_poison", default=False)
_plans: dict[tuple, "Plan"] = {}
#: signature -> the result maker of a call without rows (an empty batch), checked on its first call; see api.py
empty_results: dict[tuple, Callable[[Any], Any]] = {}
_plan_lock = threading.Lock()
_warned: set[tuple] = set()


def strict() -> bool:
    return os.environ.get("PORTAKERN_STRICT", "").lower() not in ("", "0", "false", "no")


def override(backend_arg: str | None) -> tuple[str | None, str]:
    """The backend forced for this call and where that came from ("argument", "context", "env")."""
    if backend_arg is not None:
        return backend_arg, "argument"
    ctx = _context.get()[0]
    if ctx is not None:
        return ctx, "use_backend()"
    env = os.environ.get("PORTAKERN_BACKEND")
    if env:
        return env, "PORTAKERN_BACKEND"
    return None, ""


def _env_reader(backend_var: str, strict_var: str, policy_var: str) -> Callable[[], tuple]:
    """A fast reader of three ``os.environ`` variables, for the per-call signature.

    ``os.environ.get`` of an unset variable costs about a microsecond (it encodes the key and
    raises KeyError inside); reading CPython's backing dict with pre-encoded keys costs tens of
    nanoseconds and sees exactly what ``os.environ`` sees (``monkeypatch.setenv`` included).
    """
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        get, kb, ks, kp = data.get, encode(backend_var), encode(strict_var), encode(policy_var)
        return lambda: (get(kb), get(ks), get(kp))
    env = os.environ  # pragma: no cover
    return lambda: (env.get(backend_var), env.get(strict_var), env.get(policy_var))  # pragma: no cover


_override_env = _env_reader("PORTAKERN_BACKEND", "PORTAKERN_STRICT", "PORTAKERN_POLICY")


def override_key(backend_arg: str | None) -> tuple:
    """The part of a signature that depends on overrides, policy and strict mode (cheap: no registry)."""
    if backend_arg is not None and type(backend_arg) is not str:
        raise InvalidTypeError(f"backend={backend_arg!r} must be a backend name (a str) or None; "
                               f"see portakern.backends() for the registered names")
    return (backend_arg, _context.get(), _override_env())


@contextlib.contextmanager
def use_backend(name: str):
    """Run every portakern call inside the ``with`` block on backend ``name`` (unless a call passes ``backend=``)."""
    if not isinstance(name, str):
        raise InvalidInputError(f"use_backend({name!r}): the backend name must be a string")
    registry().get(name)  # raises with the list of registered names
    token = _context.set((name, _context.get()[1]))
    try:
        yield
    finally:
        _context.reset(token)


POLICIES = {"priority": "the highest-priority supporting backend first (the default)",
            "fastest": "measure every supporting backend on the first call of a signature, fastest first"}


def _check_policy(name: Any, where: str) -> str:
    if name not in POLICIES:
        allowed = "; ".join(f"{p!r}: {what}" for p, what in POLICIES.items())
        raise InvalidInputError(f"{where}={name!r} is not a dispatch policy: the policies are {allowed}")
    return name


@contextlib.contextmanager
def use_policy(name: str):
    """Order the candidates of every plan made inside the ``with`` block by policy ``name``.

    ``"priority"`` (the default) ranks supporting backends by priority; ``"fastest"`` times each
    supporting backend on the first call of a signature and ranks them by median time (persisted
    on disk, see ``portakern.cache``). A forced backend (``backend=``, ``use_backend``,
    ``PORTAKERN_BACKEND``) is never measured. Plans made under one policy are not reused under the
    other. Overrides ``PORTAKERN_POLICY``.
    """
    _check_policy(name, "use_policy(name)")
    token = _context.set((_context.get()[0], name))
    try:
        yield
    finally:
        _context.reset(token)


def policy() -> tuple[str, str]:
    """The ordering policy in force and where it came from ("use_policy()", "PORTAKERN_POLICY", "default")."""
    ctx = _context.get()[1]
    if ctx is not None:
        return ctx, "use_policy()"
    env = os.environ.get("PORTAKERN_POLICY")
    if env:
        return _check_policy(env, "PORTAKERN_POLICY"), "PORTAKERN_POLICY"
    return "priority", "default"


@contextlib.contextmanager
def poison_outputs():
    """Fill every output with NaN before the kernel runs (conformance: unwritten elements fail)."""
    token = _poison.set(True)
    try:
        yield
    finally:
        _poison.reset(token)


def poisoning() -> bool:
    return _poison.get()


@dataclass
class Candidate:
    name: str
    priority: int
    support: Support


@dataclass
class Decision:
    """What dispatch decided for one signature; ``str()`` is a readable table.

    ``policy`` / ``policy_by``: the ordering policy in force and where it came from.
    ``ranked_by``: what actually ordered the candidates: "priority", "forced", "measured" (timed
    on this call's inputs), "tuning cache" (a ranking measured earlier, read from disk), "one
    candidate" (nothing to compare) or "not measured yet" (``explain`` under "fastest" before the
    first call). ``measured_us``: median microseconds per candidate that ran, or None.
    """

    op: Any
    device: Device
    forced: str | None
    forced_by: str
    candidates: list[Candidate] = field(default_factory=list)
    chosen: str | None = None
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (backend, error)
    policy: str = "priority"
    policy_by: str = "default"
    ranked_by: str = "priority"
    measured_us: dict[str, float] | None = None

    def to_json(self) -> dict:
        times = self.measured_us or {}
        return {"op": self.op.to_json(), "device": self.device.to_json(), "forced": self.forced,
                "forced_by": self.forced_by, "chosen": self.chosen, "policy": self.policy,
                "policy_by": self.policy_by, "ranked_by": self.ranked_by, "measured_us": self.measured_us,
                "candidates": [{"backend": c.name, "priority": c.priority, "supported": c.support.ok,
                                "reason": c.support.reason, "time_us": times.get(c.name)} for c in self.candidates],
                "fallbacks": [{"backend": b, "error": e} for b, e in self.fallbacks]}

    def __str__(self) -> str:
        lines = [f"op       {self.op.kind} {self.op.content_hash()}", f"device   {self.device.label}"]
        if self.forced:
            lines.append(f"forced   {self.forced} (by {self.forced_by})")
        by = "" if self.policy_by == "default" else f" (by {self.policy_by})"
        ranked = "" if self.ranked_by == self.policy else f", ranked by {self.ranked_by}"
        lines.append(f"policy   {self.policy}{by}{ranked}")
        lines.append(f"chosen   {self.chosen or '-'}")
        w = max([len(c.name) for c in self.candidates] + [7])
        times = self.measured_us
        lines.append(f"  {'backend'.ljust(w)}  prio  " + ("" if times is None else f"{'median':>12}  ") + "status")
        for c in self.candidates:
            status = "ok" if c.support.ok else f"no: {c.support.reason}"
            mark = "*" if c.name == self.chosen else " "
            t = "" if times is None else (f"{times[c.name]:>9.1f} us  " if c.name in times else f"{'-':>12}  ")
            lines.append(f"{mark} {c.name.ljust(w)}  {c.priority:>4}  {t}{status}")
        for b, e in self.fallbacks:
            lines.append(f"fell back from {b}: {e}")
        return "\n".join(lines)


@dataclass
class Plan:
    """A cached decision plus the compiled kernel of the chosen backend."""

    decision: Decision
    order: list[Backend]            # supporting backends, best first, not yet failed
    backend: Backend | None = None
    kernel: Callable[..., None] | None = None
    shapes: dict | None = None      # op.shapes(), memoised by the hot path
    compiled: dict[str, Callable[..., None]] = field(default_factory=dict)  # kernels compiled while measuring
    to_measure: bool = False        # "fastest" with no stored ranking: get_plan times the candidates


def _rank(backend: Backend, op: Any, device: Device) -> int:
    p = registry().pm.hook.portakern_backend_priority(backend=backend, op=op, device=device)
    return backend.priority if p is None else int(p)


def _warn_once(backend: str, op: Any, err: BaseException, stage: str) -> None:
    key = (backend, op.kind, type(err).__name__, stage)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"portakern: backend {backend!r} failed to {stage} {op.kind}: {type(err).__name__}: "
                      f"{err}; falling back to the next candidate (set PORTAKERN_STRICT=1 to make this an error)",
                      FallbackWarning, stacklevel=4)


def decide(op: Any, device: Device, backend_arg: str | None) -> Plan:
    """Build the candidate list for ``op`` on ``device`` (no compilation)."""
    reg = registry()
    forced, by = override(backend_arg)
    decision = Decision(op=op, device=device, forced=forced, forced_by=by)
    names = [forced] if forced else sorted(reg.backends)
    for name in names:
        b = reg.get(name)
        try:
            s = support_of(b, op, device)
        except Exception as e:  # a broken supports() must not take dispatch down
            s = Support(False, f"supports() raised {type(e).__name__}: {e}")
        decision.candidates.append(Candidate(name, _rank(b, op, device), s))
    decision.candidates.sort(key=lambda c: (-c.priority, c.name))
    order = [reg.backends[c.name] for c in decision.candidates if c.support.ok]
    plan = Plan(decision=decision, order=order)
    decision.policy, decision.policy_by = policy()
    if forced:
        decision.ranked_by = "forced"
    elif decision.policy == "fastest":
        _rank_by_measurement(plan)
    if not order:
        reasons = "; ".join(f"{c.name}: {c.support.reason}" for c in decision.candidates)
        if forced:
            others = [n for n in sorted(reg.backends) if n != forced and _supports(reg.backends[n], op, device)]
            way = f"pass backend={others[0]!r}" if others else "no other registered backend supports it either"
            raise UnsupportedError(f"{op.kind} ({_brief(op)}) is not supported by {forced} on {device.label}: "
                                   f"{decision.candidates[0].support.reason}; {way} (forced by {by})")
        raise UnsupportedError(f"no backend supports {op.kind} ({_brief(op)}) on {device.label}: {reasons or 'no backends registered'}")
    return plan


def _supports(b: Backend, op: Any, device: Device) -> bool:
    try:
        return bool(support_of(b, op, device))
    except Exception:
        return False


def _brief(op: Any) -> str:
    if op.kind == "attention":
        return (f"B={op.batch} Sq={op.seqlen_q} Sk={op.seqlen_k} Hq={op.heads_q} Hkv={op.heads_kv} "
                f"D={op.head_dim} {op.dtype.value} {op.kv_layout.value}")
    return f"M={op.M} N={op.N} K={op.K} {op.dtype.value} {op.fmt.packing.value} int{op.fmt.bits} g{op.fmt.group_size}"


def compile_next(plan: Plan) -> Plan:
    """Compile the best remaining candidate, falling back (with a one-time warning) on failure."""
    d = plan.decision
    while plan.order:
        b = plan.order[0]
        try:
            kernel = plan.compiled.pop(b.name, None)
            plan.kernel = b.compile(d.op, d.device) if kernel is None else kernel
            plan.backend = b
            d.chosen = b.name
            return plan
        except PortakernError:
            raise
        except Exception as e:
            fail_current(plan, b, e, "compile")
    raise BackendError(f"every candidate failed for {d.op.kind} ({_brief(d.op)}) on {d.device.label}: "
                       + "; ".join(f"{n}: {e}" for n, e in d.fallbacks))


def fail_current(plan: Plan, b: Backend, e: BaseException, stage: str) -> None:
    """Drop backend ``b`` from the plan after it failed at ``stage``; raise when that is not allowed."""
    d = plan.decision
    if d.forced:
        raise BackendError(f"backend {b.name!r} (forced by {d.forced_by}) failed to {stage} {d.op.kind} "
                           f"({_brief(d.op)}): {type(e).__name__}: {e}") from e
    if strict():
        raise StrictModeError(f"backend {b.name!r} failed to {stage} {d.op.kind} ({_brief(d.op)}) and "
                              f"PORTAKERN_STRICT=1 forbids falling back: {type(e).__name__}: {e}") from e
    _warn_once(b.name, d.op, e, stage)
    d.fallbacks.append((b.name, f"{stage}: {type(e).__name__}: {e}"))
    if b in plan.order:
        plan.order.remove(b)
    plan.compiled.pop(b.name, None)
    if plan.backend is b:
        plan.backend = plan.kernel = None
        d.chosen = None


def get_plan(key: tuple, build: Callable[[], tuple[Any, Device, Callable[[Plan], Any]]],
             backend_arg: str | None) -> Plan:
    """The cached plan for ``key``; on a miss, ``build()`` returns ``(op, device, run)``.

    ``run(plan)`` runs ``plan.kernel`` once on the call's own inputs with fresh outputs (the
    "fastest" policy times it; its result is discarded). A key that cannot be hashed (an option of
    the wrong type, such as a list) goes to ``build()``, whose validation names the argument.
    """
    try:
        plan = _plans.get(key)
    except TypeError:
        build()   # validation raises for the argument that made the key unhashable
        raise InvalidTypeError(f"an option of this call is not hashable ({_unhashable(key)}); pass plain "
                               f"Python scalars, tuples or None for the options") from None
    if plan is not None:
        return plan
    op, device, run = build()
    with _plan_lock:  # concurrent first calls compile (and measure) once
        plan = _plans.get(key)
        if plan is None:
            plan = decide(op, device, backend_arg)
            if plan.to_measure:
                measure(plan, run)
            plan = compile_next(plan)
            _plans[key] = plan
    return plan


def _unhashable(key: tuple) -> str:
    """The first part of ``key`` that cannot be hashed, for the error message."""
    for part in key:
        try:
            hash(part)
        except TypeError:
            return f"{type(part).__name__} {part!r:.80}"
    return "?"


def fall_back(key: tuple, plan: Plan, e: BaseException) -> Plan:
    """The plan to retry with after ``plan``'s backend raised ``e`` while running: a new plan without that
    backend, compiled for the next candidate, replaces ``plan`` under ``key`` (copy on write: a thread still
    running the old plan keeps a whole one; after a ``clear_cache`` meanwhile the new plan serves this call only).
    When another thread already replaced it, that plan. When no
    candidate is left, the key is forgotten (the next call decides afresh) and ``BackendError`` raised; a forced
    backend or strict mode raises as ``fail_current`` says and keeps the plan."""
    with _plan_lock:
        current = _plans.get(key)
        if current is not None and current is not plan:
            return current
        d = plan.decision
        new = Plan(decision=replace(d, fallbacks=list(d.fallbacks)), order=list(plan.order), backend=plan.backend,
                   kernel=plan.kernel, compiled=dict(plan.compiled))
        fail_current(new, plan.backend, e, "run")
        try:
            compile_next(new)
        except BaseException:
            _plans.pop(key, None)
            raise
        if current is not None:     # None: the cache was cleared meanwhile; the next call decides afresh
            _plans[key] = new
        return new


def clear_cache() -> None:
    """Forget every plan (after registering a plugin, or in tests)."""
    with _plan_lock:
        _plans.clear()
        empty_results.clear()
    _warned.clear()


# -- policy "fastest": rank the candidates by measured time -------------------------------------------

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


def _rank_by_measurement(plan: Plan) -> None:
    """Order ``plan`` by a stored ranking, or mark it for measuring (``get_plan`` then calls ``measure``)."""
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
