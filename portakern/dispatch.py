"""Dispatch: from a call's arrays to a compiled kernel, planned once per signature.

``get_plan(...)`` builds a ``Plan`` (candidates, reasons, the compiled kernel, fallbacks) the first
time a signature is seen; after that a call costs a signature tuple and a dictionary lookup.
The parts live beside it: what the caller forces (``overrides``: ``backend=``, ``use_backend``,
``use_policy``, strict mode), what was decided (``decision``: ``Decision``, ``Plan``, falling back) and the
"fastest" policy's measurement (``measure``). This module owns the per-signature caches: the plans, and the
result makers of calls without rows (``empty_result`` / ``remember_empty_result``).

A signature is a *shape class* (``portakern.lengths``): a call whose only change from a planned one is a sequence
length reuses that plan; ``bind`` gives it the kernel for its lengths. Every cache is an ``LRU`` bounded by
``set_cache_limits`` (defaults in ``CACHE_LIMITS``); ``cache_info()`` counts plans made and evicted.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

from . import capture
from .backend import Backend, Support, support_of
from .decision import Candidate, Decision, FallbackWarning, Plan, _warned, brief, fail_current
from .devices import Device
from .errors import BackendError, InvalidTypeError, PortakernError, UnsupportedError
from .measure import measure, rank_by_measurement
from .overrides import (POLICIES, override, override_key, poison_outputs, poisoning, policy, strict, use_backend,
                        use_policy)
from .lengths import attention_at, attention_shapes
from .lru import LRU, check_size
from .plugins import registry

#: The default bounds of the in-memory caches: ``plans`` (shape classes with a plan), ``empty_results`` (shape
#: classes of calls without rows), ``lengths`` (per plan, the sequence lengths holding a kernel of their own, for a
#: backend that compiles per length), ``torch_op_kernels`` (the compiled GEMV kernels of ``torch.ops.portakern``, one
#: per M and weight shape). Change them with ``set_cache_limits``.
CACHE_LIMITS = {"plans": 1024, "empty_results": 1024, "lengths": 64, "torch_op_kernels": 256}
_limits = dict(CACHE_LIMITS)
_plans: LRU = LRU(_limits["plans"])
#: signature -> the result maker of a call without rows (an empty batch); see ``empty_result``
_empty_results: LRU = LRU(_limits["empty_results"])
#: signature -> compiled kernel of ``portakern.torch_ops`` (the custom ops' own cache, bounded here)
torch_op_cache: LRU = LRU(_limits["torch_op_kernels"])
_plan_lock = threading.Lock()
_made = {"plans": 0, "lengths": 0}


def empty_result(key: tuple) -> Callable[[Any], Any] | None:
    """The result maker stored for signature ``key`` by ``remember_empty_result``, or None (also for a key that
    cannot be hashed: the call's validation then names the argument)."""
    try:
        return _empty_results.get(key)
    except TypeError:
        return None


def remember_empty_result(key: tuple, make: Callable[[Any], Any]) -> None:
    """Keep ``make`` (the caller's arrays -> the empty result of a call without rows) for signature ``key``, after
    that signature's first call passed its checks, so later calls skip them as a planned call does. Forgotten with
    the plans (``clear_cache``); a key that cannot be hashed is not kept."""
    try:
        _empty_results.put(key, make)
    except TypeError:
        pass


def set_cache_limits(*, plans: int | None = None, empty_results: int | None = None,
                     lengths: int | None = None, torch_op_kernels: int | None = None) -> dict[str, int]:
    """Bound the in-memory caches (each least recently used entry goes first) and return the bounds now in force.

    Args:
      plans: shape classes holding a plan (and its compiled kernel); default ``CACHE_LIMITS["plans"]`` (1024).
      empty_results: shape classes of calls without rows; default 1024.
      lengths: per plan, sequence lengths holding a kernel of their own (backends whose kernels are compiled per
        length, ``Backend.runtime_lengths`` False); default 64. Applies to plans made from now on.
      torch_op_kernels: compiled kernels of ``torch.ops.portakern.quant_gemv`` (one per M, weight shape and
        format); default 256.

    None leaves a bound as it is. Raises ``InvalidTypeError`` / ``InvalidInputError`` for a bound that is not an
    int >= 1 (``clear_cache()`` empties the caches).
    """
    new = {n: check_size(v, n) for n, v in (("plans", plans), ("empty_results", empty_results),
                                              ("lengths", lengths), ("torch_op_kernels", torch_op_kernels))
           if v is not None}
    _limits.update(new)
    _plans.resize(_limits["plans"])
    _empty_results.resize(_limits["empty_results"])
    torch_op_cache.resize(_limits["torch_op_kernels"])
    return dict(_limits)


def cache_info() -> dict[str, int]:
    """Counters of the plan cache: ``plans`` (held now), ``plans_made`` (planned since the process started, each a
    decision and a compile), ``plan_evictions``, ``lengths_compiled`` (kernels compiled for a further sequence
    length of a planned shape class), ``empty_results`` (held now), ``torch_op_kernels`` (held now) and the bounds
    (``limit_*``)."""
    return {"plans": len(_plans), "plans_made": _made["plans"], "plan_evictions": _plans.evictions,
            "lengths_compiled": _made["lengths"], "empty_results": len(_empty_results),
            "torch_op_kernels": len(torch_op_cache),
            **{f"limit_{n}": v for n, v in _limits.items()}}


def _rank(backend: Backend, op: Any, device: Device) -> int:
    """The candidate's rank: the first non-None answer of the ``portakern_backend_priority`` hooks (in pluggy's order,
    the last registered first), else ``backend.priority``. A hook that raises, or answers what is no int, is skipped
    with a one-time warning naming its plugin: one broken plugin must not fail every call of every backend, nor
    drop the other plugins' answers."""
    args = {"backend": backend, "op": op, "device": device}
    for impl in reversed(registry().pm.hook.portakern_backend_priority.get_hookimpls()):
        try:
            p = impl.function(*[args[a] for a in impl.argnames])
            if p is not None:
                return int(p)
        except Exception as e:
            key = ("priority hook", impl.plugin_name, type(e).__name__)
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"portakern: plugin {impl.plugin_name!r}'s portakern_backend_priority hook raised "
                              f"{type(e).__name__}: {e}; its answer is skipped", RuntimeWarning, stacklevel=2)
    return backend.priority


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
        except BaseException as e:  # a broken supports() (a SystemExit too) must not take dispatch down
            if isinstance(e, KeyboardInterrupt):
                raise
            s = Support(False, f"supports() raised {type(e).__name__}: {e}")
        decision.candidates.append(Candidate(name, _rank(b, op, device), s))
    decision.candidates.sort(key=lambda c: (-c.priority, c.name))
    order = [reg.backends[c.name] for c in decision.candidates if c.support.ok]
    plan = Plan(decision=decision, order=order)
    decision.policy, decision.policy_by = policy()
    if forced:
        decision.ranked_by = "forced"
    elif decision.policy == "fastest":
        rank_by_measurement(plan)
    if not order:
        reasons = "; ".join(f"{c.name}: {c.support.reason}" for c in decision.candidates)
        if forced:
            others = [n for n in sorted(reg.backends) if n != forced and _supports(reg.backends[n], op, device)]
            way = f"pass backend={others[0]!r}" if others else "no other registered backend supports it either"
            raise UnsupportedError(f"{op.kind} ({brief(op)}) is not supported by {forced} on {device.label}: "
                                   f"{decision.candidates[0].support.reason}; {way} (forced by {by})")
        raise UnsupportedError(f"no backend supports {op.kind} ({brief(op)}) on {device.label}: "
                               f"{reasons or 'no backends registered'}")
    return plan


def _supports(b: Backend, op: Any, device: Device) -> bool:
    try:
        return bool(support_of(b, op, device))
    except Exception:
        return False


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
        except (PortakernError, KeyboardInterrupt):
            raise
        except BaseException as e:   # a SystemExit or other BaseException of a backend's compile falls back too
            capture.refuse(f"{d.op.kind} ({brief(d.op)}) on {d.device.label}", f"{b.name} failed to compile", e)
            fail_current(plan, b, e, "compile")
    raise BackendError(f"every candidate failed for {d.op.kind} ({brief(d.op)}) on {d.device.label}: "
                       + "; ".join(f"{n}: {e}" for n, e in d.fallbacks))


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
            t0 = time.perf_counter()
            plan = decide(op, device, backend_arg)
            if plan.to_measure:
                measure(plan, run)
            t1 = time.perf_counter()
            plan = compile_next(plan)
            plan.decision.plan_ms = round((t1 - t0) * 1e3, 3)
            plan.decision.compile_ms = round((time.perf_counter() - t1) * 1e3, 3)
            _plans.put(key, plan)
            _made["plans"] += 1
    return plan


def cached_plan(key: tuple) -> Plan | None:
    """The plan cached under ``key`` (None when there is none, or the key cannot be hashed); no side effects."""
    try:
        return OrderedDict.get(_plans, key)
    except TypeError:
        return None


def bind(plan: Plan, lengths: tuple, q_shape: tuple, k_shape: tuple, bt_shape: tuple | None) -> tuple:
    """``(lengths, kernel, shapes)`` for an attention call of ``plan``'s shape class at its own sequence lengths
    (``lengths``: the shapes of its q, k and block table), remembered as ``plan.last``.

    A backend whose kernels read the lengths at run time (``runtime_lengths``) serves every length with the plan's
    kernel; only the output shapes follow ``q``. Otherwise the kernel for these lengths is compiled once and kept
    in the plan's ``LRU`` of lengths; a length the backend does not support raises ``LengthUnsupported``, which the
    caller's fallback treats as a failure of that backend."""
    be, op = plan.backend, plan.decision.op
    if be.runtime_lengths:
        bound = (lengths, plan.kernel, attention_shapes(op, q_shape))
    else:
        cache = plan.bound
        if cache is None:
            cache = plan.bound = LRU(_limits["lengths"])
        hit = cache.get(lengths)
        if hit is None:
            at = attention_at(op, q_shape, k_shape, bt_shape)
            if at is op:
                hit = (plan.kernel, op.shapes())
            else:
                s = support_of(be, at, plan.decision.device)
                if not s:
                    raise LengthUnsupported(f"{be.name} does not support {at.kind} ({brief(at)}): {s.reason}")
                _refuse_length_in_capture(be, at, plan)
                hit = (be.compile(at, plan.decision.device), at.shapes())
                _made["lengths"] += 1
                plan.decision.lengths_compiled += 1
            cache.put(lengths, hit)
        bound = (lengths, *hit)
    plan.last = bound
    return bound


def _refuse_length_in_capture(be: Backend, at: Any, plan: Plan) -> None:
    """``CaptureError`` when a kernel for a further length of a planned shape class would be compiled inside CUDA
    stream capture (a compile there cannot be recorded and may synchronise): names the op, the lengths and the
    ways out."""
    if capture.is_capturing():
        raise capture.CaptureError(
            f"{at.kind} ({brief(at)}) on {plan.decision.device.label}: {be.name} compiles a kernel per sequence "
            f"length (seqlen_q={at.seqlen_q}, seqlen_k={at.seqlen_k}) and this length has none yet, inside CUDA "
            f"stream capture, where compiling cannot run; run one call at these lengths before capture, capture at "
            f"a length already run, or pass a backend whose kernels read the lengths at run time "
            f"(Backend.runtime_lengths)")


class LengthUnsupported(RuntimeError):
    """The backend of a plan does not support a sequence length of the plan's shape class (``bind``)."""


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
    backend or strict mode raises as ``fail_current`` says and keeps the plan. Inside CUDA stream capture nothing
    is retried: ``CaptureError`` names the op, the backend's error and the way out (the plan is kept)."""
    d = plan.decision
    capture.refuse(f"{d.op.kind} ({brief(d.op)}) on {d.device.label}",
                   f"{plan.backend.name if plan.backend else 'the backend'} failed while running", e)
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
        _empty_results.clear()
    _warned.clear()


__all__ = ["Candidate", "Decision", "FallbackWarning", "POLICIES", "Plan", "brief", "clear_cache", "compile_next",
           "decide", "empty_result", "fail_current", "fall_back", "get_plan", "override", "override_key",
           "poison_outputs", "poisoning", "policy", "remember_empty_result", "strict", "use_backend", "use_policy",
           "CACHE_LIMITS", "LengthUnsupported", "bind", "cache_info", "cached_plan", "set_cache_limits",
           "torch_op_cache"]
