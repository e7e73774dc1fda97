"""CpuBackend: the reference backend's capabilities, as data on the core's backend base.

Everything else (the device check, the op kind -> module lookup, compile) is ``portakern.backend.Backend``'s:
``lowerings`` names the modules, and each module's ``compile(op, device)`` builds the kernel.
"""

from __future__ import annotations

import numpy as np

from portakern.backend import Backend


class CpuBackend(Backend):
    """numpy, float64 inside, on the host; every op, every shape, every format (the executable ``docs/ir.md``)."""

    name = "cpu"
    version = f"numpy {np.__version__}"
    array_kind = "numpy"
    device_types = ("cpu",)
    priority = 0
    x_prologues = ("silu_mul",)
    runtime_lengths = True  # its attention kernel reads the sequence lengths from each call's arrays
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    device_refusal = ("the cpu reference backend runs on the host only, not on {device}; "
                      "move the arrays to the CPU or pass backend=None to pick a device backend")


__all__ = ["CpuBackend"]
