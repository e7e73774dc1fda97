"""portakern's exception hierarchy. Every public error is a ``PortakernError`` and also the
builtin exception a caller would expect (``ValueError``, ``TypeError``, ...)."""

from __future__ import annotations


class PortakernError(Exception):
    """Base of every error portakern raises on purpose."""


class InvalidInputError(PortakernError, ValueError):
    """An argument has a bad value: shape, length, range, group size, page table, ..."""


class InvalidTypeError(PortakernError, TypeError):
    """An argument has the wrong type, dtype, array library or device."""


class UnsupportedError(PortakernError, NotImplementedError):
    """No backend (or not the requested one) can run this problem; the message says why."""


class BackendError(PortakernError, RuntimeError):
    """A backend failed to compile or launch a kernel it said it supports."""


class StrictModeError(BackendError):
    """``PORTAKERN_STRICT=1`` turned a fallback into an error."""


class PluginError(PortakernError, ImportError):
    """A plugin could not be loaded or registered."""
