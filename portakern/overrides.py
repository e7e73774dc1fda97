"""What the caller forces on dispatch: a backend, an ordering policy, strict mode, poisoned outputs.

Overrides, strongest first: the ``backend=`` argument, ``use_backend(...)``, ``PORTAKERN_BACKEND``.
Ordering policy: ``use_policy(...)``, else ``PORTAKERN_POLICY``, else "priority". ``PORTAKERN_STRICT=1`` turns
every fallback into an error. The ``with`` blocks live in one ContextVar (one lookup per call); the environment is
read here, at the edge, with a reader cheap enough for the per-call signature (``override_key``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Callable

from .backend import Backend
from .errors import InvalidInputError, InvalidTypeError
from .plugins import registry

#: (backend forced by ``use_backend``, policy set by ``use_policy``): one ContextVar, one lookup per call.
_context: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "portakern_dispatch", default=(None, None))
_poison: contextvars.ContextVar[bool] = contextvars.ContextVar("portakern_poison", default=False)


def strict() -> bool:
    """Whether ``PORTAKERN_STRICT`` forbids falling back to the next candidate."""
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
        if env not in registry().backends:   # say where the name came from: it is in no argument of the call
            raise InvalidInputError(f"backend={env!r} is not registered (named by PORTAKERN_BACKEND={env!r}): "
                                    f"registered backends are {_registered()}; set PORTAKERN_BACKEND to one of them, "
                                    "or unset it to let dispatch choose")
        return env, "PORTAKERN_BACKEND"
    return None, ""


def _registered() -> str:
    """The registered backend names, for a message."""
    return ", ".join(sorted(registry().backends)) or "none"


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
    if backend_arg is not None:
        if type(backend_arg) is not str:
            raise InvalidTypeError(f"backend={backend_arg!r} must be a backend name (a str) or None; "
                                   f"see portakern.list_backends() for the registered names")
        if not backend_arg:   # an empty name (an unset variable) must not quietly mean "any backend"
            raise InvalidInputError(f"backend='' is not a backend name: registered backends are {_registered()}; "
                                    "pass one of them, or backend=None to let dispatch choose")
    return (backend_arg, _context.get(), _override_env())


@contextlib.contextmanager
def use_backend(name: str):
    """Run every portakern call inside the ``with`` block on backend ``name`` (unless a call passes ``backend=``)."""
    if not isinstance(name, str):
        way = f"pass its name, use_backend({name.name!r})" if isinstance(name, Backend) else \
            f"pass one of the registered names ({_registered()}; see portakern.list_backends())"
        raise InvalidInputError(f"use_backend({name!r}): the backend name must be a string; {way}")
    registry().get(name)  # raises with the list of registered names
    token = _context.set((name, _context.get()[1]))
    try:
        yield
    finally:
        _context.reset(token)


POLICIES = {"priority": "the highest-priority supporting backend first (the default)",
            "fastest": "measure every supporting backend on the first call of a signature, fastest first"}


def _check_policy(name: Any, where: str) -> str:
    if not isinstance(name, str) or name not in POLICIES:   # a list or dict is no policy (nor hashable)
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
    """Whether outputs are NaN-filled before each kernel runs (inside ``poison_outputs()``)."""
    return _poison.get()
