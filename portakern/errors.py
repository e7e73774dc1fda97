"""portakern's exception hierarchy. Every public error is a ``PortakernError`` and also the
builtin exception a caller would expect (``ValueError``, ``TypeError``, ...).

The three errors the IR raises (``PortakernError``, ``InvalidInputError``, ``InvalidTypeError``) are
defined in ``portakern.ir.errors`` and re-exported here as the same classes."""

from __future__ import annotations

from portakern.ir.errors import InvalidInputError, InvalidTypeError, PortakernError

__all__ = [
    "PortakernError", "InvalidInputError", "InvalidTypeError", "UnsupportedError", "BackendError",
    "StrictModeError", "PluginError",
]


class UnsupportedError(PortakernError, NotImplementedError):
    """No backend (or not the requested one) can run this problem; the message says why."""


class BackendError(PortakernError, RuntimeError):
    """A backend failed to compile or launch a kernel it said it supports."""


class StrictModeError(BackendError):
    """``PORTAKERN_STRICT=1`` turned a fallback into an error."""


class PluginError(PortakernError, ImportError):
    """A plugin could not be loaded or registered."""
