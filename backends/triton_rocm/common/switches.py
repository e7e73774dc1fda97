"""The triton-rocm backend's environment switch, read here and nowhere else in it.

``TRITON_INTERPRET``: ``1`` runs the kernels in Triton's CPU interpreter (Triton reads it once, at its first
import; the backend asks ``interpreting()`` whether it is set).
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is asked for (``TRITON_INTERPRET`` set and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
