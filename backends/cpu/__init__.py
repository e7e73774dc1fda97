"""The ``cpu`` reference backend: numpy, float64 inside. It *is* the executable form of
``docs/ir.md``: every other backend is checked against the goldens it produces.

Registered through the ``portakern.backends`` entry point like any third-party plugin.
"""

from portakern.plugins import hookimpl

from .backend import CpuBackend


@hookimpl
def portakern_register_backends():
    return [CpuBackend()]
