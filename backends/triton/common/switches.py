"""The triton backend's environment switches: each variable is read here and nowhere else.

==============================  ==================================================================
variable                        meaning
==============================  ==================================================================
``TRITON_INTERPRET``            ``1``: Triton runs kernels in its CPU interpreter (Triton reads it
                                once, at its first import; the backend asks ``interpreting()``)
``PORTAKERN_TRITON_AUTOTUNE``   ``1``: the first call of a problem bucket times the candidate
                                configurations and caches the winner (``autotune.cached_best``)
``PORTAKERN_TRITON_FAST_LAUNCH``  ``0`` / ``false`` / ``off``: every launch goes through Triton's
                                ``fn[grid]`` (A/B measurement, debugging; ``launch.KernelLaunch``)
==============================  ==================================================================
"""

from __future__ import annotations

import os

AUTOTUNE_ENV = "PORTAKERN_TRITON_AUTOTUNE"
FAST_LAUNCH_ENV = "PORTAKERN_TRITON_FAST_LAUNCH"


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET`` set and not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_enabled() -> bool:
    """Whether compiles time the candidate configurations (``PORTAKERN_TRITON_AUTOTUNE`` set and not ``0``)
    instead of taking the table's."""
    return os.environ.get(AUTOTUNE_ENV, "") not in ("", "0")


def fast_launch_enabled() -> bool:
    """Whether a new ``KernelLaunch`` may bypass Triton's binding after its first call: on unless
    ``PORTAKERN_TRITON_FAST_LAUNCH`` is ``0`` / ``false`` / ``off`` (or empty)."""
    return os.environ.get(FAST_LAUNCH_ENV, "1").lower() not in ("0", "", "false", "off")
