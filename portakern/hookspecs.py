"""Hook specifications: everything a portakern plugin can provide.

A plugin is any module or object with functions marked ``@portakern.hookimpl`` and named like the
specs below. Plugins are found through the entry-point group ``portakern.backends`` (the
built-in backends register the same way), or registered by hand with
``portakern.plugins.register(obj)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .backend import Backend
    from .devices import Device

hookspec = pluggy.HookspecMarker("portakern")


@hookspec
def portakern_register_backends() -> "list[Backend]":
    """Return the backends this plugin provides.

    Called once when the registry is built. Every plugin's list is collected (this is not a
    firstresult hook). Each item is an instance of ``portakern.Backend`` with a unique ``name``;
    a duplicate name is reported as a plugin error and the later one is dropped.
    """


@hookspec(firstresult=True)
def portakern_backend_priority(backend: "Backend", op: Any, device: "Device") -> "int | None":
    """Return the rank of ``backend`` for ``op`` on ``device`` (higher runs first), or None.

    The first non-None result wins; when every plugin returns None the backend's own
    ``priority`` attribute is used. Dispatch calls this once per signature, never on the hot path.
    Use it to prefer your backend for a class of problems (say decode shapes) without editing
    the backend that ships the default.
    """


@hookspec
def portakern_conformance_cases() -> "list[Any]":
    """Return extra conformance cases (``portakern.conformance`` case objects) to add to the suite.

    Collected from every plugin. A backend author uses this to ship regression cases for bugs
    found in their backend; the cases still check against CPU-reference goldens computed on the fly.
    """
