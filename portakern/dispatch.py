"""Dispatch: from a call's arrays to a compiled kernel, planned once per signature.

``plan_for(...)`` builds a ``Plan`` (candidates, reasons, the compiled kernel, fallbacks) the first
time a signature is seen; after that a call costs a signature tuple and a dictionary lookup.
Overrides, strongest first: the ``backend=`` argument, ``use_backend(...)``, ``PORTAKERN_BACKEND``.
``PORTAKERN_STRICT=1`` turns every fallback into an error.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from .backend import Backend, Support
from .devices import Device
from .errors import BackendError, InvalidInputError, PortakernError, StrictModeError, UnsupportedError
from .plugins import registry


class FallbackWarning(UserWarning):
    """A backend failed to compile or run and the next candidate served the call."""


_context_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar("portakern_backend", default=None)
_poison: contextvars.ContextVar[bool] = contextvars.ContextVar("portakern_poison", default=False)
_plans: dict[tuple, "Plan"] = {}
_plan_lock = threading.Lock()
_warned: set[tuple] = set()


def strict() -> bool:
    return os.environ.get("PORTAKERN_STRICT", "").lower() not in ("", "0", "false", "no")


def override(backend_arg: str | None) -> tuple[str | None, str]:
    """The backend forced for this call and where that came from ("argument", "context", "env")."""
    if backend_arg is not None:
        return backend_arg, "argument"
    ctx = _context_backend.get()
    if ctx is not None:
        return ctx, "use_backend()"
    env = os.environ.get("PORTAKERN_BACKEND")
    if env:
        return env, "PORTAKERN_BACKEND"
    return None, ""


def _env_reader(backend_var: str, strict_var: str) -> Callable[[], tuple]:
    """A fast reader of two ``os.environ`` variables, for the per-call signature.

    ``os.environ.get`` of an unset variable costs about a microsecond (it encodes the key and
    raises KeyError inside); reading CPython's backing dict with pre-encoded keys costs tens of
    nanoseconds and sees exactly what ``os.environ`` sees (``monkeypatch.setenv`` included).
    """
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        get, kb, ks = data.get, encode(backend_var), encode(strict_var)
        return lambda: (get(kb), get(ks))
    return lambda: (os.environ.get(backend_var), os.environ.get(strict_var))  # pragma: no cover


_override_env = _env_reader("PORTAKERN_BACKEND", "PORTAKERN_STRICT")


def override_key(backend_arg: str | None) -> tuple:
    """The part of a signature that depends on overrides and strict mode (cheap: no registry)."""
    return (backend_arg, _context_backend.get(), _override_env())


@contextlib.contextmanager
def use_backend(name: str):
    """Run every portakern call inside the ``with`` block on backend ``name`` (unless a call passes ``backend=``)."""
    if not isinstance(name, str):
        raise InvalidInputError(f"use_backend({name!r}): the backend name must be a string")
    registry().get(name)  # raises with the list of registered names
    token = _context_backend.set(name)
    try:
        yield
    finally:
        _context_backend.reset(token)


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
    """What dispatch decided for one signature; ``str()`` is a readable table."""

    op: Any
    device: Device
    forced: str | None
    forced_by: str
    candidates: list[Candidate] = field(default_factory=list)
    chosen: str | None = None
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (backend, error)

    def to_json(self) -> dict:
        return {"op": self.op.to_json(), "device": self.device.to_json(), "forced": self.forced,
                "forced_by": self.forced_by, "chosen": self.chosen,
                "candidates": [{"backend": c.name, "priority": c.priority, "supported": c.support.ok,
                                "reason": c.support.reason} for c in self.candidates],
                "fallbacks": [{"backend": b, "error": e} for b, e in self.fallbacks]}

    def __str__(self) -> str:
        lines = [f"op       {self.op.kind} {self.op.content_hash()}", f"device   {self.device.label}"]
        if self.forced:
            lines.append(f"forced   {self.forced} (by {self.forced_by})")
        lines.append(f"chosen   {self.chosen or '-'}")
        w = max([len(c.name) for c in self.candidates] + [7])
        lines.append(f"  {'backend'.ljust(w)}  prio  status")
        for c in self.candidates:
            status = "ok" if c.support.ok else f"no: {c.support.reason}"
            mark = "*" if c.name == self.chosen else " "
            lines.append(f"{mark} {c.name.ljust(w)}  {c.priority:>4}  {status}")
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
            s = b.supports(op, device)
        except Exception as e:  # a broken supports() must not take dispatch down
            s = Support(False, f"supports() raised {type(e).__name__}: {e}")
        decision.candidates.append(Candidate(name, _rank(b, op, device), s))
    decision.candidates.sort(key=lambda c: (-c.priority, c.name))
    order = [reg.backends[c.name] for c in decision.candidates if c.support.ok]
    if not order:
        reasons = "; ".join(f"{c.name}: {c.support.reason}" for c in decision.candidates)
        if forced:
            others = [n for n in sorted(reg.backends) if n != forced and _supports(reg.backends[n], op, device)]
            way = f"pass backend={others[0]!r}" if others else "no other registered backend supports it either"
            raise UnsupportedError(f"{op.kind} ({_brief(op)}) is not supported by {forced} on {device.label}: "
                                   f"{decision.candidates[0].support.reason}; {way} (forced by {by})")
        raise UnsupportedError(f"no backend supports {op.kind} ({_brief(op)}) on {device.label}: {reasons or 'no backends registered'}")
    return Plan(decision=decision, order=order)


def _supports(b: Backend, op: Any, device: Device) -> bool:
    try:
        return bool(b.supports(op, device))
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
            plan.kernel = b.compile(d.op, d.device)
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
    plan.order.pop(0)
    plan.backend = plan.kernel = None
    d.chosen = None


def get_plan(key: tuple, build: Callable[[], tuple[Any, Device]], backend_arg: str | None) -> Plan:
    """The cached plan for ``key``; on a miss, ``build()`` returns ``(op, device)`` to plan for."""
    plan = _plans.get(key)
    if plan is not None:
        return plan
    op, device = build()
    with _plan_lock:  # concurrent first calls compile once
        plan = _plans.get(key)
        if plan is None:
            plan = compile_next(decide(op, device, backend_arg))
            _plans[key] = plan
    return plan


def clear_cache() -> None:
    """Forget every plan (after registering a plugin, or in tests)."""
    with _plan_lock:
        _plans.clear()
    _warned.clear()
