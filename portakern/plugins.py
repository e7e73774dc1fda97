"""Plugin manager: loads backends through entry points, isolates failures, builds the registry."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from importlib import import_module, metadata
from typing import Any

import pluggy

from . import hookspecs
from .backend import Backend
from .errors import InvalidInputError, PluginError

ENTRY_POINT_GROUP = "portakern.backends"
hookimpl = pluggy.HookimplMarker("portakern")


def _isolated(e: BaseException) -> bool:
    """Whether a plugin's failure ``e`` is reported and the plugin skipped: anything but ``KeyboardInterrupt``.

    A plugin that calls ``sys.exit()`` (``SystemExit``) or raises another ``BaseException`` at import or in its
    hook must not end the host process; a Ctrl-C that lands while a plugin loads still stops the process.
    """
    return not isinstance(e, KeyboardInterrupt)


def _describe(e: BaseException) -> str:
    """``Type: message`` of a plugin's failure; ``SystemExit`` says the plugin called ``sys.exit``."""
    if isinstance(e, SystemExit):
        return f"SystemExit: the plugin called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {e}"


def _short(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for a message about a plugin's return value (``repr`` itself raising
    is named instead of propagated)."""
    try:
        text = repr(value)
    except Exception as e:
        return f"<{type(value).__name__} whose repr raised {type(e).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _is_names(value: Any) -> bool:
    return isinstance(value, (tuple, list, frozenset)) and all(isinstance(v, str) for v in value)


#: capability attribute -> (whether a value is well-formed, what it must be); dispatch, ``portakern info`` and
#: conformance read these without guarding each, so a backend with one malformed is refused at registration
_CAPABILITIES = {
    "array_kind": (lambda v: isinstance(v, str) and bool(v), "a non-empty str such as 'numpy' or 'torch'"),
    "device_types": (_is_names, "a tuple of device type names such as ('cuda',)"),
    "priority": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int (higher wins)"),
    "compile_targets": (_is_names, "a tuple of target names such as ('sm_90a',), or ()"),
    "x_prologues": (_is_names, "a tuple of prologue names, or ()"),
}


def _malformed(b: Backend) -> str:
    """What is wrong with ``b``'s capability attributes (empty when nothing): a value of the wrong type, or an
    attribute (or ``version``) whose reading raises."""
    for attr, (ok, rule) in _CAPABILITIES.items():
        try:
            value = getattr(b, attr)
        except Exception as e:
            return f"raises {type(e).__name__} when its {attr} is read: {e}"
        if not ok(value):
            return f"has {attr}={_short(value)} ({type(value).__name__}); it must be {rule}"
    try:
        str(b.version)
    except Exception as e:
        return f"raises {type(e).__name__} when its version is read: {e}"
    return ""


@dataclass
class Registry:
    """The loaded plugins and their backends, plus the errors of those that failed."""

    pm: pluggy.PluginManager
    backends: dict[str, Backend] = field(default_factory=dict)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (plugin name, error text)
    plugins: dict[str, str] = field(default_factory=dict)       # plugin name -> distribution
    origins: dict[str, str] = field(default_factory=dict)       # backend name -> plugin name

    def get(self, name: str) -> Backend:
        """The backend called ``name``; raise naming the known ones (and any failed plugin)."""
        try:
            return self.backends[name]
        except KeyError:
            known = ", ".join(sorted(self.backends)) or "none"
            failed = "".join(f"; plugin {p!r} failed to load: {e}" for p, e in self.errors)
            raise InvalidInputError(f"backend={name!r} is not registered: registered backends are "
                                    f"{known}{failed}") from None


_lock = threading.Lock()
_registry: Registry | None = None
_manual: list[tuple[str, Any]] = []


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("portakern")
    pm.add_hookspecs(hookspecs)
    return pm


def _autoload_disabled() -> bool:
    return os.environ.get("PORTAKERN_DISABLE_PLUGIN_AUTOLOAD", "").lower() not in ("", "0", "false", "no")


def _entry_points() -> list[metadata.EntryPoint]:
    eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    if _autoload_disabled():  # built-ins only, like pytest's PYTEST_DISABLE_PLUGIN_AUTOLOAD
        eps = [ep for ep in eps if ep.dist is not None and ep.dist.name == "portakern"]
    return sorted(eps, key=lambda ep: ep.name)


def _register(reg: Registry, name: str, obj: Any, dist: str) -> None:
    try:
        reg.pm.register(obj, name=name)
        reg.pm.check_pending()  # a @hookimpl whose name matches no hookspec (a typo) is an error too
    except BaseException as e:  # bad hook signature, unknown hook, duplicate name, ...
        if not _isolated(e):
            raise
        if reg.pm.is_registered(obj):
            reg.pm.unregister(obj)
        reg.errors.append((name, f"Error registering plugin {name!r}: {_describe(e)}"))
        return
    reg.plugins[name] = dist
    try:
        lists = reg.pm.subset_hook_caller("portakern_register_backends", remove_plugins=[
            p for p in reg.pm.get_plugins() if p is not obj])()
    except BaseException as e:
        if not _isolated(e):
            raise
        reg.pm.unregister(obj)
        reg.errors.append((name, f"Error in plugin {name!r} portakern_register_backends: {_describe(e)}"))
        return
    for backends in lists:
        if backends is None:
            continue
        if not isinstance(backends, (list, tuple)):   # an int, a str, one Backend, a dict, a generator, ...
            reg.errors.append((name, f"plugin {name!r} portakern_register_backends returned {_short(backends)} "
                                     f"({type(backends).__name__}); return a list of portakern.Backend instances"))
            continue
        for b in backends:
            if not isinstance(b, Backend):
                reg.errors.append((name, f"plugin {name!r} returned {_short(b)}, which is not a portakern.Backend; "
                                         "return instances of a portakern.Backend subclass"))
            elif not isinstance(b.name, str):
                reg.errors.append((name, f"plugin {name!r}: backend {type(b).__name__} has name={_short(b.name)} "
                                         f"({type(b.name).__name__}); a backend's name must be a non-empty str"))
            elif _malformed(b):
                reg.errors.append((name, f"plugin {name!r}: backend {b.name!r} {_malformed(b)}; fix the class "
                                         "attribute (see portakern.Backend's docstring)"))
            elif not b.name or b.name in reg.backends:
                owner = f" (by plugin {reg.origins[b.name]!r})" if b.name in reg.origins else ""
                reg.errors.append((name, f"plugin {name!r}: backend name {b.name!r} is empty or already taken"
                                         f"{owner}; give the backend a unique, non-empty name"))
            else:
                reg.backends[b.name] = b
                reg.origins[b.name] = name


def build_registry() -> Registry:
    """Load every entry-point plugin, then ``PORTAKERN_PLUGINS`` modules, then manual ones."""
    reg = Registry(pm=_new_manager())
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist is not None else "?"
        try:
            obj = ep.load()
        except BaseException as e:
            if not _isolated(e):
                raise
            reg.errors.append((ep.name, f'Error importing plugin "{ep.name}" ({ep.value}): {_describe(e)}'))
            continue
        _register(reg, ep.name, obj, dist)
    for modname in filter(None, (m.strip() for m in os.environ.get("PORTAKERN_PLUGINS", "").split(","))):
        try:
            obj = import_module(modname)
        except BaseException as e:
            if not _isolated(e):
                raise
            reg.errors.append((modname, f'Error importing plugin "{modname}": {_describe(e)}'))
            continue
        _register(reg, modname, obj, "PORTAKERN_PLUGINS")
    for name, obj in _manual:
        _register(reg, name, obj, "manual")
    return reg


def registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _registry
    if _registry is None:
        with _lock:
            if _registry is None:
                _registry = build_registry()
    return _registry


def reset() -> None:
    """Forget the registry and every cached dispatch plan (tests; after installing a plugin)."""
    global _registry
    from . import dispatch

    with _lock:
        _registry = None
    dispatch.clear_cache()


def register(obj: Any, name: str | None = None) -> None:
    """Register a plugin object by hand (tests, notebooks). Takes effect at once."""
    name = name or getattr(obj, "__name__", None) or type(obj).__name__
    _manual.append((name, obj))
    reset()


def unregister(name: str) -> None:
    """Drop a plugin registered with ``register``."""
    before = len(_manual)
    _manual[:] = [(n, o) for n, o in _manual if n != name]
    if len(_manual) == before:
        raise PluginError(f"plugin {name!r} was not registered by hand; hand-registered: "
                          f"{', '.join(n for n, _ in _manual) or 'none'}")
    reset()
