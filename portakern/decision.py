"""What dispatch decided for one signature: the candidates and why each was kept or refused (``Decision``), the
plan that runs (``Plan``), and how a failed candidate is dropped (``fail_current``, with a one-time
``FallbackWarning``, or an error when a forced backend or strict mode forbids falling back)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from .backend import Backend, Support
from .devices import Device
from .errors import BackendError, StrictModeError
from .overrides import strict


class FallbackWarning(UserWarning):
    """A backend failed to compile or run and the next candidate served the call."""


_warned: set[tuple] = set()


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
    ``plan_ms`` / ``compile_ms``: the one-time cost of the cached plan, paid by the first call of its shape class
    (deciding and measuring the candidates / compiling the chosen kernel, fallbacks included), or None for a
    decision no call has planned yet. ``lengths_compiled``: how many more sequence lengths of the class needed a
    kernel of their own (0 for a backend whose kernels read the lengths at run time).
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
    plan_ms: float | None = None
    compile_ms: float | None = None
    lengths_compiled: int = 0

    def to_json(self) -> dict:
        times = self.measured_us or {}
        return {"op": self.op.to_json(), "device": self.device.to_json(), "forced": self.forced,
                "forced_by": self.forced_by, "chosen": self.chosen, "policy": self.policy,
                "policy_by": self.policy_by, "ranked_by": self.ranked_by, "measured_us": self.measured_us,
                "candidates": [{"backend": c.name, "priority": c.priority, "supported": c.support.ok,
                                "reason": c.support.reason, "time_us": times.get(c.name)} for c in self.candidates],
                "fallbacks": [{"backend": b, "error": e} for b, e in self.fallbacks],
                "plan_ms": self.plan_ms, "compile_ms": self.compile_ms, "lengths_compiled": self.lengths_compiled}

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
        if self.plan_ms is None:
            lines.append("cost     not planned yet (the first call of this shape class pays it)")
        else:
            more = f", {self.lengths_compiled} more length(s) compiled" if self.lengths_compiled else ""
            lines.append(f"cost     planned in {self.plan_ms:.3f} ms, compiled in {self.compile_ms:.3f} ms, once per "
                         f"shape class{more}")
        return "\n".join(lines)


@dataclass
class Plan:
    """A cached decision plus the compiled kernel of the chosen backend."""

    decision: Decision
    order: list[Backend]            # supporting backends, best first, not yet failed
    backend: Backend | None = None
    kernel: Callable[..., None] | None = None
    compiled: dict[str, Callable[..., None]] = field(default_factory=dict)  # kernels compiled while measuring
    to_measure: bool = False        # "fastest" with no stored ranking: get_plan times the candidates
    #: ``(lengths, kernel, shapes)`` of the sequence lengths the last call ran at (see ``dispatch.bind``)
    last: tuple | None = None
    #: lengths -> ``(kernel, shapes)`` for a backend whose kernels are compiled per length (an ``LRU``)
    bound: Any = None


def _warn_once(backend: str, op: Any, err: BaseException, stage: str) -> None:
    key = (backend, op.kind, type(err).__name__, stage)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"portakern: backend {backend!r} failed to {stage} {op.kind}: {type(err).__name__}: "
                      f"{err}; falling back to the next candidate (set PORTAKERN_STRICT=1 to make this an error)",
                      FallbackWarning, stacklevel=4)


def fail_current(plan: Plan, b: Backend, e: BaseException, stage: str) -> None:
    """Drop backend ``b`` from the plan after it failed at ``stage``; raise when that is not allowed."""
    d = plan.decision
    if d.forced:
        raise BackendError(f"backend {b.name!r} (forced by {d.forced_by}) failed to {stage} {d.op.kind} "
                           f"({brief(d.op)}): {type(e).__name__}: {e}") from e
    if strict():
        raise StrictModeError(f"backend {b.name!r} failed to {stage} {d.op.kind} ({brief(d.op)}) and "
                              f"PORTAKERN_STRICT=1 forbids falling back: {type(e).__name__}: {e}") from e
    _warn_once(b.name, d.op, e, stage)
    d.fallbacks.append((b.name, f"{stage}: {type(e).__name__}: {e}"))
    if b in plan.order:
        plan.order.remove(b)
    plan.compiled.pop(b.name, None)
    if plan.backend is b:
        plan.backend = plan.kernel = None
        d.chosen = None


def brief(op: Any) -> str:
    """The op's shape in one line, for error messages."""
    if op.kind == "attention":
        return (f"B={op.batch} Sq={op.seqlen_q} Sk={op.seqlen_k} Hq={op.heads_q} Hkv={op.heads_kv} "
                f"D={op.head_dim} {op.dtype.value} {op.kv_layout.value}")
    return f"M={op.M} N={op.N} K={op.K} {op.dtype.value} {op.fmt.packing.value} int{op.fmt.bits} g{op.fmt.group_size}"
