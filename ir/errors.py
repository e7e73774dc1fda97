"""The errors the IR raises.

They live here so that ``portakern.ir`` imports nothing from the rest of portakern;
``portakern.errors`` re-exports these same classes (``portakern.errors.InvalidInputError is
portakern.ir.errors.InvalidInputError``) and defines the rest of the hierarchy on top of
``PortakernError``. Each is also the builtin exception a caller would expect.
"""

from __future__ import annotations

__all__ = ["PortakernError", "InvalidInputError", "InvalidTypeError"]


class PortakernError(Exception):
    """Base of every error portakern raises on purpose."""


class InvalidInputError(PortakernError, ValueError):
    """An argument has a bad value: shape, length, range, group size, page table, ..."""


class InvalidTypeError(PortakernError, TypeError):
    """An argument has the wrong type, dtype, array library or device."""
